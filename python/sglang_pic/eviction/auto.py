"""``auto``: the eviction policy that follows whichever expert the traffic favours.

Why: no single policy wins everywhere. On replayed traces the best baseline changes with the
traffic and the cache size (``gdsf`` at small caches, ``s3fifo`` at large ones) and ``sae`` is
ahead where its session signals hold and behind where they do not; a user cannot know in advance
which to pick. ``auto`` measures it online.

* **Experts** (``EXPERTS``): ``sae``, ``sae-conv`` (``sae`` inferring conversations from the
  prefix chain, ``VARIANTS``), ``gdsf``, ``s3fifo``, ``lru`` and ``tlru``. Every expert sees
  every event of the real cache (hits, inserts, splits, evictions), so each keeps its own
  state whoever evicts, and any of them can order the next evict pass. An expert that writes
  what it infers into a request's context reads a copy of its own (``_expert_context``), and
  each ``sae`` keeps its block state under its own node attribute (``block_attr``).
* **Shadow caches** (``selection="shadow"``, the default; ``shadow.ShadowCache``): one
  token-only radix tree per expert, fed every request's prompt (a lookup) and every insert,
  each caching as the real cache does (the prefix it holds locked, room made with its expert
  alone before the insert, down to the real cache's size). An expert's shadow hits are what
  that expert would have hit on its own on this traffic, whatever the real cache did (within
  1 % for ``sae``, whose leaf samples are random; exactly for the others).
* **Choice**: the real cache evicts with one expert, the leader. Another takes over when its
  lead in shadow hits over the leader, summed request by request with a half-life of
  ``HALF_LIFE`` requests, passes a paired test: more than ``CONFIDENCE`` times the root of the
  decayed sum of the squared per-request differences. Chance leads on a few requests do not
  move the cache; ``confidence=None`` is the earlier rule (a fixed margin of the prompt tokens,
  ``auto-margin`` in the replays).
* **Mirror** (``mirror=True``): an evict pass takes first what the leader's shadow no longer
  holds (drop marks on the real tree, ``shadow.mark_dropped``), then the rest in the leader's
  order, so after a change of leader the real cache converges on the new leader's own cache
  instead of keeping what the old one chose (``auto-nomirror`` in the replays).
* ``selection="regret"``: the earlier design, LeCaR's (Vietri et al., HotStorage'18) weights
  from regrets on a ghost list of the real cache's evictions, one expert drawn per pass. Kept
  for the ablation (``auto-regret`` in the trace replay): mixing experts pass by pass lost to
  the best single baseline on a held-out trace.

Cost per request: one match and one insert per shadow (Python radix-tree walks over the
request's tokens), a path walk of the real tree per insert and per shadow eviction (the drop
marks), plus one call per expert per cache event.
"""

from __future__ import annotations

import math
import random
import time
from collections import OrderedDict

from sglang.srt.mem_cache.evict_policy import LRUStrategy

from sglang_pic.launcher.server_flags import setting

from .baselines import TLRU_TUNED, GDSFStrategy, S3FIFOStrategy, TLRUStrategy
from .context import block_key
from .policy import CachePolicy, as_policy, configure
from .shadow import DROPS, ShadowCache, clear_path, mark_dropped

EXPERTS = ("sae", "sae-conv", "gdsf", "s3fifo", "lru", "tlru")
VARIANTS: dict[str, tuple[str, dict]] = {
    "sae-conv": ("sae", {"guess.infer_sessions": True, "block_attr": "sae_conv"})}
"""Experts that are another policy with some attributes set: name -> (policy, attributes).
``sae-conv`` infers conversations from the prefix chain of requests that carry no session
(``request_guess.RequestGuesser``): ahead of ``sae`` on multi-turn traffic without hints at
small caches, behind it on single-turn traffic and on the Mooncake conversation trace, so it
is an expert beside ``sae``, not ``sae``'s default."""
HALF_LIFE = 1000
"""Requests after which an expert's shadow hits weigh half (``selection="shadow"``)."""
SWITCH_MARGIN = 0.005
"""Lead (a share of the decayed prompt tokens) another expert needs to take over (with
``confidence=None``)."""
CONFIDENCE = 2.0
"""z of the paired test a change of leader must pass: another expert takes over when its
decayed lead in shadow hits over the leader, request by request, exceeds ``CONFIDENCE`` times
the root of the decayed sum of the squared per-request differences."""
LEARNING_RATE = 0.45
"""LeCaR's learning rate."""
WEIGHT_FLOOR = 0.02
"""Least weight an expert keeps (it can still be drawn, and so come back)."""
EXPLORE = 0.05
"""With ``greedy``: the share of passes that draw an expert by weight instead of taking the
heaviest (the others must evict now and then to be judged)."""
GHOST_CAPACITY = 32768
"""Evicted block keys remembered (each with its expert and eviction serial)."""


def expert_settings() -> dict[str, dict]:
    """Attributes of the experts that have settings, for the expert and its shadow alike:
    ``tlru`` takes ``--tlru-threshold`` / ``--tlru-next-prompt-estimate`` where they make it
    more than LRU (``auto`` has ``lru`` already), else ``baselines.TLRU_TUNED``."""
    threshold = setting("--tlru-threshold")
    estimate = setting("--tlru-next-prompt-estimate")
    if threshold > estimate:
        return {"tlru": {"threshold": threshold, "next_prompt_estimate": estimate}}
    return {"tlru": dict(TLRU_TUNED)}


class AutoStrategy(CachePolicy):
    name = "auto"

    def __init__(self, experts: tuple[str, ...] = EXPERTS, learning_rate: float = LEARNING_RATE,
                 ghost_capacity: int = GHOST_CAPACITY, seed: int = 0,
                 greedy: bool = False, selection: str = "shadow", mirror: bool = True,
                 confidence: float | None = CONFIDENCE) -> None:
        from .sae import SAEStrategy

        makers = {"sae": SAEStrategy, "gdsf": GDSFStrategy, "s3fifo": S3FIFOStrategy,
                  "lru": LRUStrategy, "tlru": TLRUStrategy}

        def make(name: str):
            policy, attrs = VARIANTS.get(name, (name, {}))
            expert = makers[policy](**self.settings.get(name, {}))
            configure(expert, attrs)
            return expert

        if selection not in ("shadow", "regret"):
            raise ValueError(f"auto: selection {selection!r} is not shadow or regret")
        self.selection = selection
        self.mirror = mirror
        self.shadows: list | None = None  # ShadowCache per expert, made at the first request
        self.shadow_hits = [0.0] * len(experts)  # decayed (HALF_LIFE)
        self.shadow_totals = [0] * len(experts)  # not decayed
        self.shadow_tokens = 0.0  # decayed prompt tokens looked up
        n = len(experts)
        # per pair (i, j), the decayed sum of the squared differences of their shadow hits per
        # request: with the difference of ``shadow_hits``, the paired test a change of leader
        # must pass
        self.lead_sq = [[0.0] * n for _ in range(n)]
        self.confidence = confidence
        self.capacity = 0  # the real cache's size: the most tokens it has held
        # a request's context, and its copies (``_context_copy``) by who reads them
        self._copies_of = None
        self._copies: dict[tuple, object] = {}
        self._decay = 0.5 ** (1.0 / HALF_LIFE)
        self.settings = expert_settings()
        self.experts = {name: make(name) for name in experts}
        self.names = list(experts)
        # experts that write what they infer into a request's context (``VARIANTS``): each
        # reads a copy of its own, in the real cache and in its shadow
        self.private = [name in VARIANTS for name in self.names]
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
        # each change of leader: (prompts looked up before it, the old leader, the new one)
        self.leader_changes: list[tuple[int, str, str]] = []
        self.lookups = 0
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
    def start(self) -> str:
        """The leader (an expert's name); set before the first request, the one ``auto``
        starts on: ``sae`` unless set (``auto-lru`` and ``auto-gdsf`` in the replays start on
        ``lru`` and ``gdsf``, and lose more where ``sae`` leads than they gain where it
        trails)."""
        return self.names[self.chosen]

    @start.setter
    def start(self, name: str) -> None:
        if name not in self.names:
            raise ValueError(f"auto: no expert {name!r}; its experts are "
                             f"{', '.join(self.names)}")
        self.chosen = self.names.index(name)

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
        priority = self.experts[self.names[self.chosen]].get_priority(node)
        if self.selection != "shadow" or not self.mirror:
            return priority
        # what the leader's shadow no longer holds goes first: the real cache converges on
        # the leader's own cache after a change of leader
        return (-((getattr(node, DROPS, 0) >> self.chosen) & 1), priority)

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

    def _leader(self) -> int:
        """The expert the cache follows (its index): the shadows' choice, or (``regret``) the
        heaviest."""
        if self.selection == "shadow":
            return self.chosen
        return max(range(len(self.weights)), key=self.weights.__getitem__)

    def worth_host_copy(self, node, ctx=None, offset: int = 0) -> bool:
        """The leader's answer: ``sae``'s deferral of host copies while ``sae`` (or a variant of
        it) leads, a copy every time under the others (``CachePolicy``'s default)."""
        i = self._leader()
        return self.policies[i].worth_host_copy(node, self._expert_context(ctx, i), offset)

    # ---- request contexts -------------------------------------------------------------------

    def _context_copy(self, ctx, key: tuple):
        """A copy of ``ctx`` for ``key``, one per request (its lookup, events and stores share
        it): the real cache's hooks mark a request reported and ``sae`` writes what it inferred
        into the context it is given, which no other reader may see."""
        from dataclasses import replace

        if ctx is None:
            return None
        if self._copies_of is not ctx:
            self._copies_of, self._copies = ctx, {}
        copy = self._copies.get(key)
        if copy is None:
            copy = self._copies[key] = replace(
                ctx, announced=False, anchor=None, app_inferred=False,
                app_type=None if ctx.app_inferred else ctx.app_type)
        return copy

    def _shadow_context(self, ctx, i: int):
        """Shadow ``i``'s context: the shadows' shared copy, or a private expert's own."""
        return self._context_copy(ctx, ("shadow", i if self.private[i] else -1))

    def _expert_context(self, ctx, i: int):
        """The context the real cache's expert ``i`` is given: the request's, or a private
        expert's own copy."""
        return self._context_copy(ctx, ("real", i)) if self.private[i] else ctx

    # ---- shadow caches (selection="shadow") ------------------------------------------------

    def _ensure_shadows(self, page_size: int) -> list:
        if self.shadows is None:
            self.shadows = []
            for name in self.names:
                policy, attrs = VARIANTS.get(name, (name, {}))
                shadow = ShadowCache(policy, page_size, self.settings.get(name, {}))
                configure(shadow.strategy, attrs)
                self.shadows.append(shadow)
            self.now_fn = self._now_fn  # the experts' clock, the shadows' too
        return self.shadows

    def on_lookup(self, tokens, ctx, page_size: int) -> None:
        """A request's prompt: each shadow's hit, and the expert the real cache follows."""
        for i, s in enumerate(self.policies):
            s.on_lookup(tokens, self._expert_context(ctx, i), page_size)
        if self.selection != "shadow" or not len(tokens):
            return
        from .context import using

        shadows = self._ensure_shadows(page_size)
        d = self._decay
        self.shadow_tokens = self.shadow_tokens * d + len(tokens)
        hits = []
        for i, shadow in enumerate(shadows):
            with using(self._shadow_context(ctx, i)):
                hits.append(shadow.lookup(tokens))
        for i, h in enumerate(hits):
            self.shadow_hits[i] = self.shadow_hits[i] * d + h
            self.shadow_totals[i] += h
        self.lookups += 1
        best = max(range(len(shadows)), key=self.shadow_hits.__getitem__)
        lead = self.shadow_hits[best] - self.shadow_hits[self.chosen]
        if self.confidence is None:
            if lead > SWITCH_MARGIN * self.shadow_tokens:
                self._lead(best)
            return
        for i, hi in enumerate(hits):
            for j, hj in enumerate(hits):
                self.lead_sq[i][j] = self.lead_sq[i][j] * d + (hi - hj) ** 2
        if lead > 0 and lead * lead > self.confidence ** 2 * self.lead_sq[best][self.chosen]:
            self._lead(best)

    def _lead(self, expert: int) -> None:
        """``expert`` orders the next evict passes (``leader_changes`` records the change)."""
        if expert != self.chosen:
            self.leader_changes.append((self.lookups, self.names[self.chosen],
                                        self.names[expert]))
            self.chosen = expert

    def on_store(self, tokens, ctx, page_size: int, used: int, root=None) -> None:
        """An insert into the real cache (``used``: its tokens after it; ``root``: its root
        node): to every expert (``s3fifo`` sizes its queues by it), and into every shadow, each
        evicting down to the real cache's size. What a shadow evicts is marked on the real tree
        (``shadow.mark_dropped``)."""
        for i, s in enumerate(self.policies):
            s.on_store(tokens, self._expert_context(ctx, i), page_size, used, root)
        if self.selection != "shadow" or not len(tokens):
            return
        from .context import using

        self.capacity = max(self.capacity, used)
        shadows = self._ensure_shadows(page_size)
        mirror = self.mirror and root is not None
        if mirror:  # every shadow holds what is inserted now
            clear_path(root, tokens, (1 << len(shadows)) - 1, page_size)
        for i, shadow in enumerate(shadows):
            with using(self._shadow_context(ctx, i)):
                dropped = shadow.store(tokens, self.capacity)
            if mirror:
                for node in dropped:
                    mark_dropped(root, node, 1 << i, page_size)

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
        for i, s in enumerate(self.policies):
            s.on_insert(node, self._expert_context(ctx, i), offset, is_new)

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
        for i, s in enumerate(self.policies):
            s.on_hit(node, tokens, self._expert_context(ctx, i))

    def on_split(self, head, tail) -> None:
        for s in self.policies:
            s.on_split(head, tail)

    def on_match(self, nodes: list, ctx, tokens=None) -> None:
        for i, s in enumerate(self.policies):
            s.on_match(nodes, self._expert_context(ctx, i), tokens)

    def on_request(self, ctx, now: float) -> None:
        for i, s in enumerate(self.policies):
            s.on_request(self._expert_context(ctx, i), now)

    def dump_stats(self, path: str) -> None:
        sae = self.experts.get("sae")
        if sae is not None:
            sae.dump_stats(path)
