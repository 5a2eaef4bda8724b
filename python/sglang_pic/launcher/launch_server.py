"""`sglang-pic serve` / `python -m sglang_pic.launcher.launch_server`: SGLang's server with our plugin.

Every SGLang server flag passes through unchanged; our flags are listed, with defaults and
ranges, in `sglang_pic/launcher/server_flags.py` (`sglang-pic serve --help`, docs/configuration.md). In
order, so that a mistake costs a second and one line, not a model load:

1. `--help` prints our flags and where SGLang's are listed, without importing SGLang or torch.
2. Our flags are parsed and checked (`server_flags`; a bad value: one line naming the flag, exit
   status 2); SGLang's flags are checked against SGLang's flag names (`sglang_flags`: a typo gets
   the nearest name); combinations we cannot serve are refused (`serve_conflicts`).
3. The SGLang argv is built. Launcher defaults, each only when the user did not choose it:
   - no `--model-path`: serve the embedded default model (SmolLM2-135M-Instruct, converted once);
   - no GPU: working CPU settings (CPU engine, torch_native attention, a KV budget that fits);
   - `--enable-cache-report`: OpenAI responses count cached prompt tokens
     (`usage.prompt_tokens_details.cached_tokens`);
   - an API key (`api_key`): SGLang's `--api-key`, `--api-key-file` or `$SGLANG_PIC_API_KEY`,
     else one generated into `~/.cache/sglang-pic/api-keys/PORT`, unless `--insecure`. The
     launcher moves a `--api-key` of its command line into `$SGLANG_PIC_API_KEY` before it
     starts the server process, and the key reaches SGLang's parser in memory only
     (`sglang_launcher`).
   Our feature flags (`translate`, which SGLang's own launchers also run through our plugin,
   `sglang_launcher.py`):
   - `--enable-position-free-kv`: selects the position-free twin of the attention backend
     (`flashinfer` -> `pic_flashinfer`, `triton` -> `pic_triton`, `torch_native` ->
     `pic_torch_native`; default on a GPU `pic_flashinfer`).
   - `--enable-span-cache`: implies `--enable-position-free-kv`, selects
     `--radix-cache-backend pic_span`.
   - `--ptstore tcp://node1:7400,tcp://node2:7400 [--ptstore-token-file PATH]`: PTStore as
     HiCache's L3 tier (zero-copy `interface_v1`, host pool in shared memory so same-node store
     servers write loaded pages into it); turns on `--enable-hierarchical-cache` with the
     `dynamic` storage backend. Every HiCache flag the user sets wins. The token (that file's, or
     `$SGLANG_PIC_PTSTORE_TOKEN`) reaches SGLang's processes in that variable only: never in argv
     (`ps`) nor in the extra config (`/get_server_info` returns it); `--ptstore-token T` is
     refused. With `--enable-span-cache` (which HiCache does not combine with) span units' pages
     go to PTStore instead, under span-aware page keys (`SGLANG_PIC_SPAN_STORE`,
     `sglang_pic/spans/store_tier.py`).
   - `--sparse-decode pariskv`: selects the sparse twin of the attention backend (`triton` ->
     `pariskv_triton`, `flashinfer` -> `pariskv_flashinfer`, `torch_native` ->
     `pariskv_torch_native`); `--sparse-offload` turns prefix
     caching off.
   - every knob (`--span-*`, `--sparse-*`, `--sae-*`, `--position-free-*`, `--ptstore-trace`)
     reaches SGLang's processes as the `SGLANG_PIC_*` variable `server_flags` names: they inherit
     the launcher's environment, which is the only way our values reach them.
4. SGLang's server runs in a child process (`server_process`) that the launcher waits for. On
   SIGTERM SGLang drains the requests in flight and then SIGKILLs its own process; run in the
   launcher's process that read as `Killed` to `make`. The launcher passes SIGTERM and SIGINT on
   and reports the stop it was asked for as exit status 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sglang_pic import environment
from sglang_pic.launcher import serve_conflicts, server_flags, sglang_flags
from sglang_pic.launcher.server_flags import FLAGS, UsageError
from sglang_pic.security import api_key

PROG = "sglang-pic serve"
POSITION_FREE_FLAG = serve_conflicts.POSITION_FREE_FLAG
SPAN_FLAG = serve_conflicts.SPAN_FLAG
SPAN_OPTIONS = {name: flag.env for name, flag in FLAGS.items()
                if name.startswith("--span-")}  # flag -> the variable that hands it over
CACHE_REPORT_FLAG = "--enable-cache-report"


def _value_of(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def check(argv: list[str]) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """Our flags parsed and checked, SGLang's flag names checked, combinations we cannot serve
    refused; nothing set, nothing heavy imported. Returns (our flags given, the rest, the
    variables to hand over); raises ``UsageError``."""
    given, rest = server_flags.parse(argv, PROG)
    sglang_flags.refuse_unknown(rest)
    sglang_flags.refuse_bad_values(rest)
    env = server_flags.handed_over(given)
    serve_conflicts.refuse(given, rest)
    choice = api_key.choose(given, rest)
    api_key.choose_admin(given, rest, choice.key)
    api_key.refuse_unchecked(choice, rest)
    return given, rest, env


def build_argv(argv: list[str]) -> list[str]:
    """The SGLang argv we run: the user's flags plus our defaults for what they left out; our
    flags checked, turned into SGLang flags and handed-over variables (set in ``os.environ``).
    Raises ``UsageError`` (or a ``SystemExit`` with a message) for what cannot be served."""
    from sglang_pic.cpu import support as cpu_support

    argv = list(argv)
    if _wants_help(argv):
        return argv
    given, rest, env = check(argv)
    model_path = _value_of(rest, "--model-path") or _value_of(rest, "--model")
    if model_path is None:
        from sglang_pic.launcher.default_model import ensure_default_model

        model_path = str(ensure_default_model())
        rest = ["--model-path", model_path, *rest]
    on_cpu = environment.is_on("SGLANG_USE_CPU_ENGINE") or not cpu_support.has_cuda()
    if on_cpu:
        sglang_flags.refuse_bad_values(rest, on_cpu=True)
        cpu_support.enable_cpu_engine()
        rest += cpu_support.cpu_server_defaults(rest, model_path)
    # again with the default model and the CPU defaults (its dtype) in the argv
    serve_conflicts.refuse_for_model(given, rest)
    if CACHE_REPORT_FLAG not in rest:
        rest.append(CACHE_REPORT_FLAG)
    return apply_flags(given, env, rest, on_cpu, require_key=True)


def translate(argv: list[str], on_cpu: bool, prog: str = PROG) -> list[str]:
    """Our flags in ``argv`` checked and turned into SGLang flags and variables, without the
    launcher's defaults: what SGLang's own launchers run through our plugin."""
    given, rest = server_flags.parse(argv, prog)
    env = server_flags.handed_over(given)
    serve_conflicts.refuse(given, rest)
    return apply_flags(given, env, rest, on_cpu, require_key=False, prog=prog)


def apply_flags(given: Mapping[str, Any], env: dict[str, str], argv: list[str],
                on_cpu: bool, require_key: bool, prog: str = PROG) -> list[str]:
    """SGLang's argv for our flags ``given`` (checked) over ``argv`` (SGLang's flags); sets the
    variables ``env`` and those of PTStore in ``os.environ``, which SGLang's processes inherit.
    The API key goes to ``$SGLANG_PIC_API_KEY``, not into the argv (``api_key.hand_over``;
    ``require_key``: ``sglang-pic serve``'s rule, a key unless ``--insecure``)."""
    argv = api_key.hand_over(given, list(argv), prog, require=require_key)
    position_free = POSITION_FREE_FLAG in given or SPAN_FLAG in given
    if SPAN_FLAG in given and _value_of(argv, "--radix-cache-backend") is None:
        argv += ["--radix-cache-backend", serve_conflicts.SPAN_BACKEND]
    if "--sparse-offload" in given and "--disable-radix-cache" not in argv:
        # the tree would index pool slots offloading frees (backends.check_offload_settings)
        print("--sparse-offload: prefix caching off (--disable-radix-cache)", flush=True)
        argv.append("--disable-radix-cache")
    ptstore = given.get(PTSTORE_FLAG)
    token_file = given.get(PTSTORE_TOKEN_FILE_FLAG)
    server_key = given.get(PTSTORE_SERVER_KEY_FLAG)
    if ptstore is not None:
        _export_ptstore_token(token_file)
    spans = _value_of(argv, "--radix-cache-backend") == serve_conflicts.SPAN_BACKEND
    if ptstore is not None and spans:
        environment.hand_over(SPAN_STORE_ENV, json.dumps(
            {"servers": _endpoints(ptstore), **({"server_key": server_key} if server_key else {})}))
    elif ptstore is not None:
        argv += ptstore_args(argv, ptstore, server_key, on_cpu)
    os.environ.update(env)
    if position_free:
        argv = _with_position_free_backend(argv)
    if "--sparse-decode" in given:
        from sglang_pic.sparse import BACKEND_FOR

        argv = _with_backend_twin(argv, BACKEND_FOR, "--sparse-decode pariskv")
    return argv


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
    environment.hand_over(PTSTORE_TOKEN_ENV, token)


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
        config |= given
    from sglang_pic.store.config import PTStoreConfig

    try:  # the merged object, checked as the backend will read it (a token in it is refused)
        PTStoreConfig.from_extra(config)
    except ValueError as e:
        raise SystemExit(f"error: --hicache-storage-backend-extra-config: {e}") from None
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


def _with_position_free_backend(argv: list[str]) -> list[str]:
    """Replace (or add) `--attention-backend` with its position-free twin."""
    from sglang_pic.position_free import BACKEND_FOR, GPU_DEFAULT

    return _with_backend_twin(argv, BACKEND_FOR, POSITION_FREE_FLAG, GPU_DEFAULT)


def _with_backend_twin(argv: list[str], twins: dict[str, str], flag: str,
                       default: str = "triton") -> list[str]:
    """Replace (or add: the twin of ``default`` when no backend was chosen; CPU settings chose
    ``torch_native`` before this) `--attention-backend` with its twin in ``twins`` (SGLang
    backend -> ours)."""
    chosen = _value_of(argv, "--attention-backend")
    if chosen is None:
        return [*argv, "--attention-backend", twins[default]]
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


HELP_HEAD = f"""usage: {PROG} [sglang-pic flags] [SGLang server flags]

SGLang's HTTP server (OpenAI API included) with the sglang-pic plugin. Without --model-path it
serves the embedded SmolLM2-135M-Instruct; without a GPU it picks CPU settings (--device cpu,
--attention-backend torch_native, a KV budget that fits); it turns on --enable-cache-report. Each
choice is skipped when you pass the flag yourself.
"""

HELP_TAIL = f"""
SGLang's server flags: every flag of `python -m sglang.launch_server` is accepted here
(e.g. --model-path, --port, --host, --tp-size, --attention-backend, --max-total-tokens).
  {PROG} --help-all   these flags, then each of SGLang's (imports SGLang: ~10 s)

[$SGLANG_PIC_*]: the variable that hands a flag's value to SGLang's processes. The launcher sets
it; set the flag. A variable already in the environment (SGLang's Python Engine is configured that
way) is used when its flag is not given, and checked like it.
Docs: docs/configuration.md (every flag), docs/position-free-kv.md, docs/spans.md, docs/store.md,
docs/sparse-decode.md, docs/eviction.md (--radix-eviction-policy sae).
"""


def our_flags_help() -> str:
    """What `sglang-pic serve --help` prints: our flags; SGLang's are one flag away."""
    return HELP_HEAD + "\n" + server_flags.help_text(PROG) + HELP_TAIL


def serve(argv: list[str]) -> int:
    """``sglang-pic serve``: help, or the flags checked here (one line, status 2, in well under a
    second) and the server run in a child process (``supervise``)."""
    if _wants_help(argv):
        print(our_flags_help(), end="")
        return 0
    if "--help-all" in argv:
        print(HELP_HEAD, flush=True)
        return supervise(["--help"])
    try:
        check(argv)
    except UsageError as e:
        return usage_error(e.message)
    argv, env = api_key.off_command_line(argv, PROG)
    return supervise(argv, env)


def usage_error(message: str) -> int:
    print(f"{PROG}: error: {message.removeprefix('error: ')}", file=sys.stderr, flush=True)
    return 2


STOP_SIGNALS = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT,
                signal.SIGHUP: signal.SIGTERM}
"""Signal received -> signal passed on to the server process."""


def supervise(argv: list[str], env: Mapping[str, str] | None = None) -> int:
    """Run the server process (``server_process``: ``build_argv``, then SGLang) on our argv, with
    the variables ``env`` added to ours (the API key of a ``--api-key``), and wait for it.

    It runs in its own process group, so a signal to ours (Ctrl-C, ``kill`` of a process group,
    ``make`` stopping) reaches it once, from here: SIGTERM (and SIGHUP) makes SGLang drain the
    requests in flight and stop, SIGINT stops it as Ctrl-C does. A signal sent to the whole group
    would also reach SGLang's scheduler, whose death SGLang reports as a crash. After a stop was
    asked for, the child's end is a clean exit (0), whether SGLang exited or, its drain done,
    SIGKILLed itself; otherwise its exit status is ours (128 + N for a signal N). If this process
    dies first, the kernel sends the child SIGTERM (``server_process``)."""
    import shutil
    import tempfile

    from sglang_pic.launcher.plugin_site import plugin_env

    cmd = [sys.executable, "-m", "sglang_pic.launcher.server_process", *argv]
    # run from a source tree (nothing installed): the entry point SGLang's processes load our
    # plugin by, from a folder that lives as long as this launcher
    site = Path(tempfile.mkdtemp(prefix="sglang-pic-site-"))
    stop: list[int] = []

    def pass_on(signum: int, _frame: Any) -> None:
        stop.append(signum)
        try:
            child.send_signal(STOP_SIGNALS[signal.Signals(signum)])
        except ProcessLookupError:
            pass

    own_group = ({"process_group": 0} if sys.version_info >= (3, 11)
                 else {"preexec_fn": os.setpgrp})  # this process has no threads
    try:
        child_env = plugin_env(dict(os.environ, **(env or {}),
                                    SGLANG_PIC_LAUNCHER_PID=str(os.getpid())), site)
        child = subprocess.Popen(cmd, env=child_env, **own_group)
        previous = {s: signal.signal(s, pass_on) for s in STOP_SIGNALS}
        try:
            code = child.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    finally:
        shutil.rmtree(site, ignore_errors=True)
    if stop:
        return 0
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
