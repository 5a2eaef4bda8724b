"""``auto``: the eviction policy that follows whichever expert the traffic favours.

Why: no single policy wins everywhere. On replayed traces the best baseline changes with the
traffic and the cache size (``gdsf`` at small caches, ``s3fifo`` at large ones) and ``sae`` is
ahead where its session signals hold and behind where they do not; a user cannot know in advance which to
pick. ``auto`` learns it online, as LeCaR (Vietri et al., HotStorage'18) and CACHEUS (Rodriguez et
al., FAST'21) do: a weight per expert, a ghost list of recently evicted blocks tagged with the
expert that chose each eviction, and a regret update when a block comes back.

* **Experts** (``EXPERTS``): ``sae``, ``gdsf``, ``s3fifo`` and ``lru``. Every expert sees every
  cache event (hits, inserts, splits, evictions), so each keeps its own state whoever evicts.
* **Choice**: at each evict pass one expert is drawn with probability equal to its weight, and
  its priorities order that pass's evictions.
* **Regret**: a block inserted again while its key is in the ghost list was evicted too early.
  The expert that chose that eviction loses weight, ``w *= exp(-rate * 0.5 ** (age / half_life))``
  (``age``: evictions since), and the weights are renormalised with a floor, so an expert that
  was wrong early can come back when traffic changes.

Cost per event: one dict lookup and a call per expert; per evict pass, one draw. The experts' own
costs add up (``sae`` dominates).
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict

from sglang.srt.mem_cache.evict_policy import EvictionStrategy, LRUStrategy

from .baselines import GDSFStrategy, S3FIFOStrategy
from .context import block_key

EXPERTS = ("sae", "gdsf", "s3fifo", "lru")
LEARNING_RATE = 0.45
"""LeCaR's learning rate."""
WEIGHT_FLOOR = 0.02
"""Least weight an expert keeps (it can still be drawn, and so come back)."""
EXPLORE = 0.05
"""With ``greedy``: the share of passes that draw an expert by weight instead of taking the
heaviest (the others must evict now and then to be judged)."""
GHOST_CAPACITY = 32768
"""Evicted block keys remembered (each with its expert and eviction serial)."""


class AutoStrategy(EvictionStrategy):
    name = "auto"

    def __init__(self, experts: tuple[str, ...] = EXPERTS, learning_rate: float = LEARNING_RATE,
                 ghost_capacity: int = GHOST_CAPACITY, seed: int = 0,
                 greedy: bool = False) -> None:
        from .sae import SAEStrategy

        makers = {"sae": SAEStrategy, "gdsf": GDSFStrategy, "s3fifo": S3FIFOStrategy,
                  "lru": LRUStrategy}
        self.experts = {name: makers[name]() for name in experts}
        self.names = list(experts)
        self.weights = [1.0 / len(experts)] * len(experts)
        self.learning_rate = learning_rate
        self.greedy = greedy
        self.ghost: OrderedDict[tuple, tuple[int, int]] = OrderedDict()
        self.ghost_capacity = ghost_capacity
        self.half_life = ghost_capacity / 4
        self.evictions = 0
        self.rng = random.Random(seed)
        self.chosen = 0
        self.choices = [0] * len(experts)
        self.regrets = [0.0] * len(experts)
        self._learners = [s for s in self.experts.values() if hasattr(s, "on_evict")]
        self._now_fn = time.monotonic

    # ---- what the hooks and the simulator read --------------------------------------------

    @property
    def sample_size(self) -> int:
        """The chosen expert's leaf sample per pass (``sae`` samples; the others order all)."""
        return getattr(self.experts[self.names[self.chosen]], "sample_size", 0)

    @property
    def now_fn(self):
        return self._now_fn

    @now_fn.setter
    def now_fn(self, fn) -> None:
        self._now_fn = fn
        for s in self.experts.values():
            if hasattr(s, "now_fn"):
                s.now_fn = fn

    @property
    def evict_need(self):
        return None

    @evict_need.setter
    def evict_need(self, need) -> None:
        for s in self.experts.values():
            if hasattr(s, "evict_need"):
                s.evict_need = need

    def weight_of(self) -> dict[str, float]:
        return dict(zip(self.names, self.weights, strict=True))

    # ---- the policy -----------------------------------------------------------------------

    def get_priority(self, node):
        return self.experts[self.names[self.chosen]].get_priority(node)

    def begin_evict(self) -> None:
        if self.greedy and self.rng.random() >= EXPLORE:
            self.chosen = max(range(len(self.weights)), key=self.weights.__getitem__)
        else:
            self.chosen = self.rng.choices(range(len(self.names)), weights=self.weights)[0]
        self.choices[self.chosen] += 1
        for s in self.experts.values():
            if hasattr(s, "begin_evict"):
                s.begin_evict()

    def end_evict(self) -> None:
        for s in self.experts.values():
            if hasattr(s, "end_evict"):
                s.end_evict()

    def worth_host_copy(self, node, ctx=None, offset: int = 0) -> bool:
        """``sae``'s deferral of host copies, while ``sae`` is the likeliest expert."""
        sae = self.experts.get("sae")
        if sae is None or self.names[max(range(len(self.weights)),
                                         key=self.weights.__getitem__)] != "sae":
            return True
        return sae.worth_host_copy(node, ctx, offset)

    # ---- events -----------------------------------------------------------------------------

    def on_evict(self, node) -> None:
        self.evictions += 1
        key = block_key(node)
        self.ghost[key] = (self.chosen, self.evictions)
        self.ghost.move_to_end(key)
        if len(self.ghost) > self.ghost_capacity:
            self.ghost.popitem(last=False)
        for s in self._learners:
            s.on_evict(node)

    def on_demote(self, node) -> None:
        for s in self._learners:
            (getattr(s, "on_demote", None) or s.on_evict)(node)

    def on_insert(self, node, ctx, offset: int, is_new: bool) -> None:
        if is_new:
            blamed = self.ghost.pop(block_key(node), None)
            if blamed is not None:
                self._regret(*blamed)
        for s in self.experts.values():
            if hasattr(s, "on_insert"):
                s.on_insert(node, ctx, offset, is_new)

    def _regret(self, expert: int, serial: int) -> None:
        age = self.evictions - serial
        penalty = self.learning_rate * 0.5 ** (age / self.half_life)
        self.regrets[expert] += penalty
        self.weights[expert] *= math.exp(-penalty)
        total = sum(self.weights)
        weights = [max(w / total, WEIGHT_FLOOR) for w in self.weights]
        total = sum(weights)
        self.weights = [w / total for w in weights]

    def on_hit(self, node, tokens: int, ctx) -> None:
        for s in self.experts.values():
            if hasattr(s, "on_hit"):
                s.on_hit(node, tokens, ctx)

    def on_split(self, head, tail) -> None:
        for s in self.experts.values():
            if hasattr(s, "on_split"):
                s.on_split(head, tail)

    def on_match(self, nodes: list, ctx, tokens=None) -> None:
        for s in self.experts.values():
            if hasattr(s, "on_match"):
                s.on_match(nodes, ctx, tokens)

    def on_request(self, ctx, now: float) -> None:
        for s in self.experts.values():
            if hasattr(s, "on_request"):
                s.on_request(ctx, now)

    def dump_stats(self, path: str) -> None:
        sae = self.experts.get("sae")
        if sae is not None:
            sae.dump_stats(path)
