"""Eviction policies with the span cache (``SpanRadixCache``) and HiCache's host tier.

Both caches are built directly on CPU (no server, no model): a counting allocator, a request
stand-in with what the caches read, and the radix cache's clock replaced by a virtual one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmark" / "eviction"))


@pytest.fixture(scope="module", autouse=True)
def policies_registered():
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_pic import eviction

    eviction.register()
    HookRegistry.apply_hooks()


@pytest.fixture()
def clock(monkeypatch):
    """Virtual time for SGLang's access times (``radix_cache.time``) and the policy."""
    from sglang.srt.mem_cache import radix_cache as rc
    from simulator import _Clock, _TimeProxy

    c = _Clock()
    monkeypatch.setattr(rc, "time", _TimeProxy(c))
    return c


# ---- span cache ------------------------------------------------------------------------------
class _Pool:
    """``req_to_token``: row ``i`` holds KV slots ``1000 * i ...`` (distinct per request)."""

    def __init__(self) -> None:
        self.req_to_token = torch.arange(64).unsqueeze(1) * 1000 + torch.arange(1000).unsqueeze(0)


def _span_cache(policy: str, clock):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang_pic.spans.radix_cache import SpanRadixCache
    from simulator import CountingAllocator

    cache = SpanRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=_Pool(),
            token_to_kv_pool_allocator=CountingAllocator(),
            page_size=1,
            eviction_policy=policy,
        )
    )
    strategy = cache.eviction_strategy
    if hasattr(strategy, "now_fn"):
        strategy.now_fn = clock.monotonic
    return cache


class _Server:
    """What the scheduler and the span planner do with a request, on a bare ``SpanRadixCache``:
    every segment but the last is cached first (by a span-prefill unit request when missing),
    then the request is matched segment by segment, locked, and cached when it finishes."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.slot_row = 0

    def _req(self, rid, ids, segments=None, extra_key=None):
        self.slot_row += 1
        return SimpleNamespace(
            rid=rid,
            origin_input_ids=list(ids),
            output_ids=[],
            pic_segments=segments,
            extra_key=extra_key,
            req_pool_idx=self.slot_row,
            cache_protected_len=0,
            last_node=None,
            priority=0,
            session_id=None,
            tokenizer=None,
            sampling_params=SimpleNamespace(custom_params=None),
        )

    def run(self, req) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        match = self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(req.origin_input_ids, req.extra_key), req=req)
        )
        req.last_node = match.last_device_node
        req.cache_protected_len = len(match.device_indices)
        self.cache.inc_lock_ref(req.last_node)
        self.cache.cache_finished_req(req, kv_len_to_handle=len(req.origin_input_ids))
        return req.cache_protected_len

    def serve(self, rid: str, pieces: list[tuple[bool, list[int]]]) -> int:
        """A prompt laid out as ``(independent, tokens)`` pieces; returns its cached tokens."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang_pic.spans.request import UNIT_RID_PREFIX
        from sglang_pic.spans.segments import build_segments, pad_pieces

        ids, layout = pad_pieces(pieces, 1, 0)
        segments = build_segments(ids, layout, None)
        for k, seg in enumerate(segments[:-1]):  # the planner's units
            key = RadixKey(ids[seg.key_start : seg.key_end], seg.namespace)
            got = self.cache.match_prefix(MatchPrefixParams(key=key))
            if len(got.device_indices) < seg.key_end - seg.key_start:
                self.run(
                    self._req(
                        f"{UNIT_RID_PREFIX}{rid}-{k}",
                        ids[seg.key_start : seg.key_end],
                        extra_key=seg.namespace,
                    )
                )
        return self.run(self._req(rid, ids, segments))


def _resident(cache) -> list[list[int]]:
    """The token runs of every cached node, root-first."""
    out, stack = [], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        out.append(list(node.key.token_ids))
        stack.extend(node.children.values())
    return out


def test_a_span_shared_by_many_prompts_is_reuse_and_outlives_a_cold_block(clock):
    """Six prompts, each with its own opening, read one document span (SSEP) and ask their own
    question. Then a one-off prompt arrives, and the pool must shrink to one block's worth.
    ``sae`` sees the span's reuse (hits from six requesters: shared, structural) and keeps it
    over the newer one-off block; before the span cache reported its events, span blocks had no
    ``sae`` state, were scored as LRU, and the span - used longer ago - went first."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = _span_cache("sae", clock)
    server = _Server(cache)
    span = list(range(5000, 5032))
    for i in range(6):
        clock.now = float(i)
        opening = list(range(100 + 40 * i, 116 + 40 * i))
        question = list(range(3000 + 40 * i, 3016 + 40 * i))
        hit = server.serve(f"r{i}", [(False, opening), (True, span), (False, question)])
        assert hit == len(opening) + len(span)  # the units cached them; the request reuses them
    sae = cache.eviction_strategy
    span_node = cache.root_node.children[span[0]]
    info = span_node.sae  # the span's blocks have the policy's state ...
    assert info.sessions_seen == 6 and info.queue == "structural"  # ... and its reuse
    # r1..r5 reused the span (r0 is the request its unit was made for; so is each request's
    # own opening), a second apart
    assert sae.events["hits"] == 5 and info.interval == pytest.approx(1.0)
    # a span's depth is its depth in its own tree, not where it sat in the prompt
    assert info.offset == 0 and info.token_type == "user"
    clock.now = 10.0
    cold = list(range(9000, 9032))
    server.serve("cold", [(False, cold)])  # one request, never seen again
    clock.now = 11.0
    cache.evict(EvictParams(num_tokens=cache.evictable_size() - len(span)))
    assert _resident(cache) == [span]


def test_the_prefill_a_span_was_made_for_is_not_counted_as_its_reuse(clock):
    """The planner caches a missing span with a unit request before the request that needs it
    runs; that request is the span's first user, not a second requester: the span stays
    unshared until another prompt reads it, and that first use is not a hit."""
    cache = _span_cache("sae", clock)
    server = _Server(cache)
    span = list(range(5000, 5032))
    server.serve(
        "r0", [(False, list(range(100, 116))), (True, span), (False, list(range(200, 216)))]
    )
    info = cache.root_node.children[span[0]].sae
    assert info.sessions_seen == 1 and info.queue != "structural"
    assert cache.eviction_strategy.events["hits"] == 0
    clock.now = 1.0
    server.serve(
        "r1", [(False, list(range(300, 316))), (True, span), (False, list(range(400, 416)))]
    )
    assert info.sessions_seen == 2 and info.queue == "structural"
    # r1's own opening, cached by its unit just before, is not a reuse; the span is
    assert cache.eviction_strategy.events["hits"] == 1


def test_span_segments_are_typed_where_they_sit_in_the_prompt(clock, monkeypatch):
    """A segment is cached under its own namespace from depth 0 of its tree; its token types
    come from where it sits in the prompt. Here the chat template types the prompt as a
    ``system`` opening, the document (``user``) and a ``tool`` output after it."""
    from sglang_pic.eviction import segmentation

    def types(req):
        return (
            [(0, "user")]
            if req.rid.startswith("pic-span-")
            else [(0, "system"), (16, "user"), (48, "tool")]
        )

    monkeypatch.setattr(segmentation, "segments_for", types)
    cache = _span_cache("sae", clock)
    span, tail = list(range(5000, 5032)), list(range(200, 216))
    _Server(cache).serve("r0", [(False, list(range(100, 116))), (True, span), (False, tail)])
    tail_node = next(n for n in cache.root_node.children.values() if n.key.token_ids[0] == 200)
    assert tail_node.sae.offset == 0 and tail_node.sae.token_type == "tool"
