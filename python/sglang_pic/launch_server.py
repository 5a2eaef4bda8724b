"""`sglang-pic serve` / `python -m sglang_pic.launch_server`: SGLang's server with our plugin.

Every SGLang server flag passes through unchanged. What we add:
- no `--model-path`: serve the embedded default model (SmolLM2-135M-Instruct, converted once);
- no GPU: pick working CPU settings (CPU engine, torch_native attention, a KV budget that fits),
  each only when the user did not choose it;
- `--enable-position-free-kv`: keys stored un-rotated, rotated in our attention kernels; selects
  the position-free twin of the chosen attention backend (`triton` -> `pic_triton`,
  `torch_native` -> `pic_torch_native`; default `pic_triton` on GPU).
- `--enable-span-cache`: span caching (SSEP/PDEP markers, `spans` field); implies
  `--enable-position-free-kv` and selects `--radix-cache-backend pic_span`. Its knobs
  `--span-schedule isps|barrier`, `--span-recompute-tokens K`, `--span-pad-token-id ID`,
  `--span-markers SSEP,PDEP` reach SGLang's processes as `SGLANG_PIC_SPAN_*` variables.
- `--ptstore tcp://node1:7400,tcp://node2:7400 [--ptstore-token-file PATH]`: PTStore as HiCache's
  L3 tier (zero-copy `interface_v1`, host pool in shared memory so same-node store servers write
  loaded pages into it); turns on `--enable-hierarchical-cache` with the `dynamic` storage
  backend. Every HiCache flag the user sets wins. The token (that file's, or
  `$SGLANG_PIC_PTSTORE_TOKEN`) reaches SGLang's processes in that variable only: never in argv
  (`ps`) nor in the extra config (`/get_server_info` returns it); `--ptstore-token T` is refused. With `--enable-span-cache` (which HiCache does
  not combine with) span units' pages go to PTStore instead, under span-aware page keys
  (`SGLANG_PIC_SPAN_STORE`, `sglang_pic/spans/store_tier.py`).
- `--sparse-decode pariskv`: ParisKV sparse decoding for requests longer than
  `--sparse-threshold` tokens (prefill and short requests stay dense); selects the sparse twin of
  the attention backend (`triton` -> `pariskv_triton`, `torch_native` -> `pariskv_torch_native`).
  Its knobs `--sparse-topk`, `--sparse-candidates`, `--sparse-sink`, `--sparse-local`,
  `--sparse-update`, `--sparse-max-requests`, `--sparse-max-context` reach SGLang's processes as
  `SGLANG_PIC_SPARSE_*` variables.
"""

from __future__ import annotations

import json
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
    position_free = _pop_flag(argv, POSITION_FREE_FLAG)
    if _pop_flag(argv, SPAN_FLAG):
        position_free = True
        if _value_of(argv, "--radix-cache-backend") is None:
            argv += ["--radix-cache-backend", "pic_span"]
    for flag, env in SPAN_OPTIONS.items():
        value = _pop_option(argv, flag)
        if value is not None:
            os.environ[env] = value
    sparse_decode = _sparse_decode_env(argv)
    if sparse_decode and position_free:
        raise SystemExit("error: --sparse-decode does not combine with position-free KV "
                         "(--enable-position-free-kv / --enable-span-cache) yet")
    on_cpu = os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" or not cpu_support.has_cuda()
    ptstore = _pop_option(argv, PTSTORE_FLAG)
    if _pop_option(argv, PTSTORE_TOKEN_FLAG) is not None:
        raise SystemExit(f"error: {PTSTORE_TOKEN_FLAG} would put the token on the command line, "
                         f"which every user of the machine sees (ps): use "
                         f"{PTSTORE_TOKEN_FILE_FLAG} PATH or {PTSTORE_TOKEN_ENV}")
    token_file = _pop_option(argv, PTSTORE_TOKEN_FILE_FLAG)
    server_key = _pop_option(argv, PTSTORE_SERVER_KEY_FLAG)
    if ptstore is not None:
        _export_ptstore_token(token_file)
    spans = _value_of(argv, "--radix-cache-backend") == "pic_span"
    if ptstore is not None and spans:
        os.environ[SPAN_STORE_ENV] = json.dumps(
            {"servers": _endpoints(ptstore), **({"server_key": server_key} if server_key else {})})
    elif ptstore is not None:
        argv += ptstore_args(argv, ptstore, server_key, on_cpu)
    if on_cpu:
        cpu_support.enable_cpu_engine()
        argv += cpu_support.cpu_server_defaults(argv, model_path)
    if position_free:
        argv = _with_position_free_backend(argv)
    if sparse_decode:
        from sglang_pic.sparse import BACKEND_FOR

        argv = _with_backend_twin(argv, BACKEND_FOR, "--sparse-decode pariskv")
    return argv


POSITION_FREE_FLAG = "--enable-position-free-kv"
SPAN_FLAG = "--enable-span-cache"
SPAN_OPTIONS = {
    "--span-schedule": "SGLANG_PIC_SPAN_SCHEDULE",
    "--span-recompute-tokens": "SGLANG_PIC_SPAN_RECOMPUTE_TOKENS",
    "--span-pad-token-id": "SGLANG_PIC_SPAN_PAD_TOKEN_ID",
    "--span-markers": "SGLANG_PIC_SPAN_MARKERS",
}


PTSTORE_FLAG = "--ptstore"
PTSTORE_TOKEN_FLAG = "--ptstore-token"  # refused: argv is visible to every user
PTSTORE_TOKEN_FILE_FLAG = "--ptstore-token-file"
PTSTORE_SERVER_KEY_FLAG = "--ptstore-server-key"
PTSTORE_TOKEN_ENV = "SGLANG_PIC_PTSTORE_TOKEN"  # sglang_pic.store.auth.SERVE_TOKEN_ENV
SPAN_STORE_ENV = "SGLANG_PIC_SPAN_STORE"  # sglang_pic.spans.store_tier.ENV (no import: startup)


def _endpoints(servers: str) -> list[str]:
    endpoints = [s.strip() for s in servers.split(",") if s.strip()]
    if not endpoints:
        raise SystemExit(f"error: {PTSTORE_FLAG} needs store endpoints, e.g. tcp://node1:7400")
    return endpoints


def _export_ptstore_token(token_file: str | None) -> None:
    """Put the store token (of ``token_file``, else already in the environment) in
    ``$SGLANG_PIC_PTSTORE_TOKEN``, where SGLang's scheduler processes find it; checked now so a
    bad token fails here rather than in every scheduler."""
    from sglang_pic.store.auth import client_token

    try:
        token = client_token(token_file, PTSTORE_TOKEN_ENV)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: PTStore token: {e}") from None
    if token is None:
        print(f"note: no PTStore token ({PTSTORE_TOKEN_FILE_FLAG} / {PTSTORE_TOKEN_ENV}): only "
              "store servers started with --insecure will answer", file=sys.stderr)
        return
    os.environ[PTSTORE_TOKEN_ENV] = token


def ptstore_args(argv: list[str], servers: str, server_key: str | None,
                 on_cpu: bool) -> list[str]:
    """The HiCache flags that make PTStore (``servers``: comma-separated endpoints) the L3 tier;
    flags the user already gave are kept, and a user's extra-config JSON is merged over ours
    (one with a token is refused: SGLang shows the extra config to anyone who asks
    ``/get_server_info``). Removes the user's extra-config option from ``argv`` (it comes back
    merged)."""
    endpoints = _endpoints(servers)
    backend = _value_of(argv, "--hicache-storage-backend")
    if backend not in (None, "dynamic"):
        raise SystemExit(f"error: {PTSTORE_FLAG} is a HiCache storage backend; drop "
                         f"--hicache-storage-backend {backend}")
    config = {"backend_name": "ptstore", "module_path": "sglang_pic.store.hicache_backend",
              "class_name": "PTStoreHiCacheStorage", "servers": endpoints, "interface_v1": 1,
              # the host pool in a memfd: same-node store servers write loaded pages into it
              "allocator": "shm"}
    if server_key:  # public: the servers' key, when not derived from the token
        config["server_key"] = server_key
    user_config = _pop_option(argv, "--hicache-storage-backend-extra-config")
    if user_config is not None:  # the user's keys (e.g. timeout_ms, local) win over ours
        try:
            given = json.loads(user_config)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: --hicache-storage-backend-extra-config is not JSON: {e}") from None
        if not isinstance(given, dict):
            raise SystemExit("error: --hicache-storage-backend-extra-config must be a JSON object")
        if "token" in given:
            raise SystemExit("error: no token in --hicache-storage-backend-extra-config "
                             "(/get_server_info shows it): use "
                             f"{PTSTORE_TOKEN_FILE_FLAG} PATH or {PTSTORE_TOKEN_ENV}")
        config |= given
    extra = [] if "--enable-hierarchical-cache" in argv else ["--enable-hierarchical-cache"]
    wanted = {"--hicache-storage-backend": "dynamic",
              "--hicache-storage-backend-extra-config": json.dumps(config)}
    if on_cpu:  # the host-pool layout and copy path SGLang supports without CUDA
        wanted |= {"--hicache-io-backend": "direct", "--hicache-mem-layout": "layer_first"}
    for flag, value in wanted.items():
        if _value_of(argv, flag) is None:
            extra += [flag, value]
    return extra


def _pop_option(argv: list[str], flag: str) -> str | None:
    """Remove ``flag VALUE`` / ``flag=VALUE`` from argv; return the (last) value."""
    value = None
    i = 0
    while i < len(argv):
        if argv[i] == flag and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i : i + 2]
        elif argv[i].startswith(flag + "="):
            value = argv[i].split("=", 1)[1]
            del argv[i]
        else:
            i += 1
    return value


def _pop_flag(argv: list[str], flag: str) -> bool:
    present = flag in argv
    while flag in argv:
        argv.remove(flag)
    return present


def _with_position_free_backend(argv: list[str]) -> list[str]:
    """Replace (or add) `--attention-backend` with its position-free twin."""
    from sglang_pic.position_free import BACKEND_FOR

    return _with_backend_twin(argv, BACKEND_FOR, POSITION_FREE_FLAG)


def _with_backend_twin(argv: list[str], twins: dict[str, str], flag: str) -> list[str]:
    """Replace (or add: the GPU default `triton`) `--attention-backend` with its twin in
    ``twins`` (SGLang backend -> ours)."""
    chosen = _value_of(argv, "--attention-backend")
    if chosen is None:
        return [*argv, "--attention-backend", twins["triton"]]
    if chosen in twins.values():
        return argv
    if chosen not in twins:
        raise SystemExit(
            f"error: {flag} needs --attention-backend {' or '.join(twins)} (got {chosen!r})"
        )
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--attention-backend" and i + 1 < len(argv):
            out += [a, twins[chosen]]
            skip = True
        elif a.startswith("--attention-backend="):
            out.append(f"--attention-backend={twins[chosen]}")
        else:
            out.append(a)
    return out


def _sparse_decode_env(argv: list[str]) -> bool:
    """Pop `--sparse-decode pariskv` and its knobs; the knobs reach SGLang's processes as
    `SGLANG_PIC_SPARSE_*` variables (checked here, so a bad value fails before start-up)."""
    from sglang_pic import sparse
    from sglang_pic.sparse.config import SparseDecodeConfig, SparseDecodeUnsupported

    method = _pop_option(argv, sparse.FLAG)
    values = {field: _pop_option(argv, flag) for flag, field in sparse.OPTIONS.items()}
    if _pop_flag(argv, sparse.OFFLOAD_FLAG):
        values["offload"] = "1"
    if method is None:
        given = [flag for flag, field in sparse.OPTIONS.items() if values[field] is not None]
        given += [sparse.OFFLOAD_FLAG] if values.get("offload") else []
        if given:
            raise SystemExit(f"error: {', '.join(given)} need {sparse.FLAG} pariskv")
        return False
    if method != "pariskv":
        raise SystemExit(f"error: {sparse.FLAG} supports 'pariskv' (got {method!r})")
    env = {SparseDecodeConfig.env_name(k): v for k, v in values.items() if v is not None}
    try:
        SparseDecodeConfig.from_env({**os.environ, **env})
    except SparseDecodeUnsupported as e:
        raise SystemExit(f"error: {e}") from None
    os.environ.update(env)
    if values.get("offload") and "--disable-radix-cache" not in argv:
        # the tree would index pool slots offloading frees (backends.check_offload_settings)
        print(f"{sparse.OFFLOAD_FLAG}: prefix caching off (--disable-radix-cache)", flush=True)
        argv.append("--disable-radix-cache")
    return True


def _our_flags() -> list[tuple[str, str]]:
    from sglang_pic.sparse.config import SparseDecodeConfig

    d = SparseDecodeConfig()
    return [
        ("(no --model-path)", "serve the embedded SmolLM2-135M-Instruct"),
        (POSITION_FREE_FLAG, "keys stored un-rotated, rotated in our attention kernels"),
        (SPAN_FLAG, "span caching (SSEP/PDEP markers, `spans` field); implies the flag above"),
        ("--span-schedule isps|barrier", "span prefill scheduling (default isps)"),
        ("--span-recompute-tokens K", "recompute the first K tokens of each span in context"),
        ("--span-pad-token-id ID", "token that pads spans to whole pages"),
        ("--span-markers SSEP,PDEP", "the marker strings in text prompts"),
        (f"{PTSTORE_FLAG} tcp://HOST:PORT,...", "PTStore as HiCache's L3 tier"),
        (f"{PTSTORE_TOKEN_FILE_FLAG} PATH", f"file with the PTStore token (or ${PTSTORE_TOKEN_ENV})"),
        (f"{PTSTORE_SERVER_KEY_FLAG} KEY", "the store servers' public key, if not the token's"),
        ("--sparse-decode pariskv", "ParisKV sparse decoding of long requests"),
        ("--sparse-threshold N", f"context from which a request decodes sparsely ({d.threshold})"),
        ("--sparse-topk K", f"keys retrieved per KV head and step ({d.topk})"),
        ("--sparse-candidates C", f"keys kept by voting for the rerank ({d.candidates})"),
        ("--sparse-sink N", f"always-attended first tokens ({d.sink})"),
        ("--sparse-local N", f"always-attended most recent tokens ({d.local})"),
        ("--sparse-update N", f"window tokens moved to the retrieval region at once ({d.update})"),
        ("--sparse-max-requests N", f"requests decoding sparsely at once ({d.max_requests})"),
        ("--sparse-max-context N", "longest sparse context (default: the model's)"),
        ("--sparse-offload", "retrieval-region KV in host memory, its GPU pool slots freed "
                             "(turns prefix caching off)"),
    ]


def our_flags_help() -> str:
    """What `sglang-pic serve --help` prints before SGLang's own flags."""
    flags = _our_flags()
    width = max(len(flag) for flag, _ in flags) + 2
    lines = ["sglang-pic serve: every SGLang server flag below, plus:"]
    lines += [f"  {flag:<{width}}{what}" for flag, what in flags]
    lines.append("Docs: docs/position-free-kv.md, docs/spans.md, docs/store.md, "
                 "docs/sparse-decode.md, docs/eviction.md (--radix-eviction-policy sae).")
    return "\n".join(lines) + "\n"


def serve(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(our_flags_help())
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
