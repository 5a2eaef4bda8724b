"""The SGLang server process that ``sglang-pic serve`` starts and waits for.

``python -m sglang_pic.launcher.server_process ARGV...`` (the user's ``sglang-pic serve`` argv) builds
SGLang's argv (``launch_server.build_argv``: the default model, CPU settings, our flags handed
over) and runs what SGLang's own launcher runs (``load_plugins``, ``prepare_server_args``,
``run_server``). Before that it parses SGLang's argv once with SGLang's parser, so a mistake is one
line (an unknown flag with the nearest name, a bad value) rather than argparse's 432 lines of
usage, and it caches SGLang's flag names for the launcher's own check (``sglang_pic.launcher.sglang_flags``).
Once all of that passed, it generates the API key when none was given (``api_key``).

``--help`` prints SGLang's help with our flags first and ``--model-path`` optional (the launcher
serves the embedded model without it): ``sglang-pic serve --help-all``.

It runs as a child, not in the launcher's process, because of how SGLang stops on SIGTERM: it
drains the requests in flight and then SIGKILLs its own process (``kill_process_tree`` with
``include_parent=True``), which a parent such as ``make`` reports as ``Killed``. The launcher
waits for this process and reports the stop it was asked for as a clean exit. The launcher stays
small (it never imports torch or SGLang); everything heavy happens here.
"""

from __future__ import annotations

import os
import signal
import sys

from sglang_pic import environment
from sglang_pic.launcher.sglang_flags import SERVE_PROG as PROG


def _die_with_launcher(launcher: int) -> None:
    """Stop (as on SIGTERM: drain, then exit) when the launcher dies, e.g. by SIGKILL, instead of
    serving on as an orphan. Linux only; elsewhere the launcher's process group is the bound."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != launcher:  # it died before the line above
        sys.exit(0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    given_argv = list(argv)
    launcher = environment.take("SGLANG_PIC_LAUNCHER_PID")
    if launcher is not None:
        _die_with_launcher(int(launcher))
    from sglang_pic.launcher.launch_server import build_argv, usage_error

    try:
        # on CPU this selects SGLang's CPU engine (variables, import stand-ins) before SGLang's
        # first import
        argv = build_argv(argv)
    except SystemExit as e:  # UsageError, and the PTStore checks' SystemExit("error: ...")
        if not isinstance(e.code, str):
            raise
        return usage_error(e.code)

    from sglang.srt.plugins import load_plugins

    from sglang_pic import plugin
    from sglang_pic.launcher import plugin_site, sglang_flags
    from sglang_pic.launcher.server_flags import UsageError
    from sglang_pic.launcher.sglang_flags import sglang_parser
    from sglang_pic.security import api_key

    load_plugins()
    if not plugin.registered():  # SGLang's processes would serve without our plugin
        return usage_error(plugin_site.not_loaded_reason())
    parser = sglang_parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    names = sglang_flags.option_strings(parser)
    sglang_flags.save(names)
    try:
        sglang_flags.refuse_unknown(argv, names)
        if "--config" not in argv:  # SGLang merges a config file's flags first
            parser.parse_args(argv)
        # last of the checks: a start refused before this leaves a running server's key file
        api_key.generate_unless_given(given_argv, PROG)
    except UsageError as e:
        return usage_error(e.message)

    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
