"""`sglang-pic`: the command line of our distribution.

    sglang-pic serve [SGLang server flags...]   the SGLang HTTP server (OpenAI API included) with
                                                our plugin; no --model-path serves SmolLM2-135M
    sglang-pic setup-cpu                        install the CPU start-up hook in this environment
    sglang-pic store [--endpoint ...]           run a PTStore server (HiCache L3 tier)
    sglang-pic store-status ENDPOINT...         counters of running PTStore servers
    sglang-pic --version                        our, SGLang's and torch's versions
"""

from __future__ import annotations

import argparse
import sys


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

    from sglang_pic import cpu_support

    path = cpu_support.write_pth(sysconfig.get_paths()["purelib"])
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from sglang_pic.launch_server import serve

        return serve(argv[1:])
    if argv and argv[0] == "setup-cpu":
        return _setup_cpu()
    if argv and argv[0] in ("store", "store-status"):
        from sglang_pic.store import cli as store_cli

        return (store_cli.serve if argv[0] == "store" else store_cli.status)(argv[1:])

    parser = argparse.ArgumentParser(
        prog="sglang-pic",
        description="SGLang distribution for span-heavy serving. "
        "`sglang-pic serve --help` lists the server flags (all of SGLang's pass through).",
    )
    parser.add_argument("--version", action="store_true", help="print versions and exit")
    parser.add_argument("command", nargs="?",
                        choices=["serve", "setup-cpu", "store", "store-status"])
    args = parser.parse_args(argv)
    if args.version:
        print(" ".join(f"{k} {v}" for k, v in versions().items()))
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
