"""How learning eviction policies see cache events: hooks on SGLang's ``RadixCache``.

SGLang's eviction policies are pure priority functions (``EvictionStrategy.get_priority``); ours
also learn from what happens to blocks. AROUND hooks (HookRegistry) report those events to the
cache's policy when it is one of ours, a ``CachePolicy`` (``policy``); a cache on one of SGLang's
own policies goes straight to SGLang's code (``auto`` adapts those as experts: ``as_policy``):

- ``RadixCache.match_prefix``: ``on_hit(node, tokens, ctx)`` for every matched node, once per
  request: the scheduler matches a waiting request on every round, so the latest match is kept
  and reported when the request is first cached (``insert``), i.e. the match that admitted it
  (only the outermost hooked match reports; a match with neither a request nor a context is a
  probe, e.g. the span planner's, and is not reported);
- ``RadixCache.insert``: ``on_match(nodes, ctx)`` with the request's admitted match (deepest
  node first; in the trace replay, where the match is a hit at once, from ``match_prefix``
  before its ``on_hit`` calls) and ``on_request(ctx, now)`` once per request, then
  ``on_store`` and ``on_insert(node, ctx, offset, is_new)`` for every node on the inserted path
  (top-down, each marked with its offset first where the policy ``records_offsets``);
- ``RadixCache._delete_leaf``: ``on_evict(node)``;
- ``RadixCache._split_node``: ``on_split(head, tail)`` (SGLang cuts a node in two when a new key
  diverges inside it; the policy re-derives what each half holds);
- ``RadixCache.evict``: ``begin_evict()`` / ``end_evict()`` around a pass, so a policy reads the
  clock once per pass rather than once per leaf; a policy with a ``sample_size`` has SGLang's
  evict run over random samples of that many leaves (``_sampled_evict``).

With ``--enable-hierarchical-cache`` SGLang uses ``HiRadixCache``, which overrides
``match_prefix``, ``insert``, ``_split_node`` and ``evict`` without calling ``RadixCache``'s: the
same hooks are registered on those overrides (its ``insert`` returns no last node, so the inserted
path is found by a read-only walk). Its match's host-tier part (down to ``last_host_node``) is
reported as hits too; ``_evict_backuped`` - a device eviction that keeps the block on the host
tier - is ``on_demote`` (by default ``on_evict``; ``sae`` counts the block as still cached);
``evict_host`` (ordered by SGLang with the policy's ``get_priority``) is one evict pass for the
policy and reports ``on_evict`` for every block it removes from the tree, as does
``_drop_subtree_no_host`` (``write_back`` finding no host room drops a subtree from both tiers).
What write-through copies to the host tier is the policy's too: ``write_backup`` asks the
policy's ``worth_host_copy(node)`` first (``sae`` defers the blocks it would evict first until they
are reused); ``write_back``'s copies, of blocks the device evict has chosen, are not asked.

With ``--enable-span-cache`` the tree is our ``SpanRadixCache``, whose ``match_prefix`` runs
``RadixCache.match_prefix`` once per segment and whose ``cache_finished_req`` /
``cache_unfinished_req`` (0.5.23: ``checkpoint``) cache a span request's segments themselves:
the match and caching hooks are registered on those too, a segmented match is reported once
over every segment's path, and ``SpanRadixCache`` names each segment's start in the request
(``context.segment_at``) so its tokens are typed where they sit. A span prefill (the planner's
unit request) caches blocks on behalf of the requests waiting for them
(``RequestContext.on_behalf``): its own matches are not reuses.

In the server the request context comes from SGLang's ``Req`` (``request_context``); the trace
simulator sets it itself (``context.using``).

Only with ``--sae-stats FILE`` (``$SGLANG_PIC_SAE_STATS``; measurement): AROUND hooks on
``Scheduler.run_batch`` and ``Scheduler.on_idle`` count the scheduler's batches and busy time,
which ``sae`` writes to the file next to the time its own callbacks and evict passes took.
"""

from __future__ import annotations

import time

from . import context as ctxmod
from . import segmentation
from .policy import CachePolicy

_MAX_SEEN = 4096
# with SGLANG_PIC_SAE_STATS: the scheduler's batches and busy time (the time from one batch to
# the next when the scheduler did not go idle in between), what the policy's time is compared with
SCHEDULER_STEPS = {"steps": 0, "busy_seconds": 0.0}
_last_step: list[float] = []


def _learner(cache) -> CachePolicy | None:
    """The policy of ``cache`` the events go to: one of ours. None for SGLang's own policies
    (they take no events), so a server on ``lru`` pays for no hook beyond this call. The
    cache's ``eviction_strategy`` (0.5.23's ``UnifiedRadixCache``: its tree core's) is left as
    it is: SGLang orders evictions with its ``get_priority``."""
    strategy = getattr(cache, "eviction_strategy", None)
    if strategy is None:
        strategy = getattr(getattr(cache, "tree_core", None), "eviction_strategy", None)
    return strategy if isinstance(strategy, CachePolicy) else None


def _node(cache, handle):
    """The tree node of a match's or an insert's ``handle``: 0.5.23's ``UnifiedRadixCache``
    returns node ids (``resolve_node_handle``); other trees return the node."""
    if isinstance(handle, int) and not isinstance(handle, bool):
        return cache.resolve_node_handle(handle)
    return handle


def request_context(req) -> ctxmod.RequestContext:
    """What the server knows about a request: token types from the chat template's role headers
    (``segmentation``); generated tokens start at the prompt's end; session and application type
    from the client's ``custom_params``, else SGLang's ``session_id``, else none (the request is
    its own requester). Computed once per request.

    No session is guessed from the prompt's opening tokens: that would merge every
    conversation that starts with the same long system prompt into one "session" that never
    ends."""
    cached = getattr(req, "_pic_eviction_ctx", None)
    prompt = req.origin_input_ids
    if cached is None:
        session, app = segmentation.client_hints(req)
        session = session or getattr(req, "session_id", None)
        cached = (session, app, segmentation.segments_for(req), _is_span_unit(req))
        try:
            req._pic_eviction_ctx = cached
        except AttributeError:  # a Req stand-in with __slots__
            pass
    session, app, segments, on_behalf = cached
    return ctxmod.RequestContext(session_id=session, app_type=app, segments=list(segments),
                                 decode_start=len(prompt), prompt_len=len(prompt),
                                 rid=getattr(req, "rid", None), on_behalf=on_behalf)


def _is_span_unit(req) -> bool:
    """A span prefill the span planner runs for the requests waiting on the span
    (``spans.planner.is_unit``): it caches blocks on their behalf."""
    from sglang_pic.spans.request import UNIT_RID_PREFIX

    return str(getattr(req, "rid", "")).startswith(UNIT_RID_PREFIX)


def _path_up(cache, node):
    """``node`` and its ancestors, deepest first, without the root."""
    while node is not None and node is not cache.root_node:
        yield node
        node = node.parent


def _now(strategy: CachePolicy, ctx) -> float:
    return ctx.now if ctx is not None and ctx.now is not None else strategy.now_fn()


def _matched_nodes(cache, result) -> list:
    """Every node a match went through, deepest first per path: of each segment's path for a
    span cache's match (a ``SpanPath`` handle), and down to the deepest node matched on
    HiCache's host tier (``last_host_node``: loaded back, not recomputed - a reuse too)."""
    ends = []
    for handle in (result.last_device_node, getattr(result, "last_host_node", None)):
        handle = _node(cache, handle)
        if handle is not None:
            ends.extend(getattr(handle, "nodes", None) or [handle])
    seen, nodes = set(), []
    for end in ends:
        for node in _path_up(cache, end):
            if id(node) in seen:
                break  # the rest of this path is already in
            seen.add(id(node))
            nodes.append(node)
    return nodes


def around_match_prefix(original, self, params, *args, **kwargs):
    """Reports the outermost hooked match only: a span cache's ``match_prefix`` runs
    ``RadixCache.match_prefix`` once per segment, and its request's reuse is the whole match."""
    if ctxmod.matching.get():
        return original(self, params, *args, **kwargs)
    token = ctxmod.matching.set(True)
    try:
        result = original(self, params, *args, **kwargs)
    finally:
        ctxmod.matching.reset(token)
    strategy = _learner(self)
    if strategy is None:
        return result
    req = getattr(params, "req", None)
    ctx = ctxmod.current()
    if ctx is not None and not ctx.count_hits:
        return result  # SGLang re-matching blocks a request just inserted: not a reuse
    if req is None:
        if ctx is None:
            # no request's match: a probe whether something is cached (the span planner's,
            # before it runs a span prefill); the request itself reports its match
            return result
        nodes = _matched_nodes(self, result)  # the trace replay: a hit now
        strategy.on_match(nodes, ctx, params.key.token_ids)
        for node in nodes:
            strategy.on_hit(node, len(node.key), ctx)
        strategy.on_lookup(params.key.token_ids, ctx, self.page_size)
        return result
    # The scheduler matches a waiting request on every scheduling round; what it reuses is the
    # match of the round that admits it, which may include blocks another request inserted
    # while it waited. Keep the latest match; ``around_insert`` reports it when the request is
    # first cached (after its prefill), once per request.
    if req.rid in self.__dict__.get("_pic_hit_counted", ()):
        return result
    pending = self.__dict__.setdefault("_pic_pending_hits", {})
    pending.pop(req.rid, None)
    pending[req.rid] = [(node, len(node.key)) for node in _matched_nodes(self, result)]
    if len(pending) > _MAX_SEEN:  # requests that never got cached (aborted): dropped
        pending.pop(next(iter(pending)))
    return result


def _report_pending_hits(cache, strategy: CachePolicy, ctx) -> None:
    """The admitted match of request ``ctx.rid`` (``around_match_prefix``), as hits."""
    matched = cache.__dict__.get("_pic_pending_hits", {}).pop(ctx.rid, None)
    if matched is None or not _first_time(cache, "_pic_hit_counted", ctx.rid):
        return
    for node, tokens in matched:
        parent = node.parent
        if parent is not None and parent.children.get(
                node.key.child_key(cache.page_size)) is node:  # not evicted since
            strategy.on_hit(node, tokens, ctx)


def _end_of_path(cache, key):
    """The last node whose whole key lies on ``key``'s path from the root (None: the root), found
    without touching access times or splitting nodes (``HiRadixCache.insert`` returns no node)."""
    if getattr(cache, "is_eagle", False):
        return None  # bigram keys: the path is not the request's tokens
    page = cache.page_size
    key = key.page_aligned(page)
    node = cache.root_node
    while len(key):
        child = node.children.get(key.child_key(page))
        if child is None:
            break
        n = child.key.match(key, page_size=page)
        if n < len(child.key):
            break
        node, key = child, key[n:]
    return None if node is cache.root_node else node


def around_insert(original, self, params, *args, **kwargs):
    strategy = _learner(self)
    ctx = ctxmod.current()
    if strategy is None or ctx is None:
        return original(self, params, *args, **kwargs)
    if _first_report(self, ctx):
        if ctx.rid is not None:
            # the admitted match (reported as hits just below), deepest node first
            matched = self.__dict__.get("_pic_pending_hits", {}).get(ctx.rid, ())
            strategy.on_match([node for node, _ in matched], ctx, params.key.token_ids)
        strategy.on_request(ctx, _now(strategy, ctx))
        if ctx.rid is not None and not ctx.on_behalf:
            # (a span prefill's match is not a reuse: the requests it runs for match the
            # blocks themselves)
            _report_pending_hits(self, strategy, ctx)
            # the prompt, as the request's own lookup
            strategy.on_lookup(params.key.token_ids[: ctx.prompt_len or None], ctx,
                               self.page_size)
    result = original(self, params, *args, **kwargs)
    strategy.on_store(params.key.token_ids, ctx, self.page_size,
                      self.evictable_size() + self.protected_size(), self.root_node)
    last = _node(self, getattr(result, "last_device_node", None))
    if last is None:
        last = _end_of_path(self, params.key)
    offset = 0
    for node in reversed(list(_path_up(self, last))):
        is_new = not hasattr(node, "_pic_seen")
        if strategy.records_offsets:
            node._pic_seen = True
            node._pic_offset = offset
        strategy.on_insert(node, ctx, offset, is_new)
        offset += len(node.key)
    return result


def _first_time(cache, table: str, rid) -> bool:
    """True the first time ``rid`` is seen in ``cache.<table>`` (a bounded, FIFO-trimmed dict)."""
    seen = cache.__dict__.setdefault(table, {})
    if rid in seen:
        return False
    seen[rid] = None
    if len(seen) > _MAX_SEEN:
        seen.pop(next(iter(seen)))
    return True


def _first_report(cache, ctx) -> bool:
    """A request reaches insert once per chunk and once at the end; count it once."""
    if ctx.rid is None:
        first, ctx.announced = not ctx.announced, True
        return first
    return _first_time(cache, "_pic_requests_seen", ctx.rid)


def around_delete_leaf(original, self, node, *args, **kwargs):
    """A block leaves the device tree (also ``HiRadixCache._evict_backuped``: its device copy is
    dropped, the host tier keeps it)."""
    strategy = _learner(self)
    if strategy is not None:
        strategy.on_evict(node)
    return original(self, node, *args, **kwargs)


def around_evict_backuped(original, self, node, *args, **kwargs):
    """HiCache drops a block's device copy and keeps it on the host tier: ``on_demote`` (a
    policy may count the block as still cached, its eviction then being the host tier's,
    ``around_evict_host``; by default it is an eviction)."""
    strategy = _learner(self)
    if strategy is not None:
        strategy.on_demote(node)
    return original(self, node, *args, **kwargs)


class _evict_pass:
    """``begin_evict`` / ``end_evict`` around the outermost of nested passes (HiCache's device
    evict can write a block back, which can evict from the host tier)."""

    def __init__(self, strategy: CachePolicy, need: int | None = None) -> None:
        self.strategy = strategy
        self.need = need

    def __enter__(self) -> None:
        s = self.strategy
        s.evict_depth += 1
        if s.evict_depth == 1:
            s.begin_evict()
            s.evict_need = self.need

    def __exit__(self, *exc) -> None:
        s = self.strategy
        s.evict_depth -= 1
        if s.evict_depth == 0:
            s.end_evict()


def around_evict(original, self, params, *args, **kwargs):
    strategy = _learner(self)
    if strategy is None:
        return original(self, params, *args, **kwargs)
    with _evict_pass(strategy, params.num_tokens):
        k = strategy.sample_size
        if not k or len(self.evictable_leaves) <= k:
            return original(self, params, *args, **kwargs)
        return _sampled_evict(original, self, params, k, strategy.rng)


def around_drop_subtree(original, self, root, *args, **kwargs):
    """HiCache's ``write_back`` eviction found no host room for a block: SGLang drops it and
    everything below it from both tiers. Each dropped block is reported as ``on_evict``."""
    strategy = _learner(self)
    if strategy is None:
        return original(self, root, *args, **kwargs)
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    result = original(self, root, *args, **kwargs)
    parent = root.parent
    if parent is not None and parent.children.get(root.key.child_key(self.page_size)) is not root:
        for node in nodes:
            strategy.on_evict(node)
    return result


def around_write_backup(original, self, node, *args, **kwargs):
    """HiCache copies a block to the host tier: on insert or reuse with ``write_through`` (and
    ``write_through_selective`` past its hit count), or as the device tier evicts it with
    ``write_back``. A write-through copy of a block the policy finds not worth it
    (``worth_host_copy`` False) is skipped, as SGLang skips one whose parent has no copy (0 tokens
    written; SGLang asks again at the block's next insert). A ``write_back`` copy is not asked:
    the device evict has chosen the block, and without a copy SGLang drops its subtree."""
    write_back = kwargs.get("write_back", args[0] if args else False)
    strategy = _learner(self)
    if not write_back and strategy is not None and not host_copy_wanted(self, strategy, node):
        return 0
    return original(self, node, *args, **kwargs)


def host_copy_wanted(cache, strategy: CachePolicy, node) -> bool:
    """The policy's ``worth_host_copy`` for ``node``, asked while SGLang writes it through. A
    new block is not typed yet (``on_insert`` comes after the write): its depth in the tree,
    with the inserting request's context, types it."""
    offset = 0
    if not getattr(node, "_pic_seen", False):
        up = node.parent
        while up is not None and up is not cache.root_node:
            offset += len(up.key)
            up = up.parent
    return strategy.worth_host_copy(node, ctxmod.current(), offset)


def around_evict_host(original, self, num_tokens, *args, **kwargs):
    """HiCache's host-tier eviction. SGLang orders it by the same ``get_priority`` as the
    device tier; this makes it one pass for the policy (one clock reading) and reports each
    block it removes from the tree as ``on_evict`` (the block has left both tiers)."""
    strategy = _learner(self)
    if strategy is None:
        return original(self, num_tokens, *args, **kwargs)
    leaves = list(self.evictable_host_leaves)
    try:
        with _evict_pass(strategy, num_tokens):
            return original(self, num_tokens, *args, **kwargs)
    finally:
        # a removed node is gone from its parent's children; its parent, removed after it
        # in the same pass (a host leaf once its last child went), likewise
        page, seen = self.page_size, set()
        for node in leaves:
            while (node is not self.root_node and node.parent is not None
                   and id(node) not in seen
                   and node.parent.children.get(node.key.child_key(page)) is not node):
                seen.add(id(node))
                strategy.on_evict(node)
                node = node.parent


def _sampled_evict(original, cache, params, k: int, rng):
    """SGLang's own ``evict`` run over random samples of ``k`` evictable leaves.

    ``RadixCache.evict`` scores and heapifies *every* evictable leaf on each call; with a
    policy whose score costs microseconds that is tens of ms per pass at 10K+ leaves. As in
    Redis's approximated LRU, we let it see a sample instead (``cache.evictable_leaves`` is
    swapped for the sample during the call), then fold the leaves it evicted and the parents
    that became leaves back into the full set; repeat until enough tokens are freed.
    """
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult

    full = cache.evictable_leaves
    need, freed = params.num_tokens, 0
    while freed < need and full:
        sample = set(rng.sample(list(full), min(k, len(full))))
        # ask for at most ~1/8 of the sample's tokens per call, so the victims are the
        # sample's lowest-scored leaves and not "most of the sample" on a large request
        budget = max(sum(len(n.key) for n in sample) // 8, 1)
        cache.evictable_leaves = set(sample)
        got = 0
        try:
            got = original(cache, EvictParams(num_tokens=min(need - freed, budget)))
            got = got.num_tokens_evicted
        finally:  # fold back even if SGLang's evict raised half-way
            after = cache.evictable_leaves
            full -= sample - after
            full |= after - sample
            cache.evictable_leaves = full
        freed += got
        if got == 0:
            break
    return EvictResult(num_tokens_evicted=freed)


def around_split_node(original, self, key, child, split_len, *args, **kwargs):
    head = original(self, key, child, split_len, *args, **kwargs)
    report_split(_learner(self), head, child)
    return head


def report_split(strategy: CachePolicy | None, head, child) -> None:
    """SGLang cut ``child`` in two: ``head`` (new, its parent now) and ``child`` (the tail).
    Each half keeps its token offset; the policy re-derives what each holds (``on_split``)."""
    if strategy is not None:
        head._pic_seen = getattr(child, "_pic_seen", False)
        head._pic_offset = ctxmod.block_offset(child)
        child._pic_offset = head._pic_offset + len(head.key)
        strategy.on_split(head, child)


def around_cache_req(original, self, req, *args, **kwargs):
    """Make the request's context current while SGLang caches it (insert happens inside)."""
    if _learner(self) is None or ctxmod.current() is not None:
        return original(self, req, *args, **kwargs)
    ctx = request_context(req)
    ctx.count_hits = False  # cache_unfinished_req re-matches what it just inserted
    with ctxmod.using(ctx):
        return original(self, req, *args, **kwargs)


def around_run_batch(original, self, *args, **kwargs):
    """Count the scheduler's batches and the time between consecutive ones."""
    now = time.perf_counter()
    if _last_step:
        SCHEDULER_STEPS["busy_seconds"] += now - _last_step[0]
    SCHEDULER_STEPS["steps"] += 1
    _last_step[:] = [now]
    return original(self, *args, **kwargs)


def around_on_idle(original, self, *args, **kwargs):
    """The scheduler found nothing to run: the time until its next batch is not busy time."""
    _last_step.clear()
    return original(self, *args, **kwargs)
