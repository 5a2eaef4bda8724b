"""Shadow caches: what each eviction policy would have hit on the traffic the server sees.

``auto`` runs one shadow per expert policy: a radix tree of SGLang's own ``RadixCache`` class
that holds token ids only (no KV), fed every request's prompt (a lookup, counting the tokens
the expert's cache would have matched) and every insert, and evicting with that expert alone
down to the real cache's size. Unlike weights learned from the real cache's evictions (LeCaR,
CACHEUS), a shadow's hits do not depend on which expert evicted in the real cache, so they rank
the experts as they would do on their own, and ``auto`` follows the best of them.

Shapes and cost: a shadow's tree holds one key per ``BLOCK`` tokens (a hash of the block's
tokens; the path from the root still spells the whole prefix), so a 40K-token prompt is a walk
over 2,500 keys, not 40,000; hits and sizes are counted in whole blocks (a prompt's partial last
block is left out, for every expert alike). Per request: one hash pass (numpy) and one match and
one insert per shadow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK = 16
"""Tokens per key of a shadow tree."""
_WEIGHTS = np.random.default_rng(0x5AEC).integers(1, 1 << 61, size=BLOCK, dtype=np.int64) | 1


def block_keys(tokens: Any) -> list[int]:
    """One 64-bit hash per whole ``BLOCK`` of ``tokens`` (ids; a list or an ``array('q')``)."""
    ids = np.asarray(tokens, dtype=np.int64)
    n = len(ids) // BLOCK * BLOCK
    if n == 0:
        return []
    with np.errstate(over="ignore"):
        return (ids[:n].reshape(-1, BLOCK) * _WEIGHTS).sum(axis=1).tolist()


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

    def __init__(self, policy: str) -> None:
        import torch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache

        params = CacheInitParams(disable=False, req_to_token_pool=None,
                                 token_to_kv_pool_allocator=KeysOnlyAllocator(),
                                 page_size=1, eviction_policy=policy)
        self.cache = RadixCache(params)
        self.strategy = self.cache.eviction_strategy
        self._values = torch.arange(0)

    def _slots(self, n: int):
        """Values for an insert of ``n`` tokens: views of one range (nothing reads them)."""
        import torch

        if len(self._values) < n:
            self._values = torch.arange(max(n, 2 * len(self._values)))
        return self._values[:n]

    def lookup(self, keys: list[int]) -> int:
        """Tokens of a prompt (its ``block_keys``) this cache holds as a prefix."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        if not keys:
            return 0
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(keys, None)))
        return len(match.device_indices) * BLOCK

    def store(self, keys: list[int], capacity: int) -> None:
        """Insert a sequence (its ``block_keys``), then evict down to ``capacity`` tokens with
        this cache's policy."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        if not keys:
            return
        self.cache.insert(InsertParams(key=RadixKey(keys, None), value=self._slots(len(keys))))
        over = self.cache.evictable_size() + self.cache.protected_size() - capacity // BLOCK
        if over > 0:
            self.cache.evict(EvictParams(num_tokens=over))
