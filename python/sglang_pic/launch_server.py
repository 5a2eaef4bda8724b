"""`sglang-pic serve` / `python -m sglang_pic.launch_server`: SGLang's server with our plugin.

Every SGLang server flag passes through unchanged. What we add:
- no `--model-path`: serve the embedded default model (SmolLM2-135M-Instruct, converted once);
- no GPU: pick working CPU settings (CPU engine, torch_native attention, a KV budget that fits),
  each only when the user did not choose it.
"""

from __future__ import annotations

import os
import sys


def _value_of(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def build_argv(argv: list[str]) -> list[str]:
    """The SGLang argv we run: the user's flags plus our defaults for what they left out."""
    from sglang_pic import cpu_support

    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        return argv
    model_path = _value_of(argv, "--model-path") or _value_of(argv, "--model")
    if model_path is None:
        from sglang_pic.default_model import ensure_default_model

        model_path = str(ensure_default_model())
        argv = ["--model-path", model_path, *argv]
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" or not cpu_support.has_cuda():
        cpu_support.enable_cpu_engine()
        argv += cpu_support.cpu_server_defaults(argv, model_path)
    return argv


def serve(argv: list[str]) -> int:
    # On CPU, build_argv -> enable_cpu_engine installs the import stand-ins before SGLang is imported.
    sglang_argv = build_argv(argv)

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sglang_argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
