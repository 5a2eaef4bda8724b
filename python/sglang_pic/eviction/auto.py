"""``auto``: the eviction policy that follows whichever expert the traffic favours.

Why: no single policy wins everywhere. On replayed traces the best baseline changes with the
traffic and the cache size (``gdsf`` at small caches, ``s3fifo`` at large ones) and ``sae`` is
ahead where its session signals hold and behind where they do not; a user cannot know in advance
which to pick. ``auto`` measures it online.

* **Experts** (``EXPERTS``): ``sae``, ``gdsf``, ``s3fifo``, ``lru`` and ``tlru``. Every expert
  sees every event of the real cache (hits, inserts, splits, evictions), so each keeps its own
  state whoever evicts, and any of them can order the next evict pass.
* **Shadow caches** (``selection="shadow"``, the default; ``shadow.ShadowCache``): one
  token-only radix tree per expert, fed every request's prompt (a lookup) and every insert, each
  evicting with its expert alone down to the real cache's size. An expert's shadow hits are
  what that expert would have hit on its own on this traffic, whatever the real cache did.
* **Choice**: each expert's shadow hits, decayed with a half-life of ``HALF_LIFE`` requests; the
  real cache evicts with the expert whose decayed hits are highest, and changes expert only
  when another leads by ``SWITCH_MARGIN`` of the decayed prompt tokens (no flapping).
* ``selection="regret"``: the earlier design, LeCaR's (Vietri et al., HotStorage'18) weights
  from regrets on a ghost list of the real cache's evictions, one expert drawn per pass. Kept
  for the ablation (``auto-regret`` in the trace replay): mixing experts pass by pass lost to
  the best single baseline on a held-out trace.

Cost per request: one match and one insert per shadow (Python radix-tree walks over the
request's tokens), plus one call per expert per cache event.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict

from sglang.srt.mem_cache.evict_policy import LRUStrategy

from .baselines import GDSFStrategy, S3FIFOStrategy, TLRUStrategy
from .context import block_key
from .policy import CachePolicy, as_policy
from .shadow import ShadowCache

EXPERTS = ("sae", "gdsf", "s3fifo", "lru", "tlru")
HALF_LIFE = 1000
"""Requests after which an expert's shadow hits weigh half (``selection="shadow"``)."""
SWITCH_MARGIN = 0.005
"""Lead (a share of the decayed prompt tokens) another expert needs to take over."""
LEARNING_RATE = 0.45
"""LeCaR's learning rate."""
WEIGHT_FLOOR = 0.02
"""Least weight an expert keeps (it can still be drawn, and so come back)."""
EXPLORE = 0.05
"""With ``greedy``: the share of passes that draw an expert by weight instead of taking the
heaviest (the others must evict now and then to be judged)."""
GHOST_CAPACITY = 32768
"""Evicted block keys remembered (each with its expert and eviction serial)."""


class AutoStrategy(CachePolicy):
    name = "auto"

    def __init__(self, experts: tuple[str, ...] = EXPERTS, learning_rate: float = LEARNING_RATE,
                 ghost_capacity: int = GHOST_CAPACITY, seed: int = 0,
                 greedy: bool = False, selection: str = "shadow") -> None:
        from .sae import SAEStrategy

        makers = {"sae": SAEStrategy, "gdsf": GDSFStrategy, "s3fifo": S3FIFOStrategy,
                  "lru": LRUStrategy, "tlru": TLRUStrategy}
        if selection not in ("shadow", "regret"):
            raise ValueError(f"auto: selection {selection!r} is not shadow or regret")
        self.selection = selection
        self.shadows: list | None = None  # ShadowCache per expert, made at the first request
        self.shadow_hits = [0.0] * len(experts)  # decayed (HALF_LIFE)
        self.shadow_tokens = 0.0  # decayed prompt tokens looked up
        self.capacity = 0  # the real cache's size: the most tokens it has held
        self._decay = 0.5 ** (1.0 / HALF_LIFE)
        self.experts = {name: makers[name]() for name in experts}
        self.names = list(experts)
        # the experts as policies, in ``names``' order: the events go to these (SGLang's
        # ``lru`` through its adapter); ``get_priority`` is the expert's own
        self.policies = [as_policy(self.experts[name]) for name in self.names]
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
        self._now_fn = time.monotonic

    # ---- what the hooks and the simulator read --------------------------------------------

    @property
    def sample_size(self) -> int:
        """The chosen expert's leaf sample per pass (``sae`` samples; the others order all)."""
        return self.policies[self.chosen].sample_size

    @property
    def now_fn(self):
        return self._now_fn

    @now_fn.setter
    def now_fn(self, fn) -> None:
        self._now_fn = fn
        shadows = [as_policy(shadow.strategy) for shadow in self.shadows or ()]
        for s in [*self.policies, *shadows]:
            s.now_fn = fn

    @property
    def evict_need(self):
        return None

    @evict_need.setter
    def evict_need(self, need) -> None:
        for s in self.policies:
            s.evict_need = need

    def weight_of(self) -> dict[str, float]:
        return dict(zip(self.names, self.weights, strict=True))

    # ---- the policy -----------------------------------------------------------------------

    def get_priority(self, node):
        return self.experts[self.names[self.chosen]].get_priority(node)

    def begin_evict(self) -> None:
        if self.selection == "shadow":
            pass  # self.chosen follows the shadows (on_lookup)
        elif self.greedy and self.rng.random() >= EXPLORE:
            self.chosen = max(range(len(self.weights)), key=self.weights.__getitem__)
        else:
            self.chosen = self.rng.choices(range(len(self.names)), weights=self.weights)[0]
        self.choices[self.chosen] += 1
        for s in self.policies:
            s.begin_evict()

    def end_evict(self) -> None:
        for s in self.policies:
            s.end_evict()

    def _leader(self) -> str:
        """The expert the cache follows: the shadows' choice, or (``regret``) the heaviest."""
        if self.selection == "shadow":
            return self.names[self.chosen]
        return self.names[max(range(len(self.weights)), key=self.weights.__getitem__)]

    def worth_host_copy(self, node, ctx=None, offset: int = 0) -> bool:
        """``sae``'s deferral of host copies, while ``sae`` leads."""
        sae = self.experts.get("sae")
        if sae is None or self._leader() != "sae":
            return True
        return sae.worth_host_copy(node, ctx, offset)

    # ---- shadow caches (selection="shadow") ------------------------------------------------

    def _shadow_context(self, ctx):
        """A copy of ``ctx`` for the shadows' own hooks: the real cache's hooks mark a request
        reported and ``sae`` writes what it inferred into it."""
        from dataclasses import replace

        if ctx is None:
            return None
        return replace(ctx, announced=False, anchor=None, app_inferred=False,
                       app_type=None if ctx.app_inferred else ctx.app_type)

    def _ensure_shadows(self, page_size: int) -> list:
        if self.shadows is None:
            self.shadows = [ShadowCache(name, page_size) for name in self.names]
            self.now_fn = self._now_fn  # the experts' clock, the shadows' too
        return self.shadows

    def on_lookup(self, tokens, ctx, page_size: int) -> None:
        """A request's prompt: each shadow's hit, and the expert the real cache follows."""
        if self.selection != "shadow" or not len(tokens):
            return
        from .context import using

        shadows = self._ensure_shadows(page_size)
        d = self._decay
        self.shadow_tokens = self.shadow_tokens * d + len(tokens)
        with using(self._shadow_context(ctx)):
            for i, shadow in enumerate(shadows):
                self.shadow_hits[i] = self.shadow_hits[i] * d + shadow.lookup(tokens)
        best = max(range(len(shadows)), key=self.shadow_hits.__getitem__)
        lead = self.shadow_hits[best] - self.shadow_hits[self.chosen]
        if lead > SWITCH_MARGIN * self.shadow_tokens:
            self.chosen = best

    def on_store(self, tokens, ctx, page_size: int, used: int) -> None:
        """An insert into the real cache (``used``: its tokens after it): into every shadow,
        each evicting down to the real cache's size."""
        if self.selection != "shadow" or not len(tokens):
            return
        from .context import using

        self.capacity = max(self.capacity, used)
        with using(self._shadow_context(ctx)):
            for shadow in self._ensure_shadows(page_size):
                shadow.store(tokens, self.capacity)

    # ---- events -----------------------------------------------------------------------------

    def on_evict(self, node) -> None:
        if self.selection == "regret":  # the ghost list the regrets come from
            self.evictions += 1
            key = block_key(node)
            self.ghost[key] = (self.chosen, self.evictions)
            self.ghost.move_to_end(key)
            if len(self.ghost) > self.ghost_capacity:
                self.ghost.popitem(last=False)
        for s in self.policies:
            s.on_evict(node)

    def on_demote(self, node) -> None:
        for s in self.policies:
            s.on_demote(node)

    def on_insert(self, node, ctx, offset: int, is_new: bool) -> None:
        if is_new and self.selection == "regret":
            blamed = self.ghost.pop(block_key(node), None)
            if blamed is not None:
                self._regret(*blamed)
        for s in self.policies:
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
        for s in self.policies:
            s.on_hit(node, tokens, ctx)

    def on_split(self, head, tail) -> None:
        for s in self.policies:
            s.on_split(head, tail)

    def on_match(self, nodes: list, ctx, tokens=None) -> None:
        for s in self.policies:
            s.on_match(nodes, ctx, tokens)

    def on_request(self, ctx, now: float) -> None:
        for s in self.policies:
            s.on_request(ctx, now)

    def dump_stats(self, path: str) -> None:
        sae = self.experts.get("sae")
        if sae is not None:
            sae.dump_stats(path)
