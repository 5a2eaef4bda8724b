"""Shadow caches: what each eviction policy would have hit on the traffic the server sees.

``auto`` runs one shadow per expert policy: a radix tree of SGLang's own ``RadixCache`` class
that holds token ids only (no KV), fed every request's prompt (a lookup, counting the tokens
the expert's cache would have matched) and every insert, and evicting with that expert alone
down to the real cache's size. Unlike weights learned from the real cache's evictions (LeCaR,
CACHEUS), a shadow's hits do not depend on which expert evicted in the real cache, so they rank
the experts as they would do on their own, and ``auto`` follows the best of them.

Shapes and cost: a shadow stores the same token keys as the real tree (int64 per token, about
8 MB per million tokens cached); per request one match and one insert per shadow.

*Drop marks* let the real cache follow one shadow: each real-tree node carries a bit mask
(attribute ``DROPS``) of the shadows that no longer hold its tokens to the node's end. A shadow's
eviction marks the real node holding the evicted block's first token and everything below it; an
insert, which every shadow also gets, clears the marks along its path. Both are walks along one
path of the real tree (slices compared in C), a few per request whatever the tree's size.
"""

from __future__ import annotations

from array import array
from typing import Any

from sglang_pic.compat.radix_api import matched_tokens

DROPS = "_pic_shadow_drops"
"""Attribute on the real tree's nodes: the bit mask of shadows that no longer hold the node."""


class KeysOnlyAllocator:
    """What ``RadixCache`` needs from a KV allocator when its values are not KV: a device and
    ``free`` calls (nothing to free)."""

    device = "cpu"

    def free(self, value: Any) -> None:
        pass

    def free_segment(self, value: Any, start_pos: int = 0) -> None:
        pass

    def free_segments(self, segments: Any) -> None:
        pass


def _shadow_tree_class() -> type:
    """SGLang's ``RadixCache`` that keeps the nodes each evict pass deletes (``dropped``)."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    class ShadowTree(RadixCache):
        dropped: list

        def _delete_leaf(self, node: Any) -> None:
            self.dropped.append(node)
            super()._delete_leaf(node)

    return ShadowTree


class ShadowCache:
    """A token-only radix tree evicting with one policy (``policy``: a registered eviction
    policy name, with ``settings``: attributes set on its strategy), sized to the real cache
    (``capacity``, tokens)."""

    def __init__(self, policy: str, page_size: int, settings: dict | None = None) -> None:
        import torch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        params = CacheInitParams(disable=False, req_to_token_pool=None,
                                 token_to_kv_pool_allocator=KeysOnlyAllocator(),
                                 page_size=page_size, eviction_policy=policy)
        self.cache = _shadow_tree_class()(params)
        self.cache.dropped = []
        self.strategy = self.cache.eviction_strategy
        for name, value in (settings or {}).items():
            setattr(self.strategy, name, value)
        self.page_size = page_size
        self._values = torch.arange(0)

    def _slots(self, n: int):
        """Values for an insert of ``n`` tokens: views of one range (nothing reads them)."""
        import torch

        if len(self._values) < n:
            self._values = torch.arange(max(n, 2 * len(self._values)))
        return self._values[:n]

    def lookup(self, tokens: Any) -> int:
        """Tokens of ``tokens`` (a prompt) this cache holds as a prefix."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, None)))
        return matched_tokens(match)

    def store(self, tokens: Any, capacity: int) -> list:
        """Cache ``tokens`` as the real cache does: with the prefix this cache already holds
        locked, evict room for the rest down to ``capacity`` tokens with this cache's policy,
        then insert (nothing, if the room cannot be made). Evicting after the insert instead
        would let a policy drop the blocks just inserted or the prefix they extend, which the
        real cache never does: such a shadow misjudges its policy by several points.

        Returns the nodes that eviction deleted (each with its key and its parent still set)."""
        from dataclasses import replace

        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.radix_cache import RadixKey

        from .context import current, using

        cache = self.cache
        cache.dropped = []
        n = len(tokens) // self.page_size * self.page_size
        if n == 0:
            return []
        key = RadixKey(tokens[:n], None)
        ctx = current()
        with using(replace(ctx, count_hits=False) if ctx is not None else None):
            match = cache.match_prefix(MatchPrefixParams(key=key))
        new = n - matched_tokens(match)
        if new == 0:
            return []
        cache.inc_lock_ref(match.last_device_node)
        try:
            over = cache.evictable_size() + cache.protected_size() + new - capacity
            if over > 0:
                cache.evict(EvictParams(num_tokens=over))
            room = capacity - cache.evictable_size() - cache.protected_size()
            if room >= new:
                cache.insert(InsertParams(key=key, value=self._slots(n)))
        finally:
            cache.dec_lock_ref(match.last_device_node)
        return cache.dropped


def path_tokens(node: Any) -> array:
    """The tokens from a tree's root to the end of ``node`` (``array("q")``, SGLang's keys)."""
    keys = []
    while node is not None and node.key is not None and len(node.key):
        keys.append(node.key.raw_token_ids())
        node = node.parent
    tokens = array("q")
    for key in reversed(keys):
        tokens.extend(key)
    return tokens


def _child(node: Any, tokens: Any, at: int, page: int) -> Any:
    return node.children.get(tokens[at] if page == 1 else tuple(tokens[at:at + page]))


def clear_path(root: Any, tokens: Any, bits: int, page: int) -> None:
    """Clear ``bits`` on the nodes of the real tree (``root``) that ``tokens`` cover to their
    end: every shadow holds what was just inserted."""
    tokens = tokens if isinstance(tokens, array) else array("q", tokens)
    node, at, n = root, 0, len(tokens)
    while at < n:
        node = _child(node, tokens, at, page)
        if node is None:
            return
        key = node.key.raw_token_ids()
        if at + len(key) > n or key != tokens[at:at + len(key)]:
            return
        mask = getattr(node, DROPS, 0)
        if mask & bits:
            setattr(node, DROPS, mask & ~bits)
        at += len(key)


def mark_dropped(root: Any, dropped: Any, bit: int, page: int) -> None:
    """Set ``bit`` on the real tree's node (``root``) holding the first token of ``dropped`` (a
    node a shadow just evicted) and on everything below it: that shadow no longer holds them
    to their end."""
    tokens = path_tokens(dropped)
    first = len(tokens) - len(dropped.key)
    node, at = root, 0
    while True:
        node = _child(node, tokens, at, page)
        if node is None:
            return
        key = node.key.raw_token_ids()
        upto = min(len(key), first + 1 - at)  # compare through the dropped block's first token
        if key[:upto] != tokens[at:at + upto]:
            return
        if at + len(key) > first:
            break
        at += len(key)
    below = [node]
    while below:
        n = below.pop()
        setattr(n, DROPS, getattr(n, DROPS, 0) | bit)
        below.extend(n.children.values())
