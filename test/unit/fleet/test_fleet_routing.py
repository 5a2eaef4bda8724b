"""The span routing key (``sglang_pic.fleet.routing``): a MinHash of a request's independent
spans, the same for any order of the spans and any prefix before them, equal for two requests
with the probability of their span sets' Jaccard similarity."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sglang_pic.fleet.routing import independent_spans, span_routing_key
from sglang_pic.spans.request import PDEP_ID, SSEP_ID

MARKERS = ("<|ssep|>", "<|pdep|>")


def ids_prompt(system: list[int], docs: list[list[int]], question: list[int]) -> list[int]:
    out = list(system)
    for d in docs:
        out += [SSEP_ID, *d]
    return out + [PDEP_ID, *question]


def text_prompt(system: str, docs: list[str], question: str) -> str:
    return system + "".join(MARKERS[0] + d for d in docs) + MARKERS[1] + question


docs_strategy = st.lists(st.lists(st.integers(0, 150_000), min_size=1, max_size=20),
                         min_size=1, max_size=8, unique_by=tuple)


@given(docs=docs_strategy, system=st.lists(st.integers(0, 150_000), max_size=10),
       other=st.lists(st.integers(0, 150_000), max_size=10), seed=st.integers(0, 10**6))
def test_the_key_ignores_the_order_of_spans_and_what_surrounds_them(docs, system, other, seed):
    shuffled = docs[:]
    random.Random(seed).shuffle(shuffled)
    assert span_routing_key(ids_prompt(system, docs, [1, 2])) \
        == span_routing_key(ids_prompt(other, shuffled, [3]))


def test_the_spans_are_cut_at_the_next_marker_of_either_kind():
    prompt = [7, SSEP_ID, 1, 2, SSEP_ID, 3, PDEP_ID, 4, 5, SSEP_ID, 6]
    assert independent_spans(prompt) == [
        b"".join(t.to_bytes(4, "little") for t in span) for span in ([1, 2], [3], [6])]
    assert independent_spans(text_prompt("sys", ["a b", "c"], "q"), MARKERS) == [b"a b", b"c"]


def test_text_and_ids_prompts_without_spans_have_no_key():
    assert span_routing_key([1, 2, 3]) is None
    assert span_routing_key([1, PDEP_ID, 2]) is None  # a dependent segment only
    assert span_routing_key("no markers here", MARKERS) is None


def test_the_key_is_one_of_the_spans_and_changes_with_their_content():
    a = span_routing_key(text_prompt("s", ["doc one", "doc two"], "q"), MARKERS)
    assert a in {span_routing_key(text_prompt("", [d], ""), MARKERS)
                 for d in ("doc one", "doc two")}
    assert a != span_routing_key(text_prompt("s", ["doc three", "doc four"], "q"), MARKERS)


@pytest.mark.parametrize("shared", [0, 2, 4, 6])
def test_two_requests_meet_as_often_as_their_span_sets_overlap(shared):
    """Over many pairs of 6-document requests sharing ``shared`` documents, the keys agree about
    as often as the Jaccard similarity shared / (12 - shared) says (MinHash's promise)."""
    rng = random.Random(shared)
    trials, same = 2000, 0
    for _ in range(trials):
        common = [[rng.randrange(10**6) for _ in range(4)] for _ in range(shared)]
        own = [[[rng.randrange(10**6) for _ in range(4)] for _ in range(6 - shared)]
               for _ in range(2)]
        keys = {span_routing_key(ids_prompt([], common + o, [])) for o in own}
        same += len(keys) == 1
    jaccard = shared / (12 - shared)
    assert abs(same / trials - jaccard) < 0.04, (same / trials, jaccard)


def test_with_groups_the_key_names_the_group_holding_most_of_the_span_bytes():
    from sglang_pic.fleet.routing import key_of_spans, span_digest

    docs = [[i] * (10 * (i + 1)) for i in range(6)]  # sizes 10..60 tokens
    prompt = ids_prompt([1], docs, [2])
    weight = [0, 0, 0]
    for d in docs:
        content = b"".join(t.to_bytes(4, "little") for t in d)
        weight[int(span_digest(content), 16) % 3] += len(content)
    want = f"span-group-{weight.index(max(weight))}"
    assert span_routing_key(prompt, buckets=3) == want
    assert span_routing_key(prompt, buckets=1) == "span-group-0"
    assert span_routing_key([1, 2], buckets=3) is None
    assert key_of_spans([("00ff", 4), ("0003", 9)], buckets=2) == "span-group-1"
    with pytest.raises(ValueError, match="at least 1"):
        span_routing_key(prompt, buckets=0)


@given(docs=docs_strategy, seed=st.integers(0, 10**6), buckets=st.integers(1, 8))
def test_the_group_is_the_same_for_any_order_of_the_spans(docs, seed, buckets):
    shuffled = docs[:]
    random.Random(seed).shuffle(shuffled)
    assert span_routing_key(ids_prompt([], docs, []), buckets=buckets) \
        == span_routing_key(ids_prompt([5], shuffled, [6]), buckets=buckets)
