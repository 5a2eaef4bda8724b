"""A refused request: its status and message, and how it is sent (the endpoint's error format)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson

Send = Callable[[dict], Awaitable[None]]


class Refused(Exception):
    """Raised while a request is admitted; ``close``: the body was not read whole, so the
    connection closes after the answer (its rest is never buffered)."""

    def __init__(self, status: int, message: str, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close



async def send_error(send: Send, status: int, message: str, openai: bool,
                     close: bool = False) -> None:
    """``status`` with ``message``, in SGLang's ``/generate`` or OpenAI's error format."""
    if openai:
        error: dict = {"object": "error", "message": message, "type": _KIND.get(status, "Error"),
                       "param": None, "code": status}
    else:
        error = {"error": {"message": message, "code": status}}
    body = orjson.dumps(error)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_KIND = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
         404: "NotFoundError", 408: "RequestTimeoutError", 413: "RequestTooLargeError"}
