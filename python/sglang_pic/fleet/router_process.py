"""The router's process: ``python -m sglang_pic.fleet.router_process ROUTER-FLAGS...``.

It runs SGLang's router through the router's own Python launcher (``parse_router_args`` and
``launch_router`` of ``sglang_router.launch_router``), with one change: the keys. The router
takes keys only on its command line, which every user of the machine reads (``ps``), so the
fleet hands them over in the environment instead (a process's environment is readable by its
own user only), and this process moves them into the parsed ``RouterArgs``:

* the API key (``$SGLANG_PIC_API_KEY``): with it the router answers 401 to requests without it
  and sends it to the instances ("workers listed in --worker-urls inherit the router API key"),
  so one key covers the fleet's clients;
* the router's admin key (``CONTROL_ENV``), an admin-role control-plane key: without one the
  router guards its control plane (``/workers`` add and remove, ``/v1/tokenizers``, ``/wasm``)
  with the API key, so every client could add a worker of its own (and receive other clients'
  prompts) or remove the fleet's instances. The fleet makes this key, keeps it in a private file
  of its log folder, and uses it for its own calls.
"""

from __future__ import annotations

import sys

from sglang_pic import environment
from sglang_pic.security.api_key import ENV

CONTROL_ENV = "SGLANG_PIC_ROUTER_ADMIN_KEY"
"""Where the router's process finds its admin (control-plane) key."""
CONTROL_KEY_ID = "sglang-pic-fleet"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    key, control_key = environment.take(ENV), environment.take(CONTROL_ENV)
    for name, value in ((ENV, key), (CONTROL_ENV, control_key)):
        if not value:
            print(f"sglang-pic fleet router: error: no key in ${name}", file=sys.stderr)
            return 2
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(argv)
    args.api_key = key
    # (id, name, key, role), as the router's parser makes them from --control-plane-api-keys
    args.control_plane_api_keys = [(CONTROL_KEY_ID, "sglang-pic fleet", control_key, "admin")]
    launch_router(args)  # serves until SIGTERM (it drains first) or SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
