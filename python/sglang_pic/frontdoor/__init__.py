"""The HTTP front door: what a server admits, before SGLang's routes see a request.

* ``endpoints``: the allowlist of routes (inference to the API key, admin to the admin key only);
* ``schemas``: one strict schema per request body;
* ``paths``: paths in admin requests confined to the operator's folders;
* ``middleware``: ``FrontDoor``, the ASGI middleware applying them, with the body's size and
  time limits;
* ``connections``: the header deadline and the connection cap, in uvicorn's protocol;
* ``settings``: the flags' values in the server process.

Seams (``register``): a BEFORE hook on SGLang's ``http_server.launch_server`` adds the middleware
(SGLang's API key middleware, added later, runs outside it), an AROUND hook on uvicorn's
``Config.load`` guards the protocol class. The admin routes' auth level is raised in
``api_key.decide_auth``.
"""

from __future__ import annotations

from typing import Any

LAUNCH_SERVER = "sglang.srt.entrypoints.http_server.launch_server"


def install(server_args: Any = None, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook for ``http_server.launch_server(server_args, ...)``: add ``FrontDoor``."""
    from sglang.srt.entrypoints import http_server

    from .middleware import FrontDoor
    from .settings import front_door_config

    server_args = kwargs.get("server_args", server_args)
    if not getattr(http_server.app.state, "pic_front_door", False):
        http_server.app.add_middleware(FrontDoor, config=front_door_config(server_args))
        http_server.app.state.pic_front_door = True


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .connections import CONFIG_LOAD, around_config_load

    HookRegistry.register(LAUNCH_SERVER, install, HookType.BEFORE)
    HookRegistry.register(CONFIG_LOAD, around_config_load, HookType.AROUND)
