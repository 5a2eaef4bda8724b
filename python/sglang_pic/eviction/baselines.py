"""Strong baselines SGLang 0.5.17 does not ship, as radix-cache eviction policies.

SGLang evicts the leaf with the lowest ``get_priority(node)`` (``RadixCache.evict``), so a policy
is a priority function; these two also learn from evictions through ``on_evict`` (our hooks).

- ``gdsf`` (Greedy-Dual-Size-Frequency, Cherkasova 1998): ``H = L + F * C / S``; F = hits + 1,
  S = tokens, C = the block's recompute cost (linear layers plus attention over its offset), and
  the inflation L = the H of the last evicted block, so long-idle blocks age out.
- ``s3fifo`` (S3-FIFO, Yang et al. SOSP'23): a small probationary FIFO for blocks never
  re-accessed, a main FIFO for re-accessed ones or ones readmitted from the ghost queue of
  recently evicted keys; small is drained first. Expressed as ``(segment, frequency, insertion
  order)`` priorities over leaves.
"""

from __future__ import annotations

from collections import OrderedDict

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from .context import block_key, block_offset

# Offset (tokens) at which a token's attention costs as much as its linear layers; ~30K for
# Llama-3-8B (16 GFLOP/token of weights vs 4 * 4096 * 32 FLOP per token of context).
ATTENTION_CROSSOVER_TOKENS = 30000.0


class GDSFStrategy(EvictionStrategy):
    name = "gdsf"

    def __init__(self) -> None:
        self.inflation = 0.0

    def value(self, node) -> float:
        n = max(len(node.key), 1)
        cost_per_token = 1.0 + (block_offset(node) + n / 2) / ATTENTION_CROSSOVER_TOKENS
        return (node.hit_count + 1) * cost_per_token

    def get_priority(self, node) -> float:
        h = getattr(node, "gdsf_h", None)
        if h is None:
            h = node.gdsf_h = self.inflation + self.value(node)
        return h

    def on_hit(self, node, tokens: int, ctx) -> None:
        node.gdsf_h = self.inflation + self.value(node)

    def on_evict(self, node) -> None:
        self.inflation = max(self.inflation, getattr(node, "gdsf_h", self.inflation))


class S3FIFOStrategy(EvictionStrategy):
    name = "s3fifo"

    def __init__(self, ghost_capacity: int = 65536) -> None:
        self.ghost: OrderedDict[tuple, None] = OrderedDict()
        self.ghost_capacity = ghost_capacity
        self.counter = 0

    def on_insert(self, node, ctx, offset: int, is_new: bool) -> None:
        if not is_new:
            return
        self.counter += 1
        node.s3_order = self.counter
        node.s3_main = self.ghost.pop(block_key(node), False) is None

    def get_priority(self, node) -> tuple:
        order = getattr(node, "s3_order", 0)
        in_main = getattr(node, "s3_main", False) or node.hit_count >= 1
        return (1 if in_main else 0, min(node.hit_count, 3) if in_main else 0, order)

    def on_evict(self, node) -> None:
        if not (getattr(node, "s3_main", False) or node.hit_count >= 1):
            self.ghost[block_key(node)] = None
            if len(self.ghost) > self.ghost_capacity:
                self.ghost.popitem(last=False)
