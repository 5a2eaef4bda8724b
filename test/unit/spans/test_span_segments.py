"""Span layout logic without a server: marker splitting, page padding, namespaces, link segments."""

from __future__ import annotations

import pytest
from sglang_pic.spans.request import PDEP_ID, SSEP_ID, layout_prompt, spans_to_prompt
from sglang_pic.spans.segments import (
    MAX_PIECES,
    SpanError,
    build_segments,
    decode_pieces,
    split_pieces,
)


def test_split_drops_empty_dependent_pieces_and_rejects_bad_ones():
    assert split_pieces([1, 2], SSEP_ID, PDEP_ID) is None
    assert split_pieces([PDEP_ID, 1, SSEP_ID, 2, PDEP_ID, PDEP_ID, 3], SSEP_ID, PDEP_ID) == [
        (False, [1]), (True, [2]), (False, [3])]
    with pytest.raises(SpanError, match="empty span"):
        split_pieces([1, SSEP_ID, PDEP_ID, 2], SSEP_ID, PDEP_ID)
    with pytest.raises(SpanError, match="ends inside"):
        split_pieces([1, SSEP_ID, 2], SSEP_ID, PDEP_ID)


def test_a_prompt_of_too_many_pieces_is_refused():
    """Markers every few tokens: each piece would be planned as a cache unit in the scheduler."""
    def prompt(documents: int) -> list[int]:  # 1 + 2 x documents pieces
        ids = [1]
        for i in range(documents):
            ids += [SSEP_ID, 10 + i, PDEP_ID, 2]
        return ids

    fits = (MAX_PIECES - 1) // 2
    assert len(split_pieces(prompt(fits), SSEP_ID, PDEP_ID)) == 1 + 2 * fits
    with pytest.raises(SpanError, match=f"{3 + 2 * fits} pieces .* at most {MAX_PIECES}"):
        split_pieces(prompt(fits + 1), SSEP_ID, PDEP_ID)
    with pytest.raises(SpanError, match="at most"):
        layout_prompt(prompt(fits + 1), marker_ids=(SSEP_ID, PDEP_ID), page_size=1, pad_id=0)


def test_padding_puts_every_piece_on_a_page_start():
    ids, layout = layout_prompt([1, 2, 3, SSEP_ID, 4, 5, PDEP_ID, 6], marker_ids=(SSEP_ID, PDEP_ID),
                                page_size=4, pad_id=0)
    assert ids == [1, 2, 3, 0, 4, 5, 0, 0, 6]
    assert [(p.start, p.end, p.independent) for p in decode_pieces(layout)] == [
        (0, 4, False), (4, 8, True), (8, 9, False)]


def _segments(ids, page_size=1, recompute=0, base=None):
    padded, layout = layout_prompt(ids, marker_ids=(SSEP_ID, PDEP_ID), page_size=page_size, pad_id=0)
    return padded, build_segments(padded, decode_pieces(layout), base, page_size, recompute)


def test_spans_share_a_namespace_dependent_pieces_depend_on_everything_before():
    _, a = _segments([1, 2, SSEP_ID, 7, 8, PDEP_ID, 9])
    _, b = _segments([3, 4, 5, SSEP_ID, 7, 8, PDEP_ID, 9])
    _, c = _segments([1, 2, SSEP_ID, 6, 8, PDEP_ID, 9])
    assert a[1].namespace is None  # a span lives under the base root (SSEP: h_0)
    assert a[1].namespace == b[1].namespace
    assert a[2].namespace != b[2].namespace  # same question, other prefix
    assert a[2].namespace != c[2].namespace  # same question, other document
    assert a[-1].end is None and a[0].namespace is None


def test_a_dependent_namespace_digests_every_segment_before_it():
    """The namespace is the digest of the structure and tokens of all earlier segments (what
    the store's keys and the radix tree's roots are made of): computed here from its
    definition, for the question after two documents."""
    import hashlib
    from array import array

    padded, segs = _segments([1, 2, SSEP_ID, 7, 8, SSEP_ID, 5, PDEP_ID, 9], base="t")
    h = hashlib.sha256()
    for s in segs[:-1]:
        h.update(array("q", [s.start, s.end, s.key_start, int(s.independent)]).tobytes())
        h.update(array("q", padded[s.start:s.end]).tobytes())
    assert segs[-1].namespace == f"t\x1fpic-dep:{h.hexdigest()[:32]}"


def test_link_recompute_splits_each_span():
    _, segs = _segments([1, SSEP_ID, *range(10, 20), PDEP_ID, 9], page_size=2, recompute=3)
    # the link is rounded up to a page (4 tokens); the tail is looked up by the whole span
    link, tail = segs[1], segs[2]
    assert (link.start, link.end, link.independent) == (2, 6, False)
    assert (tail.start, tail.end, tail.key_start, tail.key_end) == (6, 12, 2, 12)
    assert not tail.owns_key and link.owns_key


def test_spans_field_validation():
    assert spans_to_prompt([{"text": "a"}, {"text": "b", "mode": "independent"}, {"text": "c"}],
                           ("<s>", "<p>")) == "a<s>b<p>c"
    assert spans_to_prompt([{"input_ids": [1]}, {"input_ids": [2], "mode": "ssep"}]) == [
        1, SSEP_ID, 2]
    for bad, msg in [([], "non-empty"), ([{"text": 1}], "string"), ([{"txt": "a"}], "unknown"),
                     ([{"text": "a"}, {"input_ids": [1]}], "mix"),
                     ([{"text": "a", "input_ids": [1]}], "exactly one")]:
        with pytest.raises(SpanError, match=msg):
            spans_to_prompt(bad)


def test_plain_token_ids_are_passed_over_without_a_per_token_scan():
    """Every prompt on a span server meets the resolver; a list whose ids are all within the
    vocabulary (below the marker tokens added after it) is not a span prompt."""
    from types import SimpleNamespace

    from sglang_pic.spans.request import SpanRequestResolver

    resolver = SpanRequestResolver.__new__(SpanRequestResolver)
    resolver.enabled, resolver.marker_ids = True, (49152, 49153)  # the added marker tokens
    resolver.cfg = SimpleNamespace(markers=("<|ssep|>", "<|pdep|>"))
    resolver.page_size, resolver.pad_id = 4, 0
    assert not resolver._may_hold_markers(list(range(49152)))
    assert resolver._resolve_one(list(range(100))) is None
    for span_prompt in ([1, 2, SSEP_ID, 3, PDEP_ID, 4], [1, 2, 49152, 3, 49153, 4]):
        assert resolver._may_hold_markers(span_prompt)
        ids, layout = resolver._resolve_one(span_prompt)
        assert SSEP_ID not in ids and 49152 not in ids and layout
    assert resolver._may_hold_markers([1, "x"])  # not all ints: the full checks decide
    with pytest.raises(SpanError):
        resolver._resolve_one([1, -7, 2])  # a negative id that is no marker
