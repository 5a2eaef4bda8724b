"""Prompt id ranges, computed once per prompt of a request and shared by the hooks that need
them: the span resolver (``spans.request``: can the prompt hold a marker?) and the request
validation (``request_validation``: is every id in the vocabulary?). A leaf module, so that
neither of the two imports the other."""

from __future__ import annotations

from array import array
from typing import Any


def id_range(seq: list) -> tuple[int, int] | None:
    """``(min, max)`` of a non-empty list of ints, or None when an element is not an int (bool
    counts, as ``isinstance`` says) or does not fit 64 bits. One C pass packs the list and numpy
    reduces it: every prompt's ids pass here on the tokenizer's thread, where a Python loop over
    an 8K-token prompt cost ~0.35 ms (1.1 ms with the span check), a share of every request's
    latency at large batches. The pass itself is ~25 ns a token on a loaded 2-core machine (a
    32 x 8K batch: ~7 ms), so the two hooks that need it share one per prompt
    (``request_id_range``)."""
    if not seq:
        return None
    try:
        packed = array("q", seq)
    except (TypeError, OverflowError):
        return None
    import numpy as np

    view = np.frombuffer(packed, dtype=np.int64)
    return int(view.min()), int(view.max())


# one request's prompt id ranges, shared by the span resolver and ``check_generate_request``
_ranges_owner: Any = None
_ranges: dict[int, tuple[list, int, tuple[int, int] | None]] = {}


def request_id_range(owner: Any, seq: list) -> tuple[int, int] | None:
    """``id_range(seq)``, computed once per prompt of the request ``owner`` (its
    ``GenerateReqInput``).

    Two BEFORE hooks on ``TokenizerManager.generate_request`` need every prompt's id range: the
    span resolver (``spans.request``: can the prompt hold a marker?) and ``check_generate_request``
    (is every id in the vocabulary?). Each pass costs ~25 ns a token, ~18 ms for a 32 x 8K batch
    when both made their own: the span server's largest per-request cost on requests without
    spans (``benchmark/bench_nonspan_overhead.py`` divides it by the 32 decode steps it times).
    A prompt is looked up by identity (the entry holds the list, so its ``id`` is not reused)
    and length, for the owner only; ``forget_request_ranges`` drops them at the end of the
    validation and at the start of the resolver, so nothing outlives one ``generate_request``
    call (a client may send the same list object again, changed)."""
    global _ranges_owner, _ranges
    if owner is not _ranges_owner:
        _ranges_owner, _ranges = owner, {}
    hit = _ranges.get(id(seq))
    if hit is not None and hit[0] is seq and hit[1] == len(seq):
        return hit[2]
    bounds = id_range(seq)
    _ranges[id(seq)] = (seq, len(seq), bounds)
    return bounds


def forget_request_ranges() -> None:
    """Drop the ranges ``request_id_range`` kept (see there)."""
    global _ranges_owner, _ranges
    _ranges_owner, _ranges = None, {}
