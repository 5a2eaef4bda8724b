"""Seams in SGLang's hierarchical cache (HiCache): the host tier's tree (``HiRadixCache``), its
cache controller, and the storage tier PTStore serves."""

from __future__ import annotations

from .seam import Seam

TITLE = "HiCache"

_HR = "sglang.srt.mem_cache.hiradix_cache.HiRadixCache"
# the releases with ``HiRadixCache`` (0.5.23 replaced it by ``UnifiedRadixCache``)
_HIRADIX_RELEASES = ("0.5.17",)
_OVERRIDES = {  # HiRadixCache method -> our AROUND hook: it overrides RadixCache's without calling it
    "match_prefix": ("around_match_prefix", "hits, its host-tier part too"),
    "insert": ("around_insert", "inserts (the path found by a read-only walk)"),
    "_split_node": ("around_split_node", "splits"),
    "evict": ("around_evict", "device evict passes"),
    "_evict_backuped": ("around_evict_backuped",
                        "a device eviction that keeps the block on the host: `on_demote`"),
    "evict_host": ("around_evict_host", "a host-tier evict pass, `on_evict` per block removed"),
    "write_backup": ("around_write_backup",
                     "write-through asks the policy first (`worth_host_copy`: `sae` defers)"),
    "_drop_subtree_no_host": ("around_drop_subtree",
                              "`write_back` finding no host room drops a subtree: `on_evict`"),
}

_URC = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
_UTC = "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore"
_FULL = "sglang.srt.mem_cache.unified_cache.components.full.FullComponent"
_UNIFIED_RELEASES = ("0.5.23",)
# 0.5.23: where the same events come from on UnifiedRadixCache's Python tree core, which our
# policies run on with HiCache (``eviction.tree``; ``eviction.unified_hooks``)
_UNIFIED_EVENTS = {
    f"{_URC}.match_prefix": ("hooks:around_match_prefix", "hits, its host-tier part too"),
    f"{_URC}.insert": ("hooks:around_insert", "inserts (node ids resolved)"),
    f"{_URC}.checkpoint": ("hooks:around_cache_req", "the request's context while it is cached"),
    f"{_URC}._evict": ("unified_hooks:around_evict_pass",
                       "device evict passes (`evict` and the allocator's `evict_for_alloc`)"),
    f"{_URC}.evict_host": ("unified_hooks:around_evict_pass", "a host-tier evict pass"),
    f"{_URC}._execute_and_commit_kv_backup": (
        "unified_hooks:around_kv_backup",
        "write-through asks the policy first (`worth_host_copy`: `sae` defers)"),
    f"{_UTC}._split_node": ("unified_hooks:around_split_node", "splits"),
    f"{_UTC}._demote": ("unified_hooks:around_demote",
                        "a device eviction that keeps the block on the host: `on_demote`"),
    f"{_UTC}._remove_leaf_from_parent": ("unified_hooks:around_remove_leaf",
                                         "a block leaves the tree: `on_evict`"),
    f"{_FULL}._evict_device_start": (
        "unified_hooks:around_evict_device_start",
        "the device walk's heap over a sample of the leaves (a policy's `sample_size`)"),
    f"{_FULL}._evict_device_next_node": (
        "unified_hooks:around_evict_device_next_node",
        "a new sample when the walk's runs dry before the pass freed what it needs"),
    "sglang.srt.mem_cache.unified_cache.unified_tree_core.get_and_increase_time_counter": (
        "unified_hooks:around_time_counter",
        "access times in seconds with our policies (`sae` scores the time since a block's use)"),
}

ROWS: tuple[Seam, ...] = (
    *(Seam(f"{_HR}.{method}", f"sglang_pic.eviction.hooks:{hook}", "AROUND", "eviction", why=why,
           releases=_HIRADIX_RELEASES)
      for method, (hook, why) in _OVERRIDES.items()),
    *(Seam(target, f"sglang_pic.eviction.{hook}", "AROUND", "eviction", why=why,
           releases=_UNIFIED_RELEASES)
      for target, (hook, why) in _UNIFIED_EVENTS.items()),
    Seam(f"{_HR}.check_prefetch_progress",
         "sglang_pic.store.prefetch_trace:around_check_prefetch_progress", "AROUND",
         "hicache-storage", "ptstore_trace",
         why="a trace line when the scheduler takes a finished prefetch",
         releases=_HIRADIX_RELEASES),
    Seam("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._handle_prefetch_result",
         "sglang_pic.store.prefetch_trace:around_handle_prefetch_result", "AROUND",
         "hicache-storage", "ptstore_trace", releases=("0.5.23",),
         why="the same line on 0.5.23, where a finished prefetch goes into the tree (at the "
             "cache controller's acknowledgement, before the scheduler checks)"),
    Seam("sglang.srt.managers.cache_controller.HiCacheController._storage_hit_query",
         "sglang_pic.store.idle_yield:around_hit_query", "AROUND", "hicache-storage",
         "storage_idle_yield",
         why="a storage lookup in flight: the idle pass waits for its end instead of napping"),
    Seam("sglang.srt.mem_cache.hicache_storage.HiCacheStorage",
         "sglang_pic.store.hicache_backend:PTStoreHiCacheStorage", "call", "hicache-storage",
         why="PTStore implements SGLang's storage interface; SGLang loads it as the `dynamic` "
             "backend named in `--hicache-storage-backend-extra-config`"),
)
