"""Span-aware routing through SGLang's router: a request's routing key from its spans.

The router's ``cache_aware`` policy matches the text prefix of a request. A span request's
documents come in any order after any system prompt, so two requests sharing documents rarely
share a prefix and the router spreads them as if they shared nothing. The router's ``manual``
policy instead keeps every request carrying one ``X-SMG-Routing-Key`` on one instance. This
module gives a span request its key: a MinHash of its independent spans, the span content whose
hash is smallest. Two requests get the same key with probability equal to the Jaccard
similarity of their span sets (Broder, 1997), so requests sharing documents meet on the instance
whose cache already holds them, while keys (one per document that is some request's minimum)
are many enough for the router to spread the load.

The key is computed where the prompt is built, by the client or a gateway in front of the
router (``span_routing_key``); ``sglang-pic fleet --policy manual`` runs the router with the
policy that reads it. A request without spans gets no key and the router picks an instance at
random.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ..spans.request import PDEP_ID, SSEP_ID

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""The header the router's ``manual`` policy routes on."""


def span_digest(content: bytes) -> str:
    """A span's digest as the routing key uses it (``independent_spans`` gives the bytes)."""
    return hashlib.blake2b(content, digest_size=8).hexdigest()


def independent_spans(prompt: str | Sequence[int],
                      markers: tuple[str, str] | None = None) -> list[bytes]:
    """The content of each independent span of ``prompt`` (text with the marker strings, or ids
    with ``SSEP_ID`` / ``PDEP_ID``): from a span marker up to the next marker or the end."""
    if isinstance(prompt, str):
        if markers is None:
            from ..spans import config as span_config

            markers = span_config.load().markers
        ssep, pdep = markers
        spans = []
        for part in prompt.split(ssep)[1:]:
            content = part.split(pdep, 1)[0]
            if content:
                spans.append(content.encode())
        return spans
    spans, current = [], None
    for t in prompt:
        if t in (SSEP_ID, PDEP_ID):
            if current:
                spans.append(b"".join(current))
            current = [] if t == SSEP_ID else None
        elif current is not None:
            current.append((int(t) & 0xFFFFFFFF).to_bytes(4, "little"))
    if current:
        spans.append(b"".join(current))
    return spans


def span_routing_key(prompt: str | Sequence[int], markers: tuple[str, str] | None = None,
                     buckets: int | None = None) -> str | None:
    """The request's routing key, or None when it has no independent spans.

    Without ``buckets``: the smallest digest of its spans (16 hex characters, a MinHash).
    With ``buckets`` (the fleet's instance count): every span belongs to one of ``buckets``
    groups by its digest, and the key names the group holding most of the request's span
    bytes (``span-group-B``); with the router assigning each new key to the instance with the
    fewest keys in flight (``--assignment-mode min_group``), the groups spread over the
    instances under concurrent load, so the spans are partitioned over the fleet and a request
    goes where most of its spans live (sequential requests tie, and the router picks)."""
    spans = independent_spans(prompt, markers)
    return key_of_spans([(span_digest(s), len(s)) for s in spans], buckets)


def key_of_spans(spans: Sequence[tuple[str, int]], buckets: int | None = None) -> str | None:
    """``span_routing_key`` from each span's digest and size (for callers that hash their
    spans once and route many requests over them)."""
    if not spans:
        return None
    if buckets is None:
        return min(d for d, _ in spans)
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    weight = [0] * buckets
    for digest, size in spans:
        weight[int(digest, 16) % buckets] += size
    return f"span-group-{max(range(buckets), key=weight.__getitem__)}"
