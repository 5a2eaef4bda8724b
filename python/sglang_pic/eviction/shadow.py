"""Shadow caches: what each eviction policy would have hit on the traffic the server sees.

``auto`` runs one shadow per expert policy: a radix tree of SGLang's own ``RadixCache`` class
that holds token ids only (no KV), fed every request's prompt (a lookup, counting the tokens
the expert's cache would have matched) and every insert, and evicting with that expert alone
down to the real cache's size. Unlike weights learned from the real cache's evictions (LeCaR,
CACHEUS), a shadow's hits do not depend on which expert evicted in the real cache, so they rank
the experts as they would do on their own, and ``auto`` follows the best of them.

Shapes and cost: a shadow stores the same token keys as the real tree (int64 per token, about
8 MB per million tokens cached); per request one match and one insert per shadow.
"""

from __future__ import annotations

from typing import Any


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


class ShadowCache:
    """A token-only radix tree evicting with one policy (``policy``: a registered eviction
    policy name), sized to the real cache (``capacity``, tokens)."""

    def __init__(self, policy: str, page_size: int) -> None:
        import torch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache

        params = CacheInitParams(disable=False, req_to_token_pool=None,
                                 token_to_kv_pool_allocator=KeysOnlyAllocator(),
                                 page_size=page_size, eviction_policy=policy)
        self.cache = RadixCache(params)
        self.strategy = self.cache.eviction_strategy
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
        return len(match.device_indices)

    def store(self, tokens: Any, capacity: int) -> None:
        """Insert ``tokens``, then evict down to ``capacity`` tokens with this cache's policy."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        n = len(tokens) // self.page_size * self.page_size
        if n == 0:
            return
        key = RadixKey(tokens[:n], None)
        self.cache.insert(InsertParams(key=key, value=self._slots(n)))
        over = self.cache.evictable_size() + self.cache.protected_size() - capacity
        if over > 0:
            self.cache.evict(EvictParams(num_tokens=over))
