"""Cache events of SGLang 0.5.23's ``UnifiedRadixCache`` with HiCache, for learning policies.

With ``--enable-hierarchical-cache`` and one of our policies, 0.5.23 serves the cache from
``UnifiedRadixCache`` on its Python tree core (``eviction.tree``). That core orders both of
HiCache's evictions (the device tier's, which keeps a host copy or drops the block, and the host
tier's) by the policy's ``get_priority`` itself, so ordering needs no hook; what does is the
events a policy learns from, which 0.5.23 raises in other places than 0.5.17's ``HiRadixCache``:

- ``UnifiedRadixCache.match_prefix`` / ``insert`` / ``checkpoint``: the hooks of ``hooks``
  (``around_match_prefix``, ``around_insert``, ``around_cache_req``); they read node ids through
  ``resolve_node_handle``;
- ``UnifiedRadixCache._evict`` (``evict`` and the allocator's ``evict_for_alloc``) and
  ``evict_host``: one evict pass each for the policy (``around_evict_pass``);
- ``UnifiedTreeCore._split_node``: ``on_split`` (it returns the head and an action);
- ``UnifiedTreeCore._demote``: the device copy goes, the host copy stays: ``on_demote``;
- ``UnifiedTreeCore._remove_leaf_from_parent``: the one place a block leaves the tree (device
  eviction without a host copy, host eviction, a dropped subtree, emptied ancestors):
  ``on_evict``;
- ``UnifiedRadixCache._execute_and_commit_kv_backup``: a write-through copy to the host tier
  asks the policy's ``worth_host_copy`` first, node by node from the root, and stops at the
  first block it declines (as ``hooks.around_write_backup`` does on 0.5.17);
- ``unified_tree_core.get_and_increase_time_counter``: the core stamps access times from a
  counter; with one of our policies (``use_clock``) it is the monotonic clock, strictly
  increasing, because ``sae`` scores a block by the seconds since its last use;
- ``FullComponent._evict_device_start`` / ``_evict_device_next_node``: the device tier's walk
  scores every evictable leaf into one heap; a policy with a ``sample_size`` (``--sae-sample``)
  has it score a random sample of that many leaves instead, and a new sample when the heap runs
  dry before the pass has freed what it needs (``hooks._sampled_evict`` on ``RadixCache``).
"""

from __future__ import annotations

import heapq
import time

from .hooks import _evict_pass, _learner, host_copy_wanted, report_split

_CLOCK = {"on": False, "last": 0.0}


def use_clock(on: bool = True) -> None:
    """Access times from the monotonic clock (``on``) or SGLang's counter."""
    _CLOCK["on"] = on


def around_time_counter(original, *args, **kwargs):
    """``get_and_increase_time_counter``: seconds (``time.monotonic``), strictly increasing, once
    ``use_clock`` is on; SGLang's counter otherwise."""
    if not _CLOCK["on"]:
        return original(*args, **kwargs)
    now = max(time.monotonic(), _CLOCK["last"] + 1e-6)
    _CLOCK["last"] = now
    return now


def around_evict_pass(original, self, *args, **kwargs):
    """``_evict`` / ``evict_host``: one evict pass for the policy (one clock reading; nested
    passes, a write-back eviction making host room, are one)."""
    strategy = _learner(self)
    if strategy is None:
        return original(self, *args, **kwargs)
    need = getattr(args[0], "num_tokens", args[0]) if args else None
    with _evict_pass(strategy, need if isinstance(need, int) else None):
        return original(self, *args, **kwargs)


def around_split_node(original, self, key, child, split_len, *args, **kwargs):
    """``UnifiedTreeCore._split_node``: ``child`` keeps its id as the tail; the new head is its
    parent now."""
    head, action = original(self, key, child, split_len, *args, **kwargs)
    report_split(_learner(self), head, child)
    return head, action


def around_demote(original, self, node, *args, **kwargs):
    """``UnifiedTreeCore._demote``: the device copy of ``node`` is freed, its host copy stays."""
    strategy = _learner(self)
    if strategy is not None:
        strategy.on_demote(node)
    return original(self, node, *args, **kwargs)


def around_remove_leaf(original, self, node, *args, **kwargs):
    """``UnifiedTreeCore._remove_leaf_from_parent``: ``node`` leaves the tree."""
    strategy = _learner(self)
    if strategy is not None:
        strategy.on_evict(node)
    return original(self, node, *args, **kwargs)


def around_kv_backup(original, self, action, *args, **kwargs):
    """``_execute_and_commit_kv_backup(action, write_back=False)``: a write-through copy of the
    chain ``action.node_ids`` (root first) to the host tier. The blocks the policy finds not
    worth a copy (``worth_host_copy``) and everything below the first of them are left out, as
    SGLang leaves out a block whose parent has no copy; SGLang asks again at the block's next
    insert. A ``write_back`` copy (the device evict chose the block) is not asked."""
    write_back = kwargs.get("write_back", args[0] if args else False)
    strategy = _learner(self)
    if write_back or strategy is None or getattr(self, "buffer_pipeline", None) is not None:
        return original(self, action, *args, **kwargs)
    kept = []
    for node_id in action.node_ids:
        node = self.resolve_node_handle(node_id)
        if not node.backuped and not host_copy_wanted(self, strategy, node):
            break
        kept.append(node_id)
    if len(kept) == len(action.node_ids):
        return original(self, action, *args, **kwargs)
    if not kept:
        return 0
    return original(self, type(action)(node_ids=kept), *args, **kwargs)


def _sample_size(component) -> int:
    strategy = _learner(component.tree_core)
    return strategy.sample_size if strategy is not None else 0


def _heap_from_sample(component, k: int) -> None:
    """The walk's heap over a random sample of ``k`` evictable device leaves."""
    leaves = component.tree_core.evictable_device_leaves
    rng = _learner(component.tree_core).rng
    sample = rng.sample(list(leaves), k) if len(leaves) > k else list(leaves)
    component._evict_device_heap = [(component.session_ref_eviction_strategy(n), n)
                                    for n in sample]
    heapq.heapify(component._evict_device_heap)


def around_evict_device_start(original, self, request_cnt, *args, **kwargs):
    """``FullComponent._evict_device_start``: with a ``sample_size`` policy, the heap holds a
    sample of the evictable leaves (SGLang's own start sets the walk's counters)."""
    k = _sample_size(self)
    leaves = self.tree_core.evictable_device_leaves
    if not k or len(leaves) <= k:
        return original(self, request_cnt, *args, **kwargs)
    self.tree_core.evictable_device_leaves = set()  # SGLang's start scores none of them
    try:
        original(self, request_cnt, *args, **kwargs)
    finally:
        self.tree_core.evictable_device_leaves = leaves
    _heap_from_sample(self, k)


def around_evict_device_next_node(original, self, tracker, *args, **kwargs):
    """``FullComponent._evict_device_next_node``: the sample ran out before the pass freed what
    it asked for: a new sample, and the next node from it."""
    node_id = original(self, tracker, *args, **kwargs)
    if node_id is not None or not self.tree_core.evictable_device_leaves \
            or tracker[self.component_type] >= self._evict_device_request_cnt:
        return node_id
    k = _sample_size(self)
    if k:
        _heap_from_sample(self, k)
        node_id = original(self, tracker, *args, **kwargs)
    return node_id
