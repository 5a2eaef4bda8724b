"""`sglang-pic`: the command line of our distribution.

Each command is dispatched before anything heavy is imported, so `sglang-pic --help` and
`sglang-pic serve --help` answer at once; COMMANDS is the one list of them (name, one line).
"""

from __future__ import annotations

import argparse
import difflib
import sys

COMMANDS = {
    "serve": "SGLang's HTTP server (OpenAI API too) with our plugin; see serve --help",
    "store": "run a PTStore server (HiCache's L3 tier, span pages)",
    "store-status": "print the counters of running PTStore servers (ENDPOINT...)",
    "fleet": "N serve instances behind SGLang's router, sharing M PTStore servers",
    "setup-cpu": "install the CPU start-up hook (import stand-ins) in this environment",
}


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from sglang_pic import __version__

    out = {"sglang-pic": __version__}
    for dist in ("sglang", "torch", "triton"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _setup_cpu() -> int:
    import sysconfig

    from sglang_pic.cpu import support as cpu_support

    path = cpu_support.write_pth(sysconfig.get_paths()["purelib"])
    print(f"wrote {path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-pic",
        description="SGLang distribution for span-heavy serving.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {name:<14}{what}" for name, what in COMMANDS.items()),
    )
    parser.add_argument("--version", action="store_true",
                        help="print our, SGLang's, torch's and triton's versions")
    parser.add_argument("command", nargs="?", metavar="COMMAND", help="one of the commands below")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("serve", "fleet", "setup-cpu"):  # the commands that run SGLang
        from sglang_pic.compat.versions import UnsupportedSGLang, require_supported_sglang

        try:
            require_supported_sglang()
        except UnsupportedSGLang as e:
            print(f"sglang-pic: {e}", file=sys.stderr)
            return 2
    if argv and argv[0] == "serve":
        from sglang_pic.launcher.launch_server import serve

        return serve(argv[1:])
    if argv and argv[0] == "setup-cpu":
        return _setup_cpu()
    if argv and argv[0] == "fleet":
        from sglang_pic.fleet.cli import main as fleet

        return fleet(argv[1:])
    if argv and argv[0] in ("store", "store-status"):
        from sglang_pic.store import cli as store_cli

        return (store_cli.serve if argv[0] == "store" else store_cli.status)(argv[1:])

    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.version and not extra and args.command is None:
        print(" ".join(f"{k} {v}" for k, v in versions().items()))
        return 0
    wrong = extra[0] if extra else args.command
    if wrong is not None:
        what, names = (("argument", ["--version", "--help"]) if wrong.startswith("-")
                       else ("command", list(COMMANDS)))
        guess = difflib.get_close_matches(wrong, names, n=1)
        hint = f" (did you mean {guess[0]}?)" if guess else f" (one of: {', '.join(names)})"
        print(f"sglang-pic: error: unknown {what} {wrong}{hint}", file=sys.stderr)
        return 2
    parser.print_help()
    return 0 if any(a in ("-h", "--help") for a in argv) else 2


if __name__ == "__main__":
    sys.exit(main())
