"""Our server flags in SGLang's own launchers (``python -m sglang.launch_server``, ``sglang serve``).

SGLang's plugin mechanism has no call for adding server flags, but its launchers load the plugins
before they parse the command line, and the HookRegistry can wrap what parses it:

- AROUND ``ServerArgs.add_cli_args``: our flag groups (``server_flags``) are added to SGLang's
  parser, listed before SGLang's own flags in ``--help``;
- AROUND ``prepare_server_args``: our flags are taken out of argv, checked, and turned into SGLang
  flags and handed-over variables (``launch_server.translate``) before SGLang parses the rest. A
  refused value or combination stops the launcher with one line and status 2. The API key handed
  over in ``$SGLANG_PIC_API_KEY`` leaves the environment here and becomes SGLang's ``--api-key``
  in the list SGLang parses (``api_key.to_sglang``): in memory, on no command line.

``sglang-pic serve`` does the same before it starts SGLang, and adds its defaults (the embedded
model, ``--enable-cache-report``). On a machine without an accelerator both get the CPU engine's
flags (``cpu_support.cpu_server_defaults``, each one only where the user gave none): the plugin
selects SGLang's CPU engine there, so ``python -m sglang.launch_server --model-path M`` serves.
"""

from __future__ import annotations

import sys

from sglang_pic import environment
from sglang_pic.launcher import server_flags


def around_add_cli_args(original, parser):
    """Add our groups, then SGLang's flags; our groups go first in ``--help`` (argparse lists the
    groups in ``_action_groups`` order, and SGLang's flags are in its default group)."""
    first_new = len(parser._action_groups)
    server_flags.add_arguments(parser)
    ours = parser._action_groups[first_new:]
    result = original(parser)
    groups = parser._action_groups
    for group in ours:
        groups.remove(group)
    groups[1:1] = ours  # after argparse's positionals, before its (and SGLang's) options
    return result


def around_prepare_server_args(original, argv):
    if any(a in ("-h", "--help") for a in argv):
        return original(argv)
    from sglang_pic.launcher.launch_server import translate

    prog = "sglang-pic"
    on_cpu = environment.is_on("SGLANG_USE_CPU_ENGINE")
    try:
        argv = translate(list(argv), on_cpu=on_cpu, prog=prog)
    except SystemExit as e:  # UsageError, and the PTStore checks' SystemExit("error: ...")
        if not isinstance(e.code, str):
            raise
        print(f"{prog}: error: {e.code.removeprefix('error: ')}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if on_cpu:  # the CPU engine's flags, each one the user did not give (as sglang-pic serve)
        from sglang_pic.cpu import support as cpu_support
        from sglang_pic.launcher.launch_server import _value_of

        model_path = _value_of(argv, "--model-path") or _value_of(argv, "--model")
        argv += cpu_support.cpu_server_defaults(argv, model_path)
    from sglang_pic.security import api_key

    return original(api_key.to_sglang(argv))
