"""Seams in SGLang's prefix cache (``RadixCache``): our cache backend, our eviction policies,
and the cache events learning policies see."""

from __future__ import annotations

from .seam import Seam

TITLE = "Radix cache"

_R = "sglang.srt.mem_cache.radix_cache.RadixCache"
_NODE = "sglang.srt.mem_cache.radix_cache.TreeNode"
_SPAN = "sglang_pic.spans.radix_cache.SpanRadixCache"
_POLICIES = "sglang.srt.mem_cache.utils._EVICTION_POLICY_FACTORIES"
_POLICY_CHOICES = "sglang.srt.server_args.RADIX_EVICTION_POLICY_CHOICES"
_OUR_POLICIES = {
    "auto": "sglang_pic.eviction.auto:AutoStrategy",
    "sae": "sglang_pic.eviction.sae:SAEStrategy",
    "gdsf": "sglang_pic.eviction.baselines:GDSFStrategy",
    "s3fifo": "sglang_pic.eviction.baselines:S3FIFOStrategy",
    "tlru": "sglang_pic.eviction.baselines:TLRUStrategy",
}
_EVENTS = {  # RadixCache method -> our AROUND hook: the events learning policies see
    "match_prefix": ("around_match_prefix", "`on_hit` for the match that admitted a request"),
    "insert": ("around_insert", "`on_match`, `on_request`, `on_insert` along the inserted path"),
    "_delete_leaf": ("around_delete_leaf", "`on_evict`"),
    "_split_node": ("around_split_node", "`on_split`: the policy re-derives what each half holds"),
    "evict": ("around_evict", "`begin_evict` / `end_evict` around a pass; a policy's "
                              "`sample_size` leaves per pass"),
    "cache_finished_req": ("around_cache_req", "the request's context while it is cached"),
    "cache_unfinished_req": ("around_cache_req", "likewise, without counting its re-match"),
    "checkpoint": ("around_cache_req", "the same on 0.5.23, which caches a request (finished or "
                                       "a chunk of it) through `checkpoint(req, up_to=)`"),
}

# the releases whose scheduler caches a request through ``cache_finished_req`` /
# ``cache_unfinished_req``; 0.5.23 calls ``checkpoint``, reads a match's indices off its node
# (``path_device_indices``) and calls ``on_release`` when it has freed a request's row
_CACHE_REQ_RELEASES = ("0.5.17",)
_CHECKPOINT_RELEASES = ("0.5.23",)


def _event_releases(method: str) -> tuple[str, ...] | None:
    if method.startswith("cache_"):
        return _CACHE_REQ_RELEASES
    if method in ("checkpoint", "path_device_indices", "on_release"):
        return _CHECKPOINT_RELEASES
    return None


_SPAN_OVERRIDES = {  # RadixCache method -> what SpanRadixCache's override does
    "match_prefix": "a request with spans matches segment by segment",
    "inc_lock_ref": "locks every node of a segmented match (a handle over several paths)",
    "dec_lock_ref": "unlocks them",
    "resolve_node_handle": "the handle's last node for SGLang's bookkeeping",
    "cache_finished_req": "inserts a finished span request's KV per segment",
    "cache_unfinished_req": "the same for a chunk of a prefill still running",
    "checkpoint": "the same on 0.5.23, for a chunk and for a finished request",
    "path_device_indices": "a segmented match's indices, which 0.5.23 reads off the handle",
    "on_release": "0.5.23: a released span request's turned copies go; the planner is told",
}

ROWS: tuple[Seam, ...] = (
    Seam("sglang.srt.mem_cache.registry._RADIX_CACHE_REGISTRY",
         "sglang_pic.spans.factory:create_span_radix_cache", "registry", "spans", key="pic_span",
         why="`SpanRadixCache` (segmented match and insert) as `--radix-cache-backend pic_span`"),
    *(Seam(f"{_R}.{method}", f"sglang_pic.spans.radix_cache:SpanRadixCache.{method}",
           "override", "spans",
           why=why + " (SGLang must still call this method, or the override is dead code)",
           releases=_event_releases(method))
      for method, why in _SPAN_OVERRIDES.items()),
    *(Seam(_POLICIES, factory, "registry", "eviction", key=name,
           why="our policy in SGLang's eviction-policy table")
      for name, factory in _OUR_POLICIES.items()),
    Seam("sglang.srt.mem_cache.registry.default_radix_cache_factory",
         "sglang_pic.eviction.tree:around_default_radix_cache_factory", "AROUND", "eviction",
         releases=_CHECKPOINT_RELEASES,
         why="a cache on one of our policies is a `RadixCache` (0.5.23's default tree orders "
             "evictions natively, by policy name); settings that need the unified tree are "
             "refused"),
    *(Seam(_POLICY_CHOICES, None, "registry", "eviction", key=name,
           why="a `--radix-eviction-policy` choice")
      for name in _OUR_POLICIES),
    *(Seam(f"{_R}.{method}", f"sglang_pic.eviction.hooks:{hook}", "AROUND", "eviction", why=why,
           releases=_event_releases(method))
      for method, (hook, why) in _EVENTS.items()),
    *(Seam(f"{_SPAN}.{method}", f"sglang_pic.eviction.hooks:{_EVENTS[method][0]}", "AROUND",
           "eviction", releases=_event_releases(method),
           why="our span cache matches per segment and caches span requests itself: the same "
               "events, a segmented match reported once")
      for method in ("match_prefix", "cache_finished_req", "cache_unfinished_req",
                     "checkpoint")),
    Seam(f"{_R}.evictable_leaves", "sglang_pic.eviction.hooks:_sampled_evict",
         "instance-patch", "eviction",
         why="swapped for a random sample during one `evict` pass (a policy with `sample_size`)"),
    Seam(f"{_NODE}._pic_seen", "sglang_pic.eviction.hooks:around_insert", "attribute",
         "eviction", why="a block the policy has seen inserted"),
    Seam(f"{_NODE}._pic_offset", "sglang_pic.eviction.hooks:around_insert", "attribute",
         "eviction", why="a block's token offset in its request (kept across splits)"),
    Seam(f"{_NODE}.sae", "sglang_pic.eviction.sae:SAEStrategy.on_insert", "attribute",
         "eviction", why="what `sae` knows of a block (`BlockInfo`: its type, session, queue)"),
    Seam(f"{_NODE}.sae_conv", "sglang_pic.eviction.sae:SAEStrategy.on_insert", "attribute",
         "eviction", why="likewise for `auto`'s `sae-conv` expert, which infers conversations "
                         "(`eviction.auto.VARIANTS`)"),
    Seam(f"{_NODE}._pic_shadow_drops", "sglang_pic.eviction.shadow:mark_dropped", "attribute",
         "eviction", why="`auto`'s drop marks: the shadows that no longer hold a block"),
    Seam(f"{_R}._pic_pending_hits", "sglang_pic.eviction.hooks:around_match_prefix",
         "attribute", "eviction", why="each request's latest match, reported when it is cached"),
    Seam(f"{_R}._pic_hit_counted", "sglang_pic.eviction.hooks:_report_pending_hits",
         "attribute", "eviction", why="requests whose hits were reported"),
    Seam(f"{_R}._pic_requests_seen", "sglang_pic.eviction.hooks:_first_report", "attribute",
         "eviction", why="requests reported to the policy (`on_request` once each)"),
)
