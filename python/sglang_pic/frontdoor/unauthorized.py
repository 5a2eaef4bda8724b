"""A 401 that says what to send: SGLang's answers only ``{"error": "Unauthorized"}``.

A new user of ``sglang-pic serve`` does not know that the server generated a key, nor where it
is. ``UnauthorizedHint`` wraps SGLang's API-key middleware (added outside it by an AFTER hook on
``sglang.srt.utils.auth.add_api_key_middleware``) and, for a 401, replaces the body with one
that names the header and the file a generated key of this port is in (the path is no secret;
the file is its owner's alone). Admin routes say that they need the admin key.
"""

from __future__ import annotations

from typing import Any

import orjson

from .endpoints import ADMIN


class UnauthorizedHint:
    def __init__(self, app: Any, key_file: str) -> None:
        self.app = app
        self.key_file = key_file

    def message(self, path: str) -> str:
        if path in ADMIN:
            return f"{path} needs the admin key: Authorization: Bearer ADMIN_KEY"
        return ("send the API key: Authorization: Bearer KEY (a key `sglang-pic serve` "
                f"generated is in {self.key_file})")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        body: bytes | None = None

        async def hinted(message: dict) -> None:
            nonlocal body
            if message["type"] == "http.response.start" and message.get("status") == 401:
                body = orjson.dumps({"error": "Unauthorized",
                                     "message": self.message(scope.get("path", ""))})
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k != b"content-length"]
                await send({**message, "headers": [*headers, (b"content-length",
                                                             str(len(body)).encode())]})
            elif body is not None and message["type"] == "http.response.body":
                if not message.get("more_body"):
                    await send({"type": "http.response.body", "body": body})
            else:
                await send(message)

        await self.app(scope, receive, hinted)


def add_hint(result: Any, app: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook for ``add_api_key_middleware(app, ...)``: the hint outside SGLang's check."""
    # the runtime context's accessor answers on every supported SGLang (0.5.23 retired
    # ``server_args.get_global_server_args``)
    from sglang.srt.runtime_context import get_server_args

    from sglang_pic.security.api_key import DEFAULT_PORT, key_file

    try:
        port = int(get_server_args().port)
    except (ValueError, AttributeError, RuntimeError):
        port = DEFAULT_PORT
    app.add_middleware(UnauthorizedHint, key_file=str(key_file(port)))
    return result
