"""Frontend DSL support: ``sgl.span(...)`` inside ``@sgl.function`` programs.

    import sglang as sgl
    import sglang_pic.lang  # adds sgl.span (the server plugin does it too) and endpoint()

    @sgl.function
    def rag(s, docs, question):
        s += "Answer from the documents.\\n"
        for d in docs:
            s += sgl.span(d)                 # cached once, reused at any offset
        s += "Question: " + question + "\\nAnswer:"
        s += sgl.gen("answer", max_tokens=16, temperature=0, stop="\\n")

    state = rag.run(docs=["..."], question="...",
                    backend=sglang_pic.lang.endpoint("http://127.0.0.1:30000"))

``endpoint(url)`` is SGLang's ``RuntimeEndpoint`` with the server's API key (``sglang-pic serve``
requires one): the ``api_key`` given, else ``$SGLANG_PIC_API_KEY``, else, for a server on this
machine, the key it generated into ``~/.cache/sglang-pic/api-keys/PORT``.

A span is text between an SSEP marker and a PDEP marker: the span is computed as if it stood alone
and whatever follows it in the program reads everything (see ``docs/spans.md``). The markers are
plain strings, so programs run against any ``sglang-pic serve --enable-span-cache`` endpoint; a
server without the span cache refuses them (HTTP 400, in the program's ``state.error()``).

Client programs import this module, so it imports only what ``span`` needs: the marker settings
(``spans.config``) and ``SpanError`` (``spans.segments``), both standard library alone, never
SGLang's server code (seconds of import time and platform warnings on every client start);
``endpoint`` imports the key lookup (``api_key``) and SGLang's ``RuntimeEndpoint`` when called.
"""

from __future__ import annotations

from typing import Any

from sglang_pic.spans import config as _config
from sglang_pic.spans.segments import SpanError


def span(text: str, mode: str = "independent") -> str:
    """Text for one span: ``mode`` is "independent" (SSEP) or "dependent" (PDEP)."""
    ssep, pdep = _config.load().markers
    if mode not in ("independent", "dependent"):
        raise SpanError(f"sgl.span: mode must be 'independent' or 'dependent', got {mode!r}")
    if not isinstance(text, str) or (mode == "independent" and not text):
        raise SpanError("sgl.span: text must be a non-empty string")
    if ssep in text or pdep in text:
        raise SpanError("sgl.span: the text contains a span marker; spans cannot be nested")
    return f"{ssep if mode == 'independent' else pdep}{text}{pdep}"


def endpoint(url: str, api_key: str | None = None, **kwargs: Any) -> Any:
    """SGLang's ``RuntimeEndpoint`` for the server at ``url``, sending its API key: ``api_key``,
    else ``$SGLANG_PIC_API_KEY``, else the key a ``sglang-pic serve`` on this machine generated
    for the URL's port (``api_key.client_key``); ``kwargs`` go to ``RuntimeEndpoint``."""
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    from sglang_pic.security.api_key import client_key

    return RuntimeEndpoint(url, api_key=api_key or client_key(url), **kwargs)


def install() -> None:
    """Expose ``span`` as ``sglang.span`` (idempotent)."""
    import sglang

    if getattr(sglang, "span", None) is not span:
        sglang.span = span


install()
