"""``CachePolicy``: every event the radix cache reports to an eviction policy, declared once.

SGLang's eviction policies (``sglang.srt.mem_cache.evict_policy``) are pure priority functions:
``RadixCache.evict`` pops the evictable leaf with the lowest ``get_priority(node)``. Ours also
learn from what happens to blocks, which our hooks on SGLang's trees (``hooks``, also on
``HiRadixCache`` and our ``SpanRadixCache``) report as the events below. A policy overrides the
events it learns from; the defaults do nothing, so the hooks call every event on every policy
without asking first.

SGLang's own policies (``lru``, ``lfu``, ``fifo``, ...) are not ``CachePolicy``: a cache on one
takes no events (the hooks pass it straight to SGLang's code), and where ``auto`` runs one as an
expert ``as_policy`` wraps it in ``SGLangPolicy``, which forwards ``get_priority`` and ignores
the events. A cache's ``eviction_strategy`` stays the object SGLang built: SGLang calls
``get_priority`` on it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from sglang.srt.mem_cache.evict_policy import EvictionStrategy


class CachePolicy(EvictionStrategy):
    """An eviction policy that learns from the cache's events (no-op defaults).

    Attributes the hooks read or set:

    * ``sample_size``: leaves scored per evict pass (``hooks._sampled_evict``, with ``rng``
      drawing them); 0 lets SGLang score every evictable leaf, as it does by default.
    * ``rng``: the random source of those samples (read only with ``sample_size``).
    * ``evict_need``: set by the hooks at the start of an evict pass to the tokens it must free.
    * ``now_fn``: the clock ``on_request`` is given when the request context carries none
      (the trace replay sets a virtual one).
    * ``evict_depth``: nesting of evict passes (HiCache's device evict can write a block back,
      which can evict from the host tier); ``begin_evict`` / ``end_evict`` bracket the outermost.
    * ``records_offsets``: whether an insert marks each block on its path as seen with its
      token offset (``_pic_seen`` / ``_pic_offset``, read by ``context.block_offset`` and
      ``block_key``) before ``on_insert``; without it a block keeps the offset a split gave it,
      else 0. A split always moves the offsets of a block it cuts.
    """

    sample_size: int = 0
    rng: random.Random
    evict_need: int | None = None
    now_fn: Callable[[], float] = time.monotonic
    evict_depth: int = 0
    records_offsets: bool = True

    # ---- a request ------------------------------------------------------------------------

    def on_request(self, ctx: Any, now: float) -> None:
        """A request is cached for the first time (``RadixCache.insert``, once per request,
        after ``on_match``): ``ctx`` its ``RequestContext``, ``now`` its time (``ctx.now``,
        else ``now_fn()``)."""

    def on_lookup(self, tokens: Any, ctx: Any, page_size: int) -> None:
        """A request's prompt ``tokens`` as its own lookup: when the request is first cached
        (server), or after its match's ``on_hit`` calls (trace replay)."""

    def on_store(self, tokens: Any, ctx: Any, page_size: int, used: int,
                 root: Any = None) -> None:
        """After every insert into the cache: the inserted ``tokens``; ``used`` is the tokens
        the cache holds after it (evictable plus protected); ``root`` is the tree's root node."""

    # ---- blocks ---------------------------------------------------------------------------

    def on_match(self, nodes: list, ctx: Any, tokens: Any = None) -> None:
        """The match that admitted a request: ``nodes`` deepest first per path, ``tokens`` the
        matched key's ids. Server: when the request is first cached, before ``on_request``;
        trace replay: at the match, before its ``on_hit`` calls."""

    def on_hit(self, node: Any, tokens: int, ctx: Any) -> None:
        """``node`` (``tokens`` of it) was reused by the request of ``ctx``; once per node of the
        admitted match (a span prefill's own matches are not reuses and are not reported)."""

    def on_insert(self, node: Any, ctx: Any, offset: int, is_new: bool) -> None:
        """``node`` lies on a path just inserted, top-down: ``offset`` its first token's depth
        in the request, ``is_new`` whether no insert reported it before."""

    def on_split(self, head: Any, tail: Any) -> None:
        """SGLang cut a node in two where a new key diverged inside it: ``head`` the new upper
        part, ``tail`` the old node holding the rest (the policy re-derives what each holds)."""

    def on_evict(self, node: Any) -> None:
        """``node`` leaves the tree (device eviction, HiCache's host eviction, or a subtree
        dropped from both tiers)."""

    def on_demote(self, node: Any) -> None:
        """HiCache dropped ``node``'s device copy and kept it on the host tier. A policy that
        counts host-tier blocks as cached overrides this; by default it is an eviction."""
        self.on_evict(node)

    # ---- evict passes and host copies ----------------------------------------------------

    def begin_evict(self) -> None:
        """SGLang starts an evict pass (outermost of nested ones; ``evict_need`` is set right
        after): a policy reads its clock once per pass, not once per leaf."""

    def end_evict(self) -> None:
        """The evict pass ``begin_evict`` opened is over."""

    def worth_host_copy(self, node: Any, ctx: Any = None, offset: int = 0) -> bool:
        """HiCache's write-through would copy ``node`` (at token ``offset`` of its request) to
        the host tier: False skips the copy (SGLang asks again at the block's next insert)."""
        return True


class SGLangPolicy(CachePolicy):
    """One of SGLang's own policies seen as a ``CachePolicy``: its ``get_priority``, no events.
    Its inserted blocks are left unmarked (``records_offsets``): it reads no offsets."""

    records_offsets = False

    def __init__(self, strategy: EvictionStrategy) -> None:
        self.strategy = strategy

    def get_priority(self, node: Any) -> Any:
        return self.strategy.get_priority(node)


def as_policy(strategy: EvictionStrategy) -> CachePolicy:
    """``strategy`` as a ``CachePolicy``: ours as they are, SGLang's wrapped in a new
    ``SGLangPolicy`` (it keeps no state the events need, so no wrapper is kept)."""
    if isinstance(strategy, CachePolicy):
        return strategy
    return SGLangPolicy(strategy)


def configure(strategy: Any, attrs: dict) -> None:
    """Set attributes on a policy object (``"guess.infer_apps"``: the ``infer_apps`` of its
    ``guess``): the replays' variants (``replay.simulator.policy_spec``) and ``auto``'s experts
    that are another policy with some attributes set."""
    for name, value in attrs.items():
        *path, last = name.split(".")
        owner = strategy
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, last, value)
