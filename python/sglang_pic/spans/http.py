"""HTTP extension field ``spans``: an ASGI middleware that turns it into an ordinary prompt.

SGLang parses request bodies into fixed schemas (``GenerateReqInput``, OpenAI pydantic models), so
an extra field would be dropped silently. The middleware rewrites the body before routing:

* ``POST /generate``:  ``{"spans": [...]}`` -> ``text`` (marker strings) or ``input_ids`` (-1/-2);
* ``POST /v1/completions``: ``{"spans": [...]}`` -> ``prompt``;
* ``POST /v1/chat/completions``: a message ``{"role": ..., "spans": [...]}`` -> its ``content``,
  with a trailing dependent marker after a final independent span, so the chat template's closing
  tokens (and everything after) read the spans.

Every body of these endpoints is parsed as JSON, with the parser SGLang itself uses (orjson), so
the middleware sees the keys SGLang will see: a key written ``"\\u0073pans"`` is ``spans`` to
both. A body SGLang cannot parse either (invalid JSON, nesting deeper than orjson's limit) goes on
unchanged and SGLang answers it with a 400. The OpenAI bodies are also checked with
``request_validation.check_openai_body`` (SGLang's chat validators crash on some shapes).

Bad ``spans`` and malformed bodies get HTTP 400 with the reason, in the endpoint's error format.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from sglang_pic.request_validation import check_openai_body

from . import config
from .request import spans_to_prompt, with_spans
from .segments import SpanError

_PROMPT_FIELD = {"/generate": "text", "/v1/completions": "prompt"}
_CHAT = "/v1/chat/completions"


def rewrite_body(path: str, body: Any) -> Any:
    """The request body with every ``spans`` field replaced; raises SpanError on bad spans."""
    if not isinstance(body, dict):
        return body
    if path in _PROMPT_FIELD and "spans" in body:
        return with_spans(body, _PROMPT_FIELD[path])
    if path == _CHAT and isinstance(body.get("messages"), list):
        markers = config.load().markers
        messages = []
        changed = False
        for i, message in enumerate(body["messages"]):
            if isinstance(message, dict) and "spans" in message:
                changed = True
                message = dict(message)
                spans = message.pop("spans")
                if message.get("content"):
                    raise SpanError(f"messages[{i}]: give either 'spans' or 'content', not both")
                content = spans_to_prompt(spans, markers)
                if not isinstance(content, str):
                    raise SpanError(f"messages[{i}].spans: chat spans must be text")
                last_mode = (
                    spans[-1].get("mode", "dependent") if isinstance(spans[-1], dict) else ""
                )
                if last_mode in ("independent", "ssep"):
                    content += markers[1]
                message["content"] = content
            messages.append(message)
        if changed:
            body = {**body, "messages": messages}
    return body


class SpansMiddleware:
    """Pure ASGI middleware (the request bodies of the prompt endpoints are read whole, as SGLang
    reads them; responses are not buffered)."""

    def __init__(self, app: Any, enabled: bool = True):
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if (
            scope.get("type") != "http"
            or scope.get("method") not in ("POST", "PUT")
            or (path not in _PROMPT_FIELD and path != _CHAT)
        ):
            await self.app(scope, receive, send)
            return
        raw = await _read_body(receive)
        try:
            raw = self._rewrite(path, raw)
        except ValueError as e:  # SpanError, and malformed bodies
            await _send_400(send, str(e), openai=path != "/generate")
            return
        scope = dict(scope)
        scope["headers"] = [
            (k, str(len(raw)).encode() if k == b"content-length" else v)
            for k, v in scope.get("headers", [])
        ]
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.app(scope, replay, send)

    def _rewrite(self, path: str, raw: bytes) -> bytes:
        """The body to pass on: ``raw`` itself, or re-encoded with its ``spans`` resolved."""
        if path != "/generate":
            check_openai_body(path, raw)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw  # SGLang answers with its own 400
        rewritten = rewrite_body(path, body)
        if rewritten is body:
            return raw
        if not self.enabled:
            raise SpanError(
                "the 'spans' field needs the span cache: start the server with "
                "`sglang-pic serve --enable-span-cache` (or --radix-cache-backend pic_span)"
            )
        try:
            return orjson.dumps(rewritten)
        except TypeError as e:  # orjson.JSONEncodeError: nested deeper than orjson writes
            raise ValueError(f"the request body cannot be re-encoded: {e}") from None


async def _read_body(receive: Any) -> bytes:
    chunks = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _send_400(send: Any, message: str, openai: bool) -> None:
    """400 in the error format of the endpoint (SGLang's ``/generate`` or OpenAI's)."""
    if openai:
        error = {
            "object": "error",
            "message": message,
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    else:
        error = {"error": {"message": message}}
    body = json.dumps(error).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def install_middleware(server_args: Any = None, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook for ``sglang.srt.entrypoints.http_server.launch_server(server_args, ...)``."""
    from sglang.srt.entrypoints import http_server

    from .request import span_cache_enabled

    server_args = kwargs.get("server_args", server_args)
    if not getattr(http_server.app.state, "pic_spans_middleware", False):
        http_server.app.add_middleware(SpansMiddleware, enabled=span_cache_enabled(server_args))
        http_server.app.state.pic_spans_middleware = True
