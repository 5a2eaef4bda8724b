"""The router's process: ``python -m sglang_pic.fleet.router_process ROUTER-FLAGS...``.

It runs SGLang's router through the router's own Python launcher (``parse_router_args`` and
``launch_router`` of ``sglang_router.launch_router``), with one change: the API key. The
router's only way to take a key is ``--api-key KEY``, a command line every user of the machine
reads (``ps``), so the fleet hands the key over in ``$SGLANG_PIC_API_KEY`` instead (a process's
environment is readable by its own user only), and this process moves it from there into the
parsed ``RouterArgs``. With the key set the router answers 401 to requests without it and sends
it to the instances ("workers listed in --worker-urls inherit the router API key"), so one key
covers the fleet.
"""

from __future__ import annotations

import sys

from sglang_pic import environment
from sglang_pic.security.api_key import ENV


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    key = environment.take(ENV)
    if not key:
        print(f"sglang-pic fleet router: error: no API key in ${ENV}", file=sys.stderr)
        return 2
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(argv)
    args.api_key = key
    launch_router(args)  # serves until SIGTERM (it drains first) or SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
