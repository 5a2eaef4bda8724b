"""Eviction policies with the span cache (``SpanRadixCache``) and HiCache's host tier.

Both caches are built directly on CPU (no server, no model): a counting allocator, a request
stand-in with what the caches read, and the radix cache's clock replaced by a virtual one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import needs_hiradix

pytestmark = pytest.mark.capability("eviction")


@pytest.fixture(scope="module", autouse=True)
def policies_registered():
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_pic.plugin import register_feature

    register_feature("eviction")
    HookRegistry.apply_hooks()


@pytest.fixture()
def clock(monkeypatch):
    """Virtual time for SGLang's access times (``radix_cache.time``) and the policy."""
    from sglang.srt.mem_cache import radix_cache as rc
    from sglang_pic.eviction.replay.simulator import _Clock, _TimeProxy

    c = _Clock()
    monkeypatch.setattr(rc, "time", _TimeProxy(c))
    return c


# ---- span cache ------------------------------------------------------------------------------
class _Pool:
    """``req_to_token``: row ``i`` holds KV slots ``1000 * i ...`` (distinct per request)."""

    def __init__(self) -> None:
        self.req_to_token = torch.arange(64).unsqueeze(1) * 1000 + torch.arange(1000).unsqueeze(0)

    def write(self, where, values) -> None:
        self.req_to_token[where] = values


def _span_cache(policy: str, clock):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang_pic.eviction.replay.simulator import CountingAllocator
    from sglang_pic.spans.radix_cache import SpanRadixCache

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

    def _req(self, rid, ids, segments=None, extra_key=None, session=None):
        self.slot_row += 1
        kv = SimpleNamespace(req_pool_idx=self.slot_row, cache_protected_len=0,
                             cache_inserted_len=0, swa_evict_floor=0)
        return SimpleNamespace(  # the KV fields where either release keeps them (request_state)
            rid=rid,
            origin_input_ids=list(ids),
            full_untruncated_fill_ids=list(ids),
            output_ids=[],
            pic_segments=segments,
            extra_key=extra_key,
            cache_salt=None,
            kv=kv,
            req_pool_idx=kv.req_pool_idx,
            cache_protected_len=0,
            last_node=None,
            lock=None,
            priority=0,
            session_id=session,
            tokenizer=None,
            sampling_params=SimpleNamespace(custom_params=None),
            finished=lambda: True,
        )

    def run(self, req) -> int:
        """Match, lock and cache ``req`` as it finishes, as the installed SGLang's scheduler
        does: 0.5.17 through ``cache_finished_req``; 0.5.23 through ``checkpoint``, then the
        row past the tree-owned part freed, the lock dropped and ``on_release``."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
        from sglang_pic.compat.radix_api import matched_tokens
        from sglang_pic.compat.request_state import pool_row, protected_len, set_protected_len

        match = self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(req.origin_input_ids, req.extra_key), req=req)
        )
        req.last_node = match.last_device_node
        matched = matched_tokens(match)
        set_protected_len(req, matched)
        n = len(req.origin_input_ids)
        if hasattr(RadixCache, "cache_finished_req"):
            self.cache.inc_lock_ref(req.last_node)
            self.cache.cache_finished_req(req, kv_len_to_handle=n)
            return matched
        req.lock = self.cache.lock(req.last_node)
        self.cache.checkpoint(req, up_to=n)
        row = self.cache.req_to_token_pool.req_to_token[pool_row(req)]
        done = protected_len(req)
        self.cache.token_to_kv_pool_allocator.free_segments([(row[done:n], done)])
        self.cache.unlock(req.lock)
        self.cache.on_release(req, checkpointed=True)
        return matched

    def serve(self, rid: str, pieces: list[tuple[bool, list[int]]], session=None) -> int:
        """A prompt laid out as ``(independent, tokens)`` pieces; returns its cached tokens."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang_pic.compat.radix_api import matched_tokens
        from sglang_pic.spans.request import UNIT_RID_PREFIX
        from sglang_pic.spans.segments import build_segments, pad_pieces

        ids, layout = pad_pieces(pieces, 1, 0)
        segments = build_segments(ids, layout, None)
        for k, seg in enumerate(segments[:-1]):  # the planner's units
            key = RadixKey(ids[seg.key_start : seg.key_end], seg.namespace)
            got = self.cache.match_prefix(MatchPrefixParams(key=key))
            if matched_tokens(got) < seg.key_end - seg.key_start:
                self.run(
                    self._req(
                        f"{UNIT_RID_PREFIX}{rid}-{k}",
                        ids[seg.key_start : seg.key_end],
                        extra_key=seg.namespace,
                    )
                )
        return self.run(self._req(rid, ids, segments, session=session))


def _nodes(cache) -> list:
    """Every cached node, root-first."""
    out, stack = [], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def _resident(cache) -> list[list[int]]:
    """The token runs of every cached node, root-first."""
    return [list(node.key.token_ids) for node in _nodes(cache)]


@pytest.mark.capability("spans")
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


@pytest.mark.capability("spans")
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
    # a request of a session: the opening its unit cached becomes the session's (scored with
    # the session's index), as if the request had cached it
    clock.now = 2.0
    opening = list(range(500, 516))
    server.serve(
        "r2", [(False, opening), (True, span), (False, list(range(600, 616)))], session="s2"
    )
    own = cache.root_node.children[opening[0]].sae
    assert (own.session_id, own.sessions_seen, own.last_session) == ("s2", 1, "s2")
    assert cache.eviction_strategy.session_scored(own.queue, own)


@pytest.mark.capability("spans")
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


# ---- HiCache ---------------------------------------------------------------------------------
class _HostController:
    """What ``HiRadixCache`` asks of its cache controller here: write-through copies to an
    unbounded host pool (acknowledged by the test), device and host frees."""

    write_policy = "write_through"

    def __init__(self) -> None:
        from sglang_pic.eviction.replay.simulator import CountingAllocator

        self.mem_pool_device_allocator = CountingAllocator()
        self.next_host = 0

    def reset(self) -> None:
        pass

    def write(self, device_indices, node_id, **kwargs):
        n = len(device_indices)
        self.next_host += n
        return torch.arange(self.next_host - n, self.next_host)

    def evict_device(self, device_indices) -> None:
        pass

    def evict_host(self, host_value) -> int:
        return len(host_value)


def _hicache(policy: str, clock, monkeypatch):
    """A ``HiRadixCache`` without its transfer machinery (``_HostController``)."""
    from sglang.srt.mem_cache import hiradix_cache as hc
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang_pic.eviction.replay.simulator import CountingAllocator, _TimeProxy

    monkeypatch.setattr(hc, "time", _TimeProxy(clock))
    cache = hc.HiRadixCache.__new__(hc.HiRadixCache)
    cache.cache_controller = _HostController()
    cache.token_to_kv_pool_host = SimpleNamespace(clear=lambda: None)
    cache.prefetch_loaded_tokens_by_reqid = {}
    cache.evictable_host_leaves = set()
    cache.ongoing_write_through, cache.ongoing_load_back = {}, {}
    cache.ongoing_prefetch, cache.ongoing_backup = {}, {}
    cache.write_through_threshold, cache.load_back_threshold = 1, 10
    cache.enable_storage = False
    RadixCache.__init__(
        cache,
        CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=CountingAllocator(),
            page_size=1,
            eviction_policy=policy,
        ),
    )
    cache.eviction_strategy.now_fn = clock.monotonic
    return cache


def _hicache_request(cache, rid: str, ids: list[int]) -> None:
    """The scheduler's steps for one request: match (with the request), cache its tokens, then
    acknowledge the host writes and drop everything from the device (all of it stays on the
    host tier), so the next request finds these blocks on the host only."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import RequestContext, using

    req = SimpleNamespace(rid=rid)
    cache.match_prefix(MatchPrefixParams(key=RadixKey(list(ids)), req=req))
    ctx = RequestContext(segments=[(0, "user")], prompt_len=len(ids), rid=rid)
    with using(ctx):
        cache.insert(InsertParams(key=RadixKey(list(ids)), value=torch.arange(len(ids))))
    for ack in list(cache.ongoing_write_through):
        cache._finish_write_through_ack(ack, release_lock=True)
    cache.evict(EvictParams(num_tokens=cache.evictable_size()))
    assert cache.evictable_size() == 0


def _host_tokens(cache) -> int:
    n, stack = 0, list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        n += len(node.host_value) if node.host_value is not None else 0
        stack.extend(node.children.values())
    return n


@needs_hiradix
def test_hicache_host_tier_evicts_in_the_policys_order_with_its_signals(clock, monkeypatch):
    """Two shared templates that live on HiCache's host tier between uses: ``a`` read by six
    requests a second apart (t = 90..95), ``b`` by three, 30 s apart (t = 40, 70, 100). The
    host tier must shrink to one template at t = 101. ``sae`` keeps ``a``: its reuses on the
    host tier are hits, whose interval (1 s against 30 s) says ``a`` is the one to keep though
    ``b`` was used last. Before, host-tier matches were not reported, the intervals were
    unknown, and recency kept ``b``. A device drop that keeps the host copy is not an eviction
    for ``sae``; the host tier's evictions are, and a block asked for again after one is a
    miss it learns from."""
    cache = _hicache("sae", clock, monkeypatch)
    sae = cache.eviction_strategy
    a, b = list(range(100, 132)), list(range(200, 232))
    uses = [(40.0, b), (70.0, b), *((90.0 + k, a) for k in range(6)), (100.0, b)]
    for n, (t, template) in enumerate(uses):
        clock.now = t
        _hicache_request(cache, f"r{n}", template + list(range(1000 + 8 * n, 1008 + 8 * n)))
    assert sae.events["evictions"] == 0 and sae.events["demotions"] >= len(uses)
    assert sae.events["hits"] == 5 + 2  # every reuse after the first request of each
    node_a, node_b = cache.root_node.children[a[0]], cache.root_node.children[b[0]]
    assert node_a.sae.interval == pytest.approx(1.0) and node_b.sae.interval == pytest.approx(30)
    assert node_a.evicted and node_b.evicted  # on the host tier only
    clock.now = 101.0
    cache.evict_host(_host_tokens(cache) - len(a))
    assert [list(c.key.token_ids) for c in cache.root_node.children.values()] == [a]
    removed = len(uses) + 1  # every request's own suffix, and template b
    assert sae.events["evictions"] == removed and len(sae.ghost) == removed
    clock.now = 102.0
    _hicache_request(cache, "again", b + [7, 7, 7])
    assert sae.events["miss_after_eviction"] == 1


@needs_hiradix
def test_hicache_write_back_drop_without_host_room_is_reported(clock, monkeypatch):
    """``write_back`` eviction that finds no host room drops the block and its subtree from
    both tiers (``_drop_subtree_no_host``): each dropped block is an eviction for the policy."""
    cache = _hicache("sae", clock, monkeypatch)
    sae = cache.eviction_strategy
    _hicache_request(cache, "r0", list(range(100, 132)))
    _hicache_request(cache, "r1", list(range(100, 116)) + list(range(500, 516)))  # splits r0's
    top = cache.root_node.children[100]
    assert len(top.children) == 2 and sae.events["evictions"] == 0
    cache._drop_subtree_no_host(top)
    assert not cache.root_node.children and sae.events["evictions"] == 3


def _hicache_insert(cache, rid: str, ids: list[int], segments, *, match: bool = True) -> None:
    """One insert of a request's tokens typed by ``segments`` (after its match, the first
    time), with the host writes it started acknowledged."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import RequestContext, using

    if match:
        cache.match_prefix(MatchPrefixParams(key=RadixKey(list(ids)), req=SimpleNamespace(rid=rid)))
    ctx = RequestContext(segments=segments, prompt_len=segments[-1][0], rid=rid)
    with using(ctx):
        cache.insert(InsertParams(key=RadixKey(list(ids)), value=torch.arange(len(ids))))
    for ack in list(cache.ongoing_write_through):
        cache._finish_write_through_ack(ack, release_lock=True)


@pytest.mark.parametrize("policy", ["sae", "lru", "sae-copy-all"])
@needs_hiradix
def test_hicache_write_through_copies_what_the_policy_keeps_and_defers_the_rest(
        clock, monkeypatch, policy):
    """A request's prompt and its chain-of-thought reach HiCache's write-through. ``sae`` copies
    the prompt to the host tier and defers the chain-of-thought (its ``evict_first`` queue: the
    first the device gives up), also at the same request's second insert; another request that
    reuses it copies it, and its own tokens below it. SGLang's own policies copy everything at
    once, and so does ``sae`` told not to defer (the two-tier replay's ablation)."""
    cache = _hicache("sae" if policy == "sae-copy-all" else policy, clock, monkeypatch)
    if policy == "sae-copy-all":
        cache.eviction_strategy.defer_host_copies = False
    prompt, cot = list(range(100, 132)), list(range(500, 516))
    typed = [(0, "user"), (32, "cot")]
    _hicache_insert(cache, "r0", prompt, [(0, "user"), (32, "cot")])  # the prompt, cached
    _hicache_insert(cache, "r0", prompt + cot, typed, match=False)  # and its output
    top = cache.root_node.children[100]
    (out,) = top.children.values()
    assert top.backuped and list(out.key.token_ids) == cot
    if policy != "sae":
        assert out.backuped
        return
    sae = cache.eviction_strategy
    assert out.sae.queue == "evict_first" and not out.backuped
    assert sae.events["host_writes_deferred"] == 1
    _hicache_insert(cache, "r0", prompt + cot, typed, match=False)  # r0 again: still deferred
    assert not out.backuped and sae.events["host_writes_deferred"] == 2
    clock.now += 5.0
    _hicache_insert(cache, "r1", prompt + cot + [7, 7], [(0, "user"), (48, "decode")])
    (tail,) = out.children.values()  # r1's own tokens, below the reused block
    assert out.backuped and out.sae.last_hit is not None and tail.backuped
    assert sae.events["host_writes_deferred"] == 2


@pytest.mark.capability("spans")
def test_a_span_request_counts_one_hit_per_node_however_often_it_is_cached(clock):
    """SGLang 0.5.23 caches a request after its prefill and again when it finishes (and per
    chunk), counting a node's hit only past what the request inserted already
    (``inserted_len``): the span cache passes each segment's, so ``hit_count``, which ``gdsf``
    and ``s3fifo`` rank by, is one per request, as on 0.5.17 (which skips chunks' counts)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang_pic.spans.segments import build_segments, pad_pieces

    if hasattr(RadixCache, "cache_finished_req"):
        pytest.skip("this SGLang caches a request once when it finishes (cache_finished_req)")
    cache = _span_cache("lru", clock)
    server = _Server(cache)
    ids, layout = pad_pieces([(True, list(range(100, 132))), (False, list(range(200, 216)))],
                             1, 0)
    req = server._req("r", ids, build_segments(ids, layout, None))
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(ids, None), req=req))
    req.last_node = match.last_device_node
    req.lock = cache.lock(req.last_node)
    for finished in (False, True):  # after its prefill, then at its end
        req.finished = lambda finished=finished: finished
        cache.checkpoint(req, up_to=len(ids))
    counts = [node.hit_count for node in _nodes(cache)]
    assert len(counts) >= 2 and set(counts) == {1}, counts
