"""`SpanRadixCache`: SGLang's RadixCache with span-aware (segmented) prefix matching.

SGLang's radix tree matches a request by token prefix from one root, so a document that follows a
different system prompt is never found. Here a request that carries a span layout
(``req.pic_segments``, see ``segments.py``) is matched segment by segment, each segment under its
own radix namespace (``RadixKey.extra_key``): independent spans from the base root (SSEP: a new
hash chain), dependent pieces under a digest of what precedes them (PDEP). The matched KV indices
are concatenated, so the request's ``req_to_token`` row points at the *same physical pages* the
span occupies in every other request, at whatever offset. That is only correct with position-free
KV (``pic_flashinfer`` / ``pic_triton`` / ``pic_torch_native``: each key turned by the distance it
moved since it was computed, ``sglang_pic.position_free``), which the factory checks.

Requests without a layout (plain prompts, and the internal span-prefill requests) take the
unchanged RadixCache paths. What is overridden, and why:

* ``match_prefix``: segment-wise lookup; the returned node handle is a ``SpanPath`` (every
  segment's last node, and the matched indices) so that locking protects every segment;
* ``inc_lock_ref`` / ``dec_lock_ref`` / ``resolve_node_handle`` / ``path_device_indices``:
  accept a ``SpanPath`` (SGLang 0.5.23 reads a request's matched indices off its handle);
* caching a request: insert each segment's own KV under its namespace and free exactly the
  duplicate indices this request owns (and, on finishing, its own turned copies of moved span
  pages: ``position_free.moved_copies``). SGLang 0.5.17 calls ``cache_finished_req`` /
  ``cache_unfinished_req``; 0.5.23 calls ``checkpoint(req, up_to=)`` for a chunk and for the
  finished request alike, then frees the rest of the row itself and calls ``on_release``;
* after a finished request is cached (0.5.23: released), the ``SpanPlanner`` is told (span
  prefills finishing is what releases the requests waiting for them).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sglang_pic.compat.radix_api import (
    insert_params,
    match_result,
    matched_indices,
)
from sglang_pic.compat.request_state import pool_row, protected_len, set_protected_len
from sglang_pic.eviction.context import segment_at
from sglang_pic.position_free import moved_copies

from .segments import Segment

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from .planner import SpanPlanner
    from .store_tier import SpanStoreTier

logger = logging.getLogger(__name__)


class SpanPath:
    """Node handle of a segmented match: the last matched node of every segment, in order, and
    the matched KV indices (int64 ``[matched tokens]``: each segment's part of its path).

    SGLang keeps one handle per request (``req.last_node``) and only passes it back to the cache
    (lock/unlock, scheduling weight, 0.5.23's ``path_device_indices``); attribute reads fall
    through to the deepest node.
    """

    __slots__ = ("nodes", "indices")

    def __init__(self, nodes: list[TreeNode], indices: torch.Tensor):
        self.nodes = nodes
        self.indices = indices

    def __getattr__(self, name: str) -> Any:
        if name in SpanPath.__slots__ or name.startswith("__"):
            # unset slot, or a protocol lookup (copy, pickle): not the deepest node's
            raise AttributeError(name)
        return getattr(self.nodes[-1], name)

    def __repr__(self) -> str:
        return f"SpanPath({[n.id for n in self.nodes]})"


def segments_of(req: Req | None) -> list[Segment] | None:
    return getattr(req, "pic_segments", None) if req is not None else None


def _inserted_by(req: Req) -> dict[int, int]:
    """How much of each of ``req``'s segments (by start) it inserted already: SGLang 0.5.23
    counts a node's hit once per request, for the part of the key past ``inserted_len``, and
    caches a request after its prefill, per chunk and at its end (0.5.17 skips chunks'
    inserts instead: ``chunked``)."""
    inserted = getattr(req, "pic_inserted", None)
    if inserted is None:
        inserted = {}
        req.pic_inserted = inserted
    return inserted


class SpanRadixCache(RadixCache):
    """RadixCache whose requests may be made of independently cached segments."""

    planner: SpanPlanner | None = None
    store: SpanStoreTier | None = None
    """Span pages in PTStore (``store_tier.py``), when ``--ptstore`` is given with spans."""

    # ---- matching -------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        segments = segments_of(params.req)
        if segments is None or self.disable:
            return super().match_prefix(params)
        return self.match_segments(params.key.token_ids, len(params.key), segments)

    def match_segments(self, token_ids: Any, limit: int, segments: list[Segment]) -> MatchResult:
        """Longest run of fully cached segments (the last one may be partial), concatenated."""
        parts: list[torch.Tensor] = []
        nodes: list[TreeNode] = []
        for seg in segments:
            if seg.start >= limit:
                break
            end = limit if seg.end is None else min(seg.end, limit)
            key_end = end if seg.key_end is None else seg.key_end
            result = super().match_prefix(
                MatchPrefixParams(key=RadixKey(token_ids[seg.key_start : key_end], seg.namespace))
            )
            got = matched_indices(self, result)
            offset = seg.start - seg.key_start
            usable = got[offset : offset + (end - seg.start)]
            if len(usable):
                parts.append(usable)
                nodes.append(result.last_device_node)
            if len(usable) < end - seg.start:
                break
        if not parts:
            return self._empty_match_result
        indices = torch.cat(parts)
        return match_result(indices, SpanPath(nodes, indices))

    # ---- locking ---------------------------------------------------------------------------
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if isinstance(node, SpanPath):
            return IncLockRefResult(
                delta=sum(super(SpanRadixCache, self).inc_lock_ref(n).delta for n in node.nodes)
            )
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node: Any, params: Any = None) -> DecLockRefResult:
        if isinstance(node, SpanPath):
            return DecLockRefResult(
                delta=sum(
                    super(SpanRadixCache, self).dec_lock_ref(n, params).delta for n in node.nodes
                )
            )
        return super().dec_lock_ref(node, params)

    def resolve_node_handle(self, node_handle: Any) -> Any:
        if isinstance(node_handle, SpanPath):
            return node_handle.nodes[-1]
        return super().resolve_node_handle(node_handle)

    def path_device_indices(self, node: Any) -> torch.Tensor:
        if isinstance(node, SpanPath):
            return node.indices
        return super().path_device_indices(node)

    # ---- insertion -------------------------------------------------------------------------
    def _insert_segments(
        self,
        req: Req,
        token_ids: Any,
        kv_indices: torch.Tensor,
        *,
        chunked: bool,
        finished: bool,
        is_insert: bool = True,
    ) -> list[tuple[torch.Tensor, int]]:
        """Insert each segment's own KV; return the (indices, start) ranges this request must free.

        Positions below the request's protected length (``protected_len``) came from the tree
        and are not ours to free; anything the tree already held from another request is a
        duplicate we free. A finished
        request also frees the unaligned tail of the last segment (as RadixCache does); an
        unfinished one keeps computing into it.
        """
        n = len(token_ids)
        protected = protected_len(req)
        priority = getattr(req, "priority", 0) or 0
        inserted = _inserted_by(req)
        to_free: list[tuple[torch.Tensor, int]] = []
        for seg in segments_of(req) or ():
            if seg.start >= n:
                break
            end = n if seg.end is None else min(seg.end, n)
            if not seg.owns_key:
                # A link-recompute tail: its pages belong to the standalone span already cached.
                lo = max(seg.start, protected)
                if end > lo:
                    to_free.append((kv_indices[lo:end], lo))
                continue
            key = RadixKey(token_ids[seg.start : end], seg.namespace).page_aligned(self.page_size)
            klen = len(key)
            if is_insert and klen:
                values = kv_indices[seg.start : seg.start + klen].to(dtype=torch.int64, copy=True)
                done = inserted.get(seg.start, 0)
                with segment_at(seg.start):  # eviction policies type the tokens where they sit
                    prefix_len = self.insert(
                        insert_params(key=key, value=values, priority=priority, chunked=chunked,
                                      inserted_len=done)
                    ).prefix_len
                inserted[seg.start] = max(done, klen)
            else:
                prefix_len = klen
            lo, hi = max(seg.start, protected), seg.start + prefix_len
            if hi > lo:
                to_free.append((kv_indices[lo:hi], lo))
            if finished and end > seg.start + klen:
                lo = max(seg.start + klen, protected)
                to_free.append((kv_indices[lo:end], lo))
        return to_free

    def cache_finished_req(self, req: Req, is_insert: bool = True, *, kv_len_to_handle: int):
        if segments_of(req) is None or self.disable:
            super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
        else:
            if getattr(self, "disable_finished_insert", False):
                is_insert = False
            token_ids = (req.origin_input_ids + req.output_ids)[:kv_len_to_handle]
            kv_indices = self.req_to_token_pool.req_to_token[pool_row(req), : len(token_ids)]
            to_free = self._insert_segments(
                req, token_ids, kv_indices, chunked=False, finished=True, is_insert=is_insert
            )
            self.token_to_kv_pool_allocator.free_segments(to_free)
            copier = moved_copies.copier()
            if copier is not None:  # the request's own turned copies of moved span pages
                copier.release(req)
            if req.last_node is not None:
                self.dec_lock_ref(req.last_node)
        if self.planner is not None:
            self.planner.on_request_cached(req)

    def cache_unfinished_req(self, req: Req, chunked: bool = False):
        segments = segments_of(req)
        if segments is None or self.disable:
            return super().cache_unfinished_req(req, chunked)
        kv_indices, new_indices, new_last_node = self._keep_segments(
            req, req.get_fill_ids(), segments, chunked)
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last_node)
        if len(new_indices) < len(kv_indices):
            req.prefix_indices = torch.cat([new_indices, kv_indices[len(new_indices) :]])
        else:
            req.prefix_indices = new_indices
        req.last_node = new_last_node

    def checkpoint(self, req: Req, *, up_to: int, **kwargs: Any) -> None:
        """SGLang 0.5.23 caches a request's first ``up_to`` tokens here, between chunks and when
        it finishes (then frees the row past the tree-owned part and calls ``on_release``): a
        span request's segments go in as between chunks, and its lock moves to the new match."""
        segments = segments_of(req)
        if segments is None or self.disable:
            return super().checkpoint(req, up_to=up_to, **kwargs)
        _, _, new_last_node = self._keep_segments(
            req, req.full_untruncated_fill_ids[:up_to], segments, chunked=not req.finished())
        self.unlock(req.lock)
        req.lock = self.lock(new_last_node)
        req.last_node = new_last_node
        return None

    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        """SGLang 0.5.23: the request's row is freed and its lock dropped (finished, aborted or
        retracted): its own turned copies go, and the planner is told."""
        super().on_release(req, checkpointed=checkpointed)
        if segments_of(req) is not None:
            copier = moved_copies.copier()
            if copier is not None:
                copier.release(req)
        if self.planner is not None:
            self.planner.on_request_cached(req)

    def _keep_segments(self, req: Req, token_ids: Any, segments: list[Segment],
                       chunked: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Insert what a running span request computed in ``token_ids``, free its duplicates,
        and point its row at the tree's pages of the segments now cached (which become its
        protected prefix). Returns its row, the new matched indices and their handle."""
        kv_indices = self.req_to_token_pool.req_to_token[pool_row(req), : len(token_ids)]
        self.token_to_kv_pool_allocator.free_segments(
            self._insert_segments(req, token_ids, kv_indices, chunked=chunked, finished=False)
        )
        match = self.match_segments(token_ids, len(token_ids), segments)
        new_indices = matched_indices(self, match)
        protected = protected_len(req)
        self.req_to_token_pool.write(
            (pool_row(req), slice(protected, len(new_indices))), new_indices[protected:]
        )
        set_protected_len(req, len(new_indices))
        return kv_indices, new_indices, match.last_device_node
