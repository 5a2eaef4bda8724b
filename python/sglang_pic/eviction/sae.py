"""SAECache: semantic adaptive eviction for SGLang's radix cache (SAECache, arXiv:2605.18825).

Every cached block (radix-tree node) is routed to one of four queues by rules on what it holds,
and gets an *index*: the reuses per second it can be expected to earn while it stays cached.
The radix cache evicts the leaf with the lowest index first. Every queue's index is in that one
unit, so blocks of different queues compare directly:

| queue            | what                                                     | index (reuses / s)                        |
|------------------|----------------------------------------------------------|-------------------------------------------|
| ``evict_first``  | chain-of-thought, single-turn suffixes and outputs       | ``w_tau / (1 + w_tau * dt)``              |
| ``structural``   | system prompts / shared templates (hit by 2+ sessions)   | ``(1 - (o/o_max)^gamma) / max(I_b, dt)``  |
| ``chat``         | multi-turn chat session context                          | session index (log-normal gaps, ``q``)    |
| ``agent``        | agent session context (tool calls, growing context)      | session index (log-normal gaps, ``q``)    |

``dt``: seconds since the block was last used; ``I_b``: the EMA of the time between its uses.
A session's block that its latest request did not go through (a branch the session left) is
scored like an ``evict_first`` block of its kind (``SAEStrategy.abandoned``).
All ingredients adapt online from cache events the hooks report (``on_request``, ``on_insert``,
``on_hit``, ``on_evict``):

- ``w_tau``: per (token type, application type), hit tokens per resident token-second of the
  unshared blocks of that kind (``estimators.ClassRate``; see ``_in_w``), where an evicted
  block asked for again (a miss-after-eviction, seen through a ghost set) counts as the hit it
  would have been; decode tokens of a chat are resent next turn, those of a single-turn
  request never, so the same type learns different weights per application;
- session index (``estimators.SessionIndex``): from the session type's log-normal gap
  distribution, fitted by online MLE to observed inter-request gaps
  (``estimators.LogNormalGaps``), and ``q``, the chance that the session sends another request
  at all - the session predictor's output for the session's last request
  (``estimators.ContinuationModel``, learned online from which sessions came back), or with the
  predictor off (``--sae-predictor off``) the application's observed return rate (both kept by
  ``sessions.SessionModel``, the policy's ``sessions``);
- ``gamma``: fitted to how the hit rate falls with relative offset (``estimators.PositionDecay``).

The seed's ``P(b) = alpha_q * w_tau * p_q(b) / dt_b`` had per-queue weights ``alpha_q`` (a
softmax of hit tokens per resident token) to make queues comparable; with every index in
reuses per second they are not needed and would only skew the comparison;
``--sae-queue-weights on`` puts them back (the replay's ``sae-alpha`` variant compares both).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

from sglang_pic.launcher.server_flags import not_a_regular_file, setting

from .context import APP_TYPES, TOKEN_TYPES, RequestContext, block_key, block_offset
from .estimators import (
    ClassRate,
    InsertRate,
    PositionDecay,
    SessionIndex,
    softmax_weights,
)
from .policy import CachePolicy
from .request_guess import RequestGuesser
from .sessions import TRACKED_SESSIONS, SessionModel

logger = logging.getLogger(__name__)

QUEUES = ("evict_first", "structural", "chat", "agent")
# Priors for w_tau before any evidence: the probability that a block of this type is reused
# within a minute, as reuses per second.
TYPE_PRIORS = {t: p / 60.0 for t, p in {"system": 0.9, "tool": 0.5, "user": 0.5,
                                        "assistant": 0.5, "cot": 0.1, "decode": 0.2}.items()}
# shared blocks whose branches' reuse rates are tracked (``_rates``)
TRACKED_ANCHORS = 4096
# anchors numbered (``RequestGuesser.anchor_id``): more than the rates kept, so that a tracked
# rate's anchor keeps its number
TRACKED_ANCHOR_IDS = 4 * TRACKED_ANCHORS
# how many resident token-seconds the rate of its kind weighs as in a rate per anchor
ANCHOR_K = 10_000.0


def _in_w(info: BlockInfo) -> bool:
    """Whether the block counts in its kind's reuse rate ``w``: ``w`` scores the blocks outside
    the ``structural`` queue, so those in it stay out - but the reuse that makes a block shared
    counts (``on_hit``): without hints that is how a conversation's newest turn shows that the
    next turn reuses it. Without token types a single-turn template and its unique queries are
    both ``user``; counting every later hit of the template made the queries look reusable."""
    return info.queue != "structural"


def _rate_kind(info: BlockInfo) -> tuple[str, str, int | None]:
    """The kind whose reuse rate ``w`` scores the block: its token type, its application (a
    branch left apart: ``BlockInfo.left``) and the shared block its request branched off."""
    return (info.token_type, info.app_type + "/left" if info.left else info.app_type,
            info.anchor)


def _w_kind(info: BlockInfo) -> tuple | None:
    """The ``w`` count the block is in (None: none)."""
    return _rate_kind(info) if _in_w(info) else None


@dataclass(slots=True)
class BlockInfo:
    """What SAE stores on a radix-tree node (``node.sae``; ``SAEStrategy.block_attr``)."""

    token_type: str
    session_id: str | None
    app_type: str
    offset: int  # tokens from the root to the node's first token
    prompt_len: int  # o_max: length of the prompt that created it
    sessions_seen: int = 1  # distinct requesters (sessions, or requests outside any) in a row
    last_session: str | None = None  # the last requester
    ctx: RequestContext | None = None  # the creating request, to re-derive types on a split
    last_hit: float | None = None
    interval: float | None = None  # EMA of the time between this block's uses
    queue: str = "chat"  # kept equal to SAEStrategy.route(self)
    turn: int = 0  # its session's request count when one of them last went through the block
    key_start: int = 0  # where its key started in the creating request (a span segment's start)
    branches: int = 0  # blocks cached below it (requests that went on past it differently)
    # a block whose request's application was guessed (``RequestGuesser.infer_app``): the tail
    # of a block a request branched off inside (``on_split``), whose reuse rate is learnt apart
    left: bool = False
    # ... the shared block its request branched off (``RequestGuesser.infer_app``): its rate is
    # also learnt per anchor (``_rates``), by its number in ``RequestGuesser.anchor_ids``
    anchor: int | None = None


class SAEStrategy(CachePolicy):
    """``--radix-eviction-policy sae``; one instance per radix cache."""

    name = "sae"

    @property
    def block_attr(self) -> str:
        """The attribute of a tree node holding what this policy knows of the block
        (``BlockInfo``): ``sae``, or another name for a second instance on the same tree
        (``auto``'s ``sae-conv`` expert beside its ``sae``)."""
        return self.guess.block_attr

    @block_attr.setter
    def block_attr(self, name: str) -> None:
        self.guess.block_attr = name

    def __init__(self, ghost_capacity: int = 65536, sample_size: int | None = None,
                 temperature: float = 2.0) -> None:
        # the knobs (--sae-*) are read when the policy is built, in the scheduler process
        self.w = {(t, a + left): ClassRate(TYPE_PRIORS[t])
                  for t in TOKEN_TYPES for a in APP_TYPES for left in ("", "/left")}
        self.position = PositionDecay()
        self.session_index = SessionIndex()
        self.resident = dict.fromkeys(QUEUES, 0)
        # the seed's per-queue weights alpha_q (off by default, see the module docstring):
        # softmax over queues of log(1 + hit tokens / resident tokens), with a temperature
        self.queue_weights = setting("--sae-queue-weights")
        self.temperature = temperature
        self.queue_hits = dict.fromkeys(QUEUES, 0.0)
        self.alpha = dict.fromkeys(QUEUES, 1.0)
        # when sessions come back and how likely they are to (``sessions.SessionModel``); q of
        # the session index from the predictor (per session) or, off, per application
        self.sessions = SessionModel(setting("--sae-predictor"))
        # what requests without hints did not say: their conversation (off by default) and
        # their application, guessed from their match (``on_match``)
        self.guess = RequestGuesser(TRACKED_SESSIONS, TRACKED_ANCHOR_IDS)
        # worth_host_copy defers HiCache write-through copies of evict_first blocks (an
        # attribute for the two-tier replay's ablation, sae-copy-all)
        self.defer_host_copies = True
        # the reuse rates per kind and anchor (``_rates``), least recently used first
        self.anchor_w: OrderedDict[tuple, ClassRate] = OrderedDict()
        # a JSON file the counters are written to after every evict pass (inspection, tests)
        self.stats_path = setting("--sae-stats")
        # evicted blocks: block_key -> (w kind, tokens, conversation or None, depth of its end,
        # whether it was a template: ``on_evict``)
        self.ghost: OrderedDict[tuple, tuple[tuple[str, str] | None, int, str | None, int,
                                             bool]] = OrderedDict()
        self.ghost_capacity = ghost_capacity
        self.now_fn = time.monotonic
        self.events = defaultdict(int)
        # leaves scored per evict pass (hooks._sampled_evict); 0 scores all, as SGLang does
        self.sample_size = setting("--sae-sample") if sample_size is None else sample_size
        self.rng = random.Random(0)
        # get_priority runs for every evictable leaf on every evict call (SGLang rebuilds its
        # heap each time), so the index of a session or class is computed once per clock
        # reading, not once per leaf.
        self._memo_now: float | None = None
        self._pass_now: float | None = None
        self._memo: dict[tuple, float] = {}
        # the tokens the current evict pass must free (set by the hooks; None: not told) and
        # how fast new blocks fill freed room (``surplus_value``)
        self.evict_need: int | None = None
        self.inflow = InsertRate()
        if self.stats_path:
            self._time_callbacks()

    # ---- where the time goes (with --sae-stats only) -------------------------------------
    TIMED = ("get_priority", "on_request", "on_insert", "on_split", "on_hit", "on_evict")

    def _time_callbacks(self) -> None:
        """Wrap this instance's callbacks in timers (instance attributes shadow the methods, so
        a strategy without a stats file runs untimed) and time whole evict passes."""
        self.seconds = defaultdict(float)  # callback -> seconds spent in it
        self.evict_passes = 0
        self.evict_seconds = 0.0
        self.evict_max_seconds = 0.0
        self._pass_t0 = 0.0
        clock = time.perf_counter
        for name in self.TIMED:
            method = getattr(self, name)

            def timed(*args, _method=method, _name=name):
                t0 = clock()
                try:
                    return _method(*args)
                finally:
                    self.seconds[_name] += clock() - t0

            setattr(self, name, timed)

    # ---- scoring -------------------------------------------------------------------------
    def route(self, info: BlockInfo) -> str:
        if info.token_type == "cot":
            return "evict_first"
        if info.token_type == "system" or info.sessions_seen >= 2:
            return "structural"
        if info.app_type == "single":
            return "evict_first"
        return "agent" if info.app_type == "agent" else "chat"

    def index(self, queue: str, info: BlockInfo, dt: float, now: float) -> float:
        """Expected reuses per second of a block of ``queue`` unused for ``dt`` seconds."""
        if self.session_scored(queue, info):
            sessions = self.sessions
            q = sessions.continuation_odds(info.app_type, info.session_id)
            return self.session_index.value(sessions.gaps[info.app_type], q,
                                            sessions.silence(info.session_id, now))
        if queue == "structural":
            scale = dt if info.interval is None else max(info.interval, dt)
            return self.position.value(info.offset / max(info.prompt_len, 1)) / scale
        w = self._rate_value(_rate_kind(info))
        return w / (1.0 + w * dt)  # the kind's rate, older blocks of it first

    def _rates(self, kind: tuple) -> list[ClassRate]:
        """The counts a block of ``kind`` is in: its kind's, and with an anchor (the shared
        block its request branched off) the anchor's.

        Without hints a single-turn query and a conversation's first turn are both requests
        that branched off a shared block (a template, a system prompt), guessed ``single``;
        one rate for both would keep the queries as long as the first turns, and templates
        would go before them. The block they branched off is
        what tells them apart (a template's queries are never asked for again, a system
        prompt's first turns are), so the branches of each learn their own rate."""
        rate = self.w[kind[:2]]
        if kind[2] is None or not ANCHOR_K:
            return [rate]
        anchored = self.anchor_w.get(kind)
        if anchored is None:
            anchored = self.anchor_w[kind] = ClassRate(0.0, k=0.0)
            if len(self.anchor_w) > TRACKED_ANCHORS:
                self.anchor_w.popitem(last=False)
        else:
            self.anchor_w.move_to_end(kind)
        return [rate, anchored]

    def _rate_value(self, kind: tuple) -> float:
        """``w`` of ``kind``: with an anchor, the anchor's branches' own rate, weighing the
        kind's as ``ANCHOR_K`` token-seconds."""
        w = self.w[kind[:2]].value()
        if kind[2] is None or not ANCHOR_K:
            return w
        anchored = self.anchor_w.get(kind)
        if anchored is None:
            return w
        return (anchored.hits + ANCHOR_K * w) / (anchored.token_seconds + ANCHOR_K)

    def session_scored(self, queue: str, info: BlockInfo) -> bool:
        """Whether the block gets its session's index (shared by all the session's blocks)."""
        return queue in ("chat", "agent") and bool(info.session_id) and not self.abandoned(info)

    def abandoned(self, info: BlockInfo) -> bool:
        """The session's latest request did not go through the block: a branch it left.

        A conversation resends its own history, so the blocks of its next prompt are those on
        the path of its latest request; a block of the session off that path is one the session
        moved past - a chain-of-thought the next turn dropped, an answer it regenerated - and
        is scored like an ``evict_first`` block of its kind, not with the session's index. This
        needs no token types: without a chat template an agent's reasoning is typed ``decode``,
        like the tool call the next step resends. The session's count moves when its next
        request is first cached (``on_request``), so the eviction pass that makes room for that
        request still sees the branch as the session's."""
        return info.turn < self.sessions.turns(info.session_id)

    def worth_host_copy(self, node, ctx: RequestContext | None = None, offset: int = 0) -> bool:
        """Whether HiCache's write-through copies this block to the host tier now.

        A block of the ``evict_first`` queue - a chain-of-thought, a single-turn request's own
        tokens - is the first the device tier gives up and the least likely to be asked for
        again: copying it spends PCIe bandwidth and host room that the host tier's eviction
        then has to win back. It gets no copy until it is reused (a hit, ``on_hit``): SGLang
        asks again at every insert through the block (``HiRadixCache._inc_hit_count``), and a
        request that matched it reports the hit before its insert. A reused block is copied
        whatever its queue: write-through keeps the host copies a prefix of the tree, so a
        block without one also holds back every block below it. The rule reads the block's
        queue and whether it was hit, which follow the request stream alone, so the
        tensor-parallel ranks' caches decide alike (no clock or learned rate in it). A block
        whose request's application was guessed (``RequestGuesser.infer_app``) is not held
        back. SGLang writes a new block inside ``insert``, before ``on_insert`` has typed it:
        then the inserting request's context ``ctx`` and the block's depth ``offset`` say what
        it is."""
        if not self.defer_host_copies:
            return True
        info: BlockInfo | None = getattr(node, self.block_attr, None)
        if info is None and ctx is not None:
            self.guess.resolve(ctx)  # SGLang writes inside insert, before ``on_insert`` resolves it
            info = self._new_info(ctx, offset, len(node.key))
        if info is None or info.queue != "evict_first" or info.last_hit is not None:
            return True
        if info.token_type != "cot" and info.ctx is not None and info.ctx.app_inferred:
            # a guessed single-turn request is a conversation's first turn as often (the guess
            # only says it branched off a shared block): without a copy its blocks, and the
            # conversation's later turns below them, would stay off the host tier
            return True
        self.events["host_writes_deferred"] += 1
        return False

    def begin_evict(self) -> None:
        """Called by the hooks when SGLang starts an evict pass: one clock reading per pass."""
        self._pass_now = self.now_fn()
        if self.stats_path:
            self._pass_t0 = time.perf_counter()

    def end_evict(self) -> None:
        self._pass_now = None
        self.evict_need = None
        if self.stats_path:
            took = time.perf_counter() - self._pass_t0
            self.evict_passes += 1
            self.evict_seconds += took
            self.evict_max_seconds = max(self.evict_max_seconds, took)
            self.dump_stats(self.stats_path)

    def dump_stats(self, path: str) -> None:
        """Write the event counters, per-queue resident tokens and (with timers on) where the
        policy's time went, next to the scheduler's steps, as JSON (atomically)."""
        from .hooks import SCHEDULER_STEPS

        stats = {"events": dict(self.events), "resident": dict(self.resident)}
        if hasattr(self, "seconds"):
            stats["seconds"] = dict(self.seconds)
            stats["evict"] = {"passes": self.evict_passes, "seconds": self.evict_seconds,
                              "max_seconds": self.evict_max_seconds}
            stats["scheduler"] = dict(SCHEDULER_STEPS)
        tmp = f"{path}.tmp"
        if not_a_regular_file(path):
            logger.warning("SGLANG_PIC_SAE_STATS: %s is not a regular file; stats off", path)
            self.stats_path = None
            return
        try:
            with open(tmp, "w") as f:
                json.dump(stats, f)
            os.replace(tmp, path)
        except OSError as e:  # a bad path must not take the scheduler down mid-eviction
            logger.warning("SGLANG_PIC_SAE_STATS: cannot write %s (%s); stats off", path, e)
            self.stats_path = None

    def get_priority(self, node) -> float:
        info: BlockInfo | None = getattr(node, self.block_attr, None)
        now = self._pass_now
        if now is None:
            now = self.now_fn()
        dt = now - node.last_access_time
        if dt < 1e-3:
            dt = 1e-3
        if info is None:  # created outside any request context (e.g. HiCache load): plain LRU
            return 1.0 / dt
        if now != self._memo_now:
            self._memo_now, self._memo = now, {}
        queue = info.queue
        if self.session_scored(queue, info):
            key = (info.app_type, info.session_id)  # every block of a session shares its index
            value = self._memo.get(key)
            if value is None:
                value = self._memo[key] = self.index(queue, info, dt, now)
        else:
            value = self.index(queue, info, dt, now)
        need = self.evict_need
        if need and len(node.key) > need:
            value = self.surplus_value(value, len(node.key) - need, now)
        return value * self.alpha[queue] if self.queue_weights else value

    def surplus_value(self, value: float, surplus: int, now: float) -> float:
        """The index of a leaf whose eviction would free ``surplus`` tokens more than the pass
        needs.

        SGLang evicts whole nodes: a large leaf - the whole history a request re-sent after
        its own was evicted is cached as one node - frees far more than the few tokens a pass
        asks for, and the surplus sits unused until new blocks fill it, ``surplus / inflow``
        seconds at the recent rate of new tokens. A leaf expected back within that time
        (``value * wait >= 1`` reuses) would be evicted for room no one needs yet: the reuses
        it earns while the surplus would wait count on top of its own index. Below one
        expected reuse the index is left alone (a near-tie broken differently moves a replay
        by more than such a correction is worth)."""
        inflow = self.inflow.value(now)
        if inflow <= 0:
            return value
        expected = value * surplus / inflow
        return value * (1.0 + expected) if expected >= 1.0 else value

    # ---- learning from events -------------------------------------------------------------
    def on_match(self, nodes: list, ctx: RequestContext, tokens=None) -> None:
        """What the request did not say, guessed from its match before its other events
        (``request_guess.RequestGuesser.on_match``)."""
        self.guess.on_match(nodes, ctx, tokens, self.ghost)

    def on_request(self, ctx: RequestContext, now: float) -> None:
        self.guess.resolve(ctx)
        if ctx.session_id is None:
            return
        self.sessions.observe(ctx, now, ctx.session_id in self.guess.conv_depth)

    def _now(self, ctx: RequestContext | None = None) -> float:
        if ctx is not None and ctx.now is not None:
            return ctx.now
        return self._pass_now if self._pass_now is not None else self.now_fn()

    def _seen_by(self, node, info: BlockInfo, requester: str) -> None:
        """Another session, or another request outside any session, used the block: it may have
        become shared (structural)."""
        if requester == info.last_session:
            return
        info.sessions_seen += 1
        info.last_session = requester
        queue = self.route(info)
        if queue != info.queue:
            self.resident[info.queue] = max(self.resident[info.queue] - len(node.key), 0)
            self.resident[queue] += len(node.key)
            before = _w_kind(info)
            info.queue = queue
            self._recount(len(node.key), before, info)

    def _adopt(self, node, info: BlockInfo, ctx: RequestContext) -> None:
        """The first request to use a block a span prefill cached for it: the block is its own,
        as if it had cached it (its requester, session and application)."""
        kind, queue = _w_kind(info), info.queue
        info.session_id = ctx.session_id
        info.app_type = ctx.app_type or info.app_type
        info.turn = self.sessions.turns(ctx.session_id)
        info.sessions_seen, info.last_session = 1, ctx.requester
        info.queue = self.route(info)
        if info.queue != queue:
            self.resident[queue] = max(self.resident[queue] - len(node.key), 0)
            self.resident[info.queue] += len(node.key)
        self._recount(len(node.key), kind, info)

    def _recount(self, tokens: int, before: tuple[str, str] | None, after: BlockInfo) -> None:
        """Move ``tokens`` of a block from the ``w`` count of kind ``before`` (None: it was in
        none) to the one ``after`` puts it in: a block that became shared, a split tail
        re-typed."""
        kind = _w_kind(after)
        if kind == before:
            return  # the same count (most splits), or none before and after
        now = self._now()
        if before is not None:
            for r in self._rates(before):
                r.remove(tokens, now)
        if kind is not None:
            for r in self._rates(kind):
                r.add(tokens, now, block=False)

    def on_insert(self, node, ctx: RequestContext, offset: int, is_new: bool) -> None:
        self.guess.resolve(ctx)
        if not is_new:
            info = getattr(node, self.block_attr, None)
            if info is not None and info.sessions_seen == 0 and not ctx.on_behalf:
                self._adopt(node, info, ctx)
            elif info is not None and not ctx.on_behalf:  # a span prefill uses it for others
                self._seen_by(node, info, ctx.requester)
                if ctx.session_id is not None and ctx.session_id == info.session_id:
                    info.turn = self.sessions.turns(ctx.session_id)
            return
        self.events["inserts"] += 1
        now = self._now(ctx)
        self.inflow.add(len(node.key), now)
        info = self._new_info(ctx, offset, len(node.key))
        setattr(node, self.block_attr, info)
        ghost = self.ghost.pop(block_key(node), None)
        if ghost is not None and ghost[4] and not ctx.on_behalf:
            # a template asked for again (shared, and requests branched after it): it is shared
            # still; without token types its blocks would otherwise start over among the unique
            # queries' blocks
            info.sessions_seen = 2
            info.queue = self.route(info)
        parent = getattr(node.parent, self.block_attr, None)
        if parent is not None:
            parent.branches += 1
        if _in_w(info):
            for r in self._rates(_rate_kind(info)):
                r.add(len(node.key), now)
        self.resident[info.queue] += len(node.key)
        if ghost is not None:  # asked for again after we evicted it: a mistake
            kind, tokens = ghost[:2]
            if kind is not None:
                for r in self._rates(kind):
                    r.hit(tokens, now)
            self.events["miss_after_eviction"] += 1

    def _new_info(self, ctx: RequestContext, offset: int, tokens: int) -> BlockInfo:
        """What a block of ``tokens`` tokens that ``ctx`` caches ``offset`` tokens deep in its
        tree is, routed to its queue."""
        # ``offset`` is the block's depth in its tree (a span segment's tree starts at the
        # segment); its token type is that of where it sits in the request
        ttype = ctx.token_type_at(ctx.key_start + offset)
        # a span prefill caches blocks for the requests waiting on it: no requester yet
        seen, requester = (0, None) if ctx.on_behalf else (1, ctx.requester)
        info = BlockInfo(ttype, ctx.session_id, ctx.app_type or "chat", offset,
                         max(ctx.prompt_len, offset + tokens), seen, requester, ctx,
                         turn=self.sessions.turns(ctx.session_id), key_start=ctx.key_start,
                         anchor=ctx.anchor if ctx.app_inferred else None)
        info.queue = self.route(info)
        return info

    def on_split(self, head, tail) -> None:
        """SGLang split ``tail`` into ``head`` (its first part, a new node) + ``tail``."""
        info: BlockInfo | None = getattr(tail, self.block_attr, None)
        if info is None:
            return
        setattr(head, self.block_attr, BlockInfo(
            info.token_type, info.session_id, info.app_type, info.offset, info.prompt_len,
            info.sessions_seen, info.last_session, info.ctx, info.last_hit, info.interval,
            info.queue, info.turn, info.key_start, branches=1, left=info.left,
            anchor=info.anchor))  # the tail below it
        old_queue = info.queue
        info.offset = block_offset(tail)  # the hooks move offsets on a split
        if info.ctx is not None and info.ctx.app_inferred:
            # a request branched off inside the block: the tail is a branch it left (a
            # single-turn query after its template, the reasoning an agent's next step
            # dropped); with no session to say so (``abandoned``) it learns its own rate
            info.left = True
        if info.ctx is not None:
            info.token_type = info.ctx.token_type_at(info.key_start + info.offset)
        info.queue = self.route(info)
        self.resident[old_queue] -= len(tail.key) + len(head.key)
        before = getattr(head, self.block_attr)  # the tail's info before the split
        self.resident[before.queue] += len(head.key)
        self.resident[info.queue] += len(tail.key)
        self._recount(len(tail.key), _w_kind(before), info)

    def on_hit(self, node, tokens: int, ctx: RequestContext | None) -> None:
        info: BlockInfo | None = getattr(node, self.block_attr, None)
        if info is None:
            return
        self.guess.resolve(ctx)
        if info.sessions_seen == 0 and ctx is not None:
            # cached by a span prefill for the requests waiting on it: the first of them is
            # the request it was made for, not a reuse
            if not ctx.on_behalf:
                self._adopt(node, info, ctx)
            return
        kind = _w_kind(info)  # the reuse that makes a block shared is one of an unshared block
        if ctx is not None:
            self._seen_by(node, info, ctx.requester)
        now = self._now(ctx)
        if info.last_hit is not None:
            gap = max(now - info.last_hit, 1e-3)
            info.interval = gap if info.interval is None else 0.7 * info.interval + 0.3 * gap
        info.last_hit = now
        if kind is not None:
            for r in self._rates(kind):
                r.hit(tokens, now)
        self.queue_hits[info.queue] += tokens
        self.position.observe(info.offset / max(info.prompt_len, 1), True)
        self.events["hits"] += 1

    def on_evict(self, node) -> None:
        info: BlockInfo | None = getattr(node, self.block_attr, None)
        if info is None:
            return
        self.resident[info.queue] = max(self.resident[info.queue] - len(node.key), 0)
        kind = _w_kind(info)
        if kind is not None:
            now = self._now()
            for r in self._rates(kind):
                r.remove(len(node.key), now)
        self.position.observe(info.offset / max(info.prompt_len, 1), False)
        # asked for again later, a block counted in w is a hit its kind missed
        # (a block of one conversation remembers it: its next request, finding the block
        # evicted, is still recognised as that conversation's - ``on_match``)
        conv = info.session_id if info.queue != "structural" else None
        # a template: 2+ requesters, and requests branched after it (a conversation's history
        # is shared by its turns too, but each turn continues the last one's path)
        template = info.sessions_seen >= 2 and info.branches >= 2
        self.ghost[block_key(node)] = (kind, len(node.key), conv, info.offset + len(node.key),
                                       template)
        if len(self.ghost) > self.ghost_capacity:
            self.ghost.popitem(last=False)
        self.events["evictions"] += 1
        if self.queue_weights and self.events["evictions"] % 64 == 0:
            self._refresh_alpha()

    def on_demote(self, node) -> None:
        """HiCache dropped the block's device copy and kept it on the host tier: it is still
        cached - a later match of it is a hit (``hooks._matched_nodes``), and it is evicted
        when the host tier evicts it (``hooks.around_evict_host``)."""
        self.events["demotions"] += 1

    def _refresh_alpha(self) -> None:
        scores = {}
        for q in QUEUES:
            scores[q] = math.log1p(self.queue_hits[q] / max(self.resident[q], 1))
            self.queue_hits[q] *= 0.9  # forget slowly, so alpha follows workload shifts
        self.alpha = softmax_weights(scores, self.temperature)
