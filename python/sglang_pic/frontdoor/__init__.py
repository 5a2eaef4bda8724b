"""The HTTP front door: what a server admits, before SGLang's routes see a request.

* ``endpoints``: the allowlist of routes (inference to the API key, admin to the admin key only);
* ``schemas``: one strict schema per request body;
* ``paths``: paths in admin requests confined to the operator's folders;
* ``middleware``: ``FrontDoor``, the ASGI middleware applying them, with the body's size and
  time limits;
* ``connections``: the header deadline and the connection cap, in uvicorn's protocol;
* ``settings``: the flags' values in the server process;
* ``unauthorized``: a 401 that names the header and the generated key's file.

Seams (the ``front-door`` rows of ``sglang_pic.compat``): a BEFORE hook on SGLang's
``http_server.launch_server`` adds the middleware (``install``; SGLang's API key middleware,
added later, runs outside it), an AROUND hook on uvicorn's ``Config.load`` guards the protocol
class, an AFTER hook on ``TokenizerManager.init_tokenizer_and_processor`` bounds
``model_max_length``, an AFTER hook on SGLang's ``add_api_key_middleware`` puts
``UnauthorizedHint`` outside its key check. The admin routes' auth level is raised in
``api_key.decide_auth``.
"""

from __future__ import annotations

import os
from typing import Any


def install(server_args: Any = None, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook for ``http_server.launch_server(server_args, ...)``: add ``FrontDoor``."""
    from sglang.srt.entrypoints import http_server

    from .middleware import FrontDoor
    from .settings import front_door_config

    server_args = kwargs.get("server_args", server_args)
    # what this process writes from here on (request and crash dumps) holds prompts: its
    # files are its user's alone
    os.umask(0o077)
    if not getattr(http_server.app.state, "pic_front_door", False):
        http_server.app.add_middleware(FrontDoor, config=front_door_config(server_args))
        http_server.app.state.pic_front_door = True


def bound_model_max_length(result: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook for ``TokenizerManager.init_tokenizer_and_processor``: a tokenizer without a
    length limit carries transformers' sentinel (1e30) as ``model_max_length``, which SGLang's
    ``/v1/tokenize`` returns in an int field (a 500 on every call): use the model's context."""
    tokenizer = getattr(manager, "tokenizer", None)
    limit = getattr(tokenizer, "model_max_length", None)
    context = getattr(getattr(manager, "model_config", None), "context_len", None)
    if isinstance(limit, (int, float)) and limit > 2**31 - 1 and context:
        tokenizer.model_max_length = int(context)
    return result
