"""HTTP extension field ``spans``: turned into an ordinary prompt before the body is routed.

SGLang parses request bodies into fixed schemas (``GenerateReqInput``, OpenAI pydantic models), so
an extra field would be dropped silently. The front door (``sglang_pic.frontdoor``) calls
``resolve`` on every body it admits, before the body's schema is checked:

* ``POST /generate``:  ``{"spans": [...]}`` -> ``text`` (marker strings) or ``input_ids`` (-1/-2);
* ``POST /v1/completions``: ``{"spans": [...]}`` -> ``prompt``;
* ``POST /v1/chat/completions``: a message ``{"role": ..., "spans": [...]}`` -> its ``content``,
  with a trailing dependent marker after a final independent span, so the chat template's closing
  tokens (and everything after) read the spans.

Every body of these endpoints is parsed as JSON, with the parser SGLang itself uses (orjson), so
the rewrite sees the keys SGLang will see: a key written ``"\\u0073pans"`` is ``spans`` to both.
A body orjson cannot parse (invalid JSON, nesting deeper than its limit) is left as it is, and the
schema refuses it. Bad ``spans`` get HTTP 400 with the reason, in the endpoint's error format.
"""

from __future__ import annotations

from typing import Any

import orjson

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


def resolve(path: str, raw: bytes, enabled: bool) -> bytes:
    """The body to pass on for ``path``: ``raw`` itself, or re-encoded with its ``spans``
    resolved. Raises ``SpanError`` on bad spans (and on spans when ``enabled`` is False: the
    server runs without the span cache), ``ValueError`` on a body that cannot be re-encoded."""
    if path not in _PROMPT_FIELD and path != _CHAT:
        return raw
    if b"spans" not in raw and b"\\u" not in raw:
        return raw  # no key can be "spans" without the word or an escape (a parse saved)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth" in str(e):
            raise ValueError(f"the request body is nested too deeply ({e})") from None
        return raw  # not JSON: the schema refuses it
    rewritten = rewrite_body(path, body)
    if rewritten is body:
        return raw
    if not enabled:
        raise SpanError(
            "the 'spans' field needs the span cache: start the server with "
            "`sglang-pic serve --enable-span-cache` (or --radix-cache-backend pic_span)"
        )
    try:
        return orjson.dumps(rewritten)
    except TypeError as e:  # orjson.JSONEncodeError: nested deeper than orjson writes
        raise ValueError(f"the request body cannot be re-encoded: {e}") from None
