"""A prompt's span structure: pieces split at markers, page padding, and cache segments.

Vocabulary (MiniPIC section 2.2):

* a **piece** is the text between two markers. The piece before the first marker and every piece
  opened by the PDEP marker are *dependent*: they attend to everything before them, so their pages
  depend on the whole preceding prompt. A piece opened by the SSEP marker is an *independent span*:
  it attends only to itself (Block-Attention / EPIC semantics), so its pages start their own hash
  chain and are found again at any offset, after any prefix.
* **padding** appends pad tokens to every piece but the last until it ends on a page boundary, so
  each piece starts at a page start and its pages can be shared whole.
* a **segment** is what the radix cache stores and looks up: token range, the radix namespace
  (``RadixKey.extra_key``) its pages live under, and the key range it is looked up by.

Namespaces. An independent span lives under the request's base namespace (the same root as plain
prompts: a span computed alone *is* a prompt that starts with those tokens, and with position-free
keys its pages are valid at any offset). A dependent piece after the first lives under a namespace
derived from a digest of everything before it, so two prompts share its pages only when all that
precedes is identical, in tokens *and* structure (no false hits for context-dependent suffixes).

Link recompute (EPIC LegoLink, ``recompute_tokens = k``): the first k tokens of each span become a
dependent *link* segment recomputed in context; the rest of the span is a *tail* segment whose pages
are the standalone span's pages from offset k on.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

MAX_PIECES = 256
"""Most pieces (spans and dependent pieces) one prompt may have. Each piece is planned as a cache
unit of its own in the scheduler's queue hook, and a dependent piece's unit carries the prompt
before it: without a bound one request of markers every few tokens holds the scheduler for
minutes and its memory grows with the square of the piece count."""


class SpanError(ValueError):
    """Bad span input; SGLang's HTTP layer turns a ValueError into HTTP 400 with this message."""


@dataclass(frozen=True)
class Piece:
    """Half-open token range ``[start, end)`` of the padded prompt and whether it is independent."""

    start: int
    end: int
    independent: bool


@dataclass(frozen=True)
class Segment:
    """One cache unit of a request.

    ``[start, end)`` is where its KV sits in the request (``end`` None: up to the end of the
    sequence, prompt tail plus generated tokens; only the last segment). Its pages are found under
    radix key ``tokens[key_start:key_end]`` in ``namespace``; the request uses the slice of that
    key's KV from ``start - key_start`` on (non-zero only for a link-recompute tail).
    """

    start: int
    end: int | None
    namespace: str | None
    key_start: int
    key_end: int | None
    independent: bool

    @property
    def owns_key(self) -> bool:
        """True when the request's own KV for this segment is exactly the key's KV (insertable)."""
        return self.key_start == self.start and self.key_end == self.end


def split_pieces(
    ids: Sequence[int], ssep_id: int, pdep_id: int
) -> list[tuple[bool, list[int]]] | None:
    """Split token ids at marker ids into ``(independent, tokens)`` pieces; None if no marker.

    Empty dependent pieces (two markers in a row, a marker at the very start) are dropped; an empty
    independent span and a prompt that ends inside an independent span are errors.
    """
    if ssep_id not in ids and pdep_id not in ids:
        return None
    pieces: list[tuple[bool, list[int]]] = [(False, [])]
    for t in ids:
        if t == ssep_id:
            pieces.append((True, []))
        elif t == pdep_id:
            pieces.append((False, []))
        else:
            pieces[-1][1].append(int(t))
    for i, (independent, toks) in enumerate(pieces):
        if independent and not toks:
            raise SpanError(
                f"empty span: independent span #{i} has no tokens (a span marker followed "
                "directly by another marker or by the end of the prompt)"
            )
    pieces = [p for p in pieces if p[1]]
    if not pieces:
        raise SpanError("the prompt is empty once span markers are removed")
    if len(pieces) > MAX_PIECES:
        raise SpanError(
            f"the prompt has {len(pieces)} pieces (spans and the text between them); at most "
            f"{MAX_PIECES}"
        )
    if pieces[-1][0]:
        raise SpanError(
            "the prompt ends inside an independent span; put what should read the spans (the "
            "question) after them as a dependent segment (the PDEP marker, or a span with "
            "mode 'dependent')"
        )
    return pieces


def pad_pieces(
    pieces: Sequence[tuple[bool, Sequence[int]]], page_size: int, pad_id: int
) -> tuple[list[int], list[Piece]]:
    """Concatenate pieces, padding each but the last to a multiple of ``page_size`` tokens."""
    ids: list[int] = []
    out: list[Piece] = []
    for i, (independent, toks) in enumerate(pieces):
        start = len(ids)
        ids.extend(toks)
        if i < len(pieces) - 1 and page_size > 1:
            ids.extend([pad_id] * (-len(ids) % page_size))
        out.append(Piece(start, len(ids), independent))
    return ids, out


def encode_pieces(pieces: Sequence[Piece]) -> list[int]:
    """Flat int list for ``SamplingParams.custom_params`` (which only carries flat JSON values)."""
    flat: list[int] = []
    for p in pieces:
        flat += [p.start, p.end, int(p.independent)]
    return flat


def decode_pieces(flat: Sequence[int]) -> list[Piece]:
    if len(flat) % 3 or not flat:
        raise SpanError(f"malformed span layout {list(flat)!r}")
    pieces = [
        Piece(int(flat[i]), int(flat[i + 1]), bool(flat[i + 2])) for i in range(0, len(flat), 3)
    ]
    pos = 0
    for p in pieces:
        if p.start != pos or p.end <= p.start:
            raise SpanError(f"malformed span layout {list(flat)!r}")
        pos = p.end
    return pieces


def build_segments(
    ids: Sequence[int],
    pieces: Sequence[Piece],
    base_namespace: str | None,
    page_size: int = 1,
    recompute_tokens: int = 0,
) -> list[Segment]:
    """The cache segments of a prompt laid out as ``pieces`` (see the module docstring)."""
    link = -(-recompute_tokens // page_size) * page_size if recompute_tokens > 0 else 0
    segments: list[Segment] = []
    chain = _Chain(base_namespace, ids)

    def add(seg: Segment) -> None:
        segments.append(seg)
        chain.update(seg)

    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        end = None if last else p.end
        if not p.independent:
            ns = base_namespace if p.start == 0 else chain.namespace()
            add(Segment(p.start, end, ns, p.start, end, False))
        elif link == 0 or link >= p.end - p.start:
            if link:  # the whole span is within the link: it is simply recomputed in context
                add(Segment(p.start, end, chain.namespace(), p.start, end, False))
            else:
                add(Segment(p.start, end, base_namespace, p.start, end, True))
        else:
            cut = p.start + link
            add(Segment(p.start, cut, chain.namespace(), p.start, cut, False))
            add(Segment(cut, end, base_namespace, p.start, p.end, True))
    return segments


class _Chain:
    """The namespace of a dependent segment: a digest of the tokens and structure of every
    segment before it, kept as one running hash (each segment hashed once: linear in the
    prompt, whatever the number of segments)."""

    def __init__(self, base: str | None, ids: Sequence[int]) -> None:
        self.base = base or ""
        self.ids = ids
        self.hash = hashlib.sha256()

    def update(self, s: Segment) -> None:
        self.hash.update(
            array("q", [s.start, s.end or -1, s.key_start, int(s.independent)]).tobytes())
        self.hash.update(array("q", self.ids[s.start : s.end]).tobytes())

    def namespace(self) -> str:
        return f"{self.base}\x1fpic-dep:{self.hash.copy().hexdigest()[:32]}"
