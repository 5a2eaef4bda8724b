"""Strong baselines SGLang 0.5.17 does not ship, as radix-cache eviction policies.

SGLang evicts the leaf with the lowest ``get_priority(node)`` (``RadixCache.evict``), so a policy
is a priority function; these also learn from the cache's events (``policy.CachePolicy``, reported
by our hooks).

- ``gdsf`` (Greedy-Dual-Size-Frequency, Cherkasova 1998): ``H = L + F * C / S``; F = hits + 1,
  S = tokens, C = the block's recompute cost (linear layers plus attention over its offset), and
  the inflation L = the H of the last evicted block, so long-idle blocks age out.
- ``s3fifo`` (S3-FIFO, Yang et al. SOSP'23): a small probationary FIFO (10 % of the cache) for
  new blocks, a main FIFO with reinsertion for blocks reused on probation or readmitted from the
  ghost queue of keys evicted from small; small is drained while it holds more than its share.
  Its moves are made lazily, when a leaf is ranked (``S3FIFOStrategy``).
- ``tlru`` (Tail-Optimized LRU, Zhang et al., NeurIPS'25, arXiv:2510.15152), ported from SGLang's
  ``TLRUStrategy`` (merged after 0.5.17): LRU that first drains the tail of each conversation
  that its next prefill does not need to stay under a TTFT budget.
"""

from __future__ import annotations

from collections import OrderedDict

from sglang_pic.launcher.server_flags import setting

from .context import block_key, block_offset
from .policy import CachePolicy

# Offset (tokens) at which a token's attention costs as much as its linear layers; ~30K for
# Llama-3-8B (16 GFLOP/token of weights vs 4 * 4096 * 32 FLOP per token of context).
ATTENTION_CROSSOVER_TOKENS = 30000.0


class GDSFStrategy(CachePolicy):
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


class S3FIFOStrategy(CachePolicy):
    """S3-FIFO over the radix tree's leaves, with the paper's queue sizes and lazy moves.

    Why lazy: SGLang's ``evict`` pops the lowest priority among the evictable leaves and offers
    no hook to put a popped leaf back, while S3-FIFO moves blocks between queues as its hand
    reaches them. Both moves are therefore made when a leaf is next ranked:

    * ``small`` (probation, ``SMALL_SHARE`` of the cache's tokens) takes new blocks; a block
      readmitted from the ghost set (the keys last evicted from ``small``, as many tokens as
      ``main`` holds) goes to ``main`` at once.
      A block reused while in ``small`` moves to ``main`` when it is ranked; one never reused is
      evicted from ``small`` (and remembered in the ghost set) while ``small`` holds more than its
      share.
    * ``main`` is FIFO with reinsertion: each reuse adds one to a block's count (at most 3);
      a block the hand has passed (inserted before the newest block evicted from ``main``)
      with a count left goes to the tail with one less. Ranked now, blocks with a count come
      after every block without one, in insertion order, which is where one sweep of the hand
      leaves them.

    Priorities: ``(queue drained first?, has a count, order)``; ``small`` is drained first only
    while it holds more than its share (checked once per evict pass)."""

    name = "s3fifo"
    SMALL_SHARE = 0.1
    MAX_FREQ = 3

    def __init__(self) -> None:
        # keys evicted from small (and their tokens), as many tokens as main holds
        self.ghost: OrderedDict[tuple, int] = OrderedDict()
        self.ghost_tokens = 0
        self.counter = 0
        self.small_tokens = 0
        self.capacity = 0  # the most tokens the cache has held
        self.hand = 0  # order of the newest block evicted from main
        self.drain_small = False

    def _to_main(self, node) -> None:
        if not node.s3_main:
            node.s3_main = True
            self.small_tokens -= len(node.key)
        self.counter += 1
        node.s3_order = self.counter

    def on_store(self, tokens, ctx, page_size: int, used: int, root=None) -> None:
        self.capacity = max(self.capacity, used)

    def on_insert(self, node, ctx, offset: int, is_new: bool) -> None:
        if not is_new or hasattr(node, "s3_order"):
            return
        self.counter += 1
        node.s3_order = self.counter
        node.s3_freq = 0
        ghosted = self.ghost.pop(block_key(node), None)
        node.s3_main = ghosted is not None
        if node.s3_main:
            self.ghost_tokens -= ghosted
        else:
            self.small_tokens += len(node.key)

    def on_hit(self, node, tokens: int, ctx) -> None:
        if hasattr(node, "s3_order"):
            node.s3_freq = min(node.s3_freq + 1, self.MAX_FREQ)

    def on_split(self, head, tail) -> None:
        if hasattr(tail, "s3_order"):  # both parts stay in the tail's queue, same tokens in all
            head.s3_order, head.s3_freq, head.s3_main = tail.s3_order, tail.s3_freq, tail.s3_main

    def begin_evict(self) -> None:
        self.drain_small = self.small_tokens > self.SMALL_SHARE * self.capacity

    def get_priority(self, node) -> tuple:
        if not hasattr(node, "s3_order"):  # inserted before the policy saw it
            return (0, 0, 0)
        if not node.s3_main:
            if node.s3_freq > 0:  # reused on probation: promoted
                node.s3_freq = 0
                self._to_main(node)
            else:
                return (0 if self.drain_small else 1, 0, node.s3_order)
        if node.s3_freq > 0 and node.s3_order < self.hand:  # the hand passed it: reinserted
            node.s3_freq -= 1
            self._to_main(node)
        return (1 if self.drain_small else 0, int(node.s3_freq > 0), node.s3_order)

    def on_evict(self, node) -> None:
        if not hasattr(node, "s3_order"):
            return
        if node.s3_main:
            self.hand = max(self.hand, node.s3_order)
        else:
            self.small_tokens -= len(node.key)
            key = block_key(node)
            self.ghost_tokens += len(node.key) - self.ghost.pop(key, 0)
            self.ghost[key] = len(node.key)
            while self.ghost and self.ghost_tokens > (1 - self.SMALL_SHARE) * self.capacity:
                self.ghost_tokens -= self.ghost.popitem(last=False)[1]


# ``--radix-eviction-policy tlru`` takes its settings from ``--tlru-threshold`` (the paper's xi,
# in tokens) and ``--tlru-next-prompt-estimate`` (Q_hat, tokens), read when the policy is built
# in the scheduler process; both default to SGLang's 0, with which every block is protected and
# T-LRU is LRU.


TLRU_TUNED = {"threshold": 1536, "next_prompt_estimate": 512}
"""T-LRU's (xi, Q_hat) in tokens where nobody set them: the replay's ``tlru`` and ``auto``'s
``tlru`` expert. The best mean token hit rate over the 5-40 % cache sizes on the first 60 % of
the Mooncake conversation trace (``replay_trace.py --tune-tlru``: xi - Q_hat of 256..8192 tokens;
1024 won, +0.16 pp over LRU on average), never tuned on the held-out 40 %. SGLang's defaults
(0, 0), the server's, make T-LRU plain LRU."""


class TLRUStrategy(CachePolicy):
    """Tail-Optimized LRU (Zhang, Li, Moallemi, Peng, "Tail-Optimized Caching for LLM
    Inference", NeurIPS'25, arXiv:2510.15152), the rule of SGLang's ``TLRUStrategy``
    (``python/sglang/srt/mem_cache/evict_policy.py``, sgl-project/sglang PR #34012, "Add
    Agentic-Aware Tail-Optimized LRU eviction to the unified radix cache"; later than SGLang
    0.5.17, which does not have it).

    Why: a conversation whose history is ``L`` tokens and whose next prompt adds about
    ``Q_hat`` only needs ``L + Q_hat - threshold`` of them cached for its next prefill to stay
    under a TTFT budget of ``threshold`` uncached tokens; the tail past that cannot improve its
    tail latency, so it is "TEL-safe" and evicted first, in LRU order (the paper's phase 1);
    once none is left, everything goes in plain LRU order (phase 2). SGLang's rule, verbatim in
    substance::

        budget = max(history_len + next_prompt_estimate - threshold, 0)
        tel_safe = cached_prefix_len - len(node.key) >= budget
        priority = (-1 if tel_safe else 0, node.last_access_time)

    ``cached_prefix_len`` is the node's depth (tokens from the root through its end; here
    ``block_offset(node) + len(node.key)``, which our hooks keep across splits) and
    ``history_len`` the high-water depth of the branch below the node, which only grows: a
    trimmed conversation is still measured against its full history, so T-LRU stops after
    ``threshold - Q_hat`` tokens instead of walking it down to nothing. SGLang sets both in its
    tree's insert and split; here our hooks' ``on_insert`` / ``on_split`` do (the head of a split
    takes its tail's high-water mark: the branch below it is the same). Thresholds are in tokens
    (the paper states them in blocks)."""

    name = "tlru"

    def __init__(self, threshold: float | None = None,
                 next_prompt_estimate: float | None = None) -> None:
        self.threshold = setting("--tlru-threshold") if threshold is None else threshold
        self.next_prompt_estimate = (setting("--tlru-next-prompt-estimate")
                                     if next_prompt_estimate is None else next_prompt_estimate)

    def get_priority(self, node) -> tuple[int, float]:
        budget = max(getattr(node, "tlru_history_len", 0) + self.next_prompt_estimate
                     - self.threshold, 0)
        cached_without_this_node = block_offset(node)  # depth of its end minus its own tokens
        tel_safe = cached_without_this_node >= budget
        return (-1 if tel_safe else 0, node.last_access_time)

    def on_insert(self, node, ctx, offset: int, is_new: bool) -> None:
        """Raise the high-water depth of ``node`` and its ancestors to ``node``'s depth (the
        inserted path is reported top-down, so the deepest node's call raises the whole path)."""
        depth = offset + len(node.key)
        while node is not None and node.parent is not None and getattr(
                node, "tlru_history_len", 0) < depth:
            node.tlru_history_len = depth
            node = node.parent

    def on_split(self, head, tail) -> None:
        head.tlru_history_len = max(getattr(head, "tlru_history_len", 0),
                                    getattr(tail, "tlru_history_len", 0))
