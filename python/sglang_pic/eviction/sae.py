"""SAECache: semantic adaptive eviction for SGLang's radix cache (seed 002).

Every cached block (radix-tree node) is routed to one of four queues by rules on what it holds:

| queue            | what                                                     | p_q(b)                      |
|------------------|----------------------------------------------------------|-----------------------------|
| ``evict_first``  | chain-of-thought, single-turn suffixes and outputs       | 1                           |
| ``structural``   | system prompts / shared templates (hit by 2+ sessions)   | ``1 - (o_b / o_max)^gamma`` |
| ``chat``         | multi-turn chat session context                          | log-normal survival         |
| ``agent``        | agent session context (tool calls, growing context)      | log-normal survival         |

and scored ``P(b) = alpha_q * w_tau(b) * p_q(b) / dt_b`` (``dt_b``: seconds since the block was
last used); the radix cache evicts the leaf with the lowest score first. All four ingredients
adapt online from cache events the hooks report (``on_insert``, ``on_hit``, ``on_evict``):

- ``w_tau``: per (token type, application type), reuses per cached block
  (``estimators.ReuseRate``), where an evicted block asked for again (a miss-after-eviction,
  seen through a ghost set) counts as the hit it would have been; decode tokens of a chat are
  resent next turn, those of a single-turn request never, so the same type learns different
  weights per application;
- survival: per session type, a log-normal fitted by online MLE to observed inter-request gaps
  (``estimators.LogNormalGaps``), evaluated at the time since the session's last request;
  optionally (``SGLANG_PIC_SAE_PREDICTOR=1``) times the session predictor's chance that the
  session sends another request at all (``estimators.ContinuationModel``, learned online from
  which sessions came back; off by default, see docs/eviction.md);
- ``gamma``: fitted to how the hit rate falls with relative offset (``estimators.PositionDecay``);
- ``alpha_q``: softmax over queues of hit tokens per resident token, with a temperature.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from .context import APP_TYPES, TOKEN_TYPES, RequestContext, block_key, block_offset
from .estimators import (
    ContinuationModel,
    Ema,
    LogNormalGaps,
    PositionDecay,
    ReuseRate,
    softmax_weights,
)

QUEUES = ("evict_first", "structural", "chat", "agent")
# Leaves scored per evict pass (hooks._sampled_evict); 0 scores all of them, as SGLang does.
SAMPLE_SIZE = int(os.environ.get("SGLANG_PIC_SAE_SAMPLE", "1024"))
# Priors for w_tau before any evidence (probability that a block of this type is reused).
TYPE_PRIORS = {"system": 0.9, "tool": 0.5, "user": 0.5, "assistant": 0.5, "cot": 0.1,
               "decode": 0.2}
# Priors for the session-gap log-normals: chat users think for ~a minute, agents call back fast.
GAP_PRIORS = {"chat": (math.log(60.0), 1.2), "agent": (math.log(5.0), 1.2),
              "single": (math.log(600.0), 1.5)}
# A session with no request for this quantile of its application's gaps has ended (label 0 for
# the session predictor).
END_QUANTILE = 0.99
TRACKED_SESSIONS = 1 << 17


@dataclass(slots=True)
class BlockInfo:
    """What SAE stores on a radix-tree node (``node.sae``)."""

    token_type: str
    session_id: str | None
    app_type: str
    offset: int  # tokens from the root to the node's first token
    prompt_len: int  # o_max: length of the prompt that created it
    sessions_seen: int = 1
    last_session: str | None = None
    ctx: RequestContext | None = None  # the creating request, to re-derive types on a split
    last_hit: float | None = None
    interval: float | None = None  # EMA of the time between this block's uses
    queue: str = "chat"  # kept equal to SAEStrategy.route(self)


class SAEStrategy(EvictionStrategy):
    """``--radix-eviction-policy sae``; one instance per radix cache."""

    name = "sae"

    def __init__(self, temperature: float = 2.0, ghost_capacity: int = 65536,
                 sample_size: int = SAMPLE_SIZE) -> None:
        self.w = {(t, a): ReuseRate(TYPE_PRIORS[t]) for t in TOKEN_TYPES for a in APP_TYPES}
        self.gaps = {a: LogNormalGaps(*GAP_PRIORS[a]) for a in APP_TYPES}
        self.position = PositionDecay()
        self.temperature = temperature
        self.hit_tokens = {q: Ema(1.0, rate=0.02) for q in QUEUES}
        self.resident = dict.fromkeys(QUEUES, 0)
        self.alpha = dict.fromkeys(QUEUES, 1.0)
        self.session_last: OrderedDict[str, float] = OrderedDict()
        self.continuation = ContinuationModel()
        # per application type (each has its own silence cutoff): session -> (features of its
        # last request, its time), oldest first
        self.pending: dict[str, OrderedDict[str, tuple[list[float], float]]] = {
            a: OrderedDict() for a in APP_TYPES}
        self.session_p: dict[str, float] = {}  # P(another request) after the last one
        # Scale chat/agent survival by the predictor? Off by default: measured on the replay it
        # costs up to 2.6 pp on mixed traffic (docs/eviction.md); it keeps learning either way.
        self.use_predictor = os.environ.get("SGLANG_PIC_SAE_PREDICTOR", "0") == "1"
        # a JSON file the counters are written to after every evict pass (inspection, tests)
        self.stats_path = os.environ.get("SGLANG_PIC_SAE_STATS")
        self.ghost: OrderedDict[tuple, tuple[str, str]] = OrderedDict()
        self.ghost_capacity = ghost_capacity
        self.now_fn = time.monotonic
        self.events = defaultdict(int)
        self.sample_size = sample_size  # evict passes look at this many leaves (0 = all)
        self.rng = random.Random(0)
        # get_priority runs for every evictable leaf on every evict call (SGLang rebuilds its
        # heap each time), so the per-class factor alpha * w * p is computed once per class
        # and clock reading, not once per leaf.
        self._memo_now: float | None = None
        self._pass_now: float | None = None
        self._memo: dict[tuple, float] = {}

    # ---- scoring -------------------------------------------------------------------------
    def route(self, info: BlockInfo) -> str:
        if info.token_type == "cot":
            return "evict_first"
        if info.token_type == "system" or info.sessions_seen >= 2:
            return "structural"
        if info.app_type == "single":
            return "evict_first"
        return "agent" if info.app_type == "agent" else "chat"

    def p_queue(self, queue: str, info: BlockInfo, now: float) -> float:
        if queue == "structural":
            return self.position.value(info.offset / max(info.prompt_len, 1))
        if queue in ("chat", "agent"):
            if not info.session_id:
                return 1.0
            last = self.session_last.get(info.session_id, now)
            p = self.session_p.get(info.session_id, 1.0) if self.use_predictor else 1.0
            return max(p * self.gaps[info.app_type].survival(now - last), 1e-4)
        return 1.0

    def begin_evict(self) -> None:
        """Called by the hooks when SGLang starts an evict pass: one clock reading per pass."""
        self._pass_now = self.now_fn()

    def end_evict(self) -> None:
        self._pass_now = None
        if self.stats_path:
            self.dump_stats(self.stats_path)

    def dump_stats(self, path: str) -> None:
        """Write the event counters and per-queue resident tokens as JSON (atomically)."""
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"events": dict(self.events), "resident": dict(self.resident),
                       "alpha": dict(self.alpha)}, f)
        os.replace(tmp, path)

    def get_priority(self, node) -> float:
        info: BlockInfo | None = getattr(node, "sae", None)
        now = self._pass_now
        if now is None:
            now = self.now_fn()
        dt = now - node.last_access_time
        if dt < 1e-3:
            dt = 1e-3
        if info is None:  # created outside any request context (e.g. HiCache load): plain LRU
            return 1.0 / dt
        interval = info.interval
        if interval is not None and dt < 4 * interval:
            # a block used every few seconds is not colder for having been skipped once:
            # recency and frequency both enter through the time scale of its reuse
            dt = min(dt, max(interval, 1e-3))
        if now != self._memo_now:
            self._memo_now, self._memo = now, {}
        queue = info.queue
        if queue in ("chat", "agent"):
            key = (queue, info.token_type, info.app_type, info.session_id)
        elif queue == "structural":
            key = (queue, info.token_type, info.app_type, info.offset, info.prompt_len)
        else:
            key = (queue, info.token_type, info.app_type)
        factor = self._memo.get(key)
        if factor is None:
            factor = (self.alpha[queue] * self.w[info.token_type, info.app_type].value
                      * self.p_queue(queue, info, now))
            self._memo[key] = factor
        return factor / dt

    # ---- learning from events -------------------------------------------------------------
    def on_request(self, ctx: RequestContext, now: float) -> None:
        if ctx.session_id is None:
            return
        sid, app = ctx.session_id, ctx.app_type or "chat"
        self._end_sessions(now)
        for queue in self.pending.values():
            prev = queue.pop(sid, None)
            if prev is not None:  # the session came back: its last request was not its final one
                self.continuation.update(prev[0], 1.0)
        types = [t for _, t in ctx.segments]
        x = ContinuationModel.features(ctx.prompt_len, types.count("user"), app,
                                       "system" in types)
        self.pending[app][sid] = (x, now)
        if len(self.pending[app]) > TRACKED_SESSIONS:
            # the oldest waits for a label we can no longer afford to track: dropped unlabelled
            self.pending[app].popitem(last=False)
        self.session_p[sid] = self.continuation.predict(x)
        last = self.session_last.pop(sid, None)
        if last is not None:
            self.gaps[app].observe(now - last)
        self.session_last[sid] = now
        if len(self.session_last) > TRACKED_SESSIONS:
            old, _ = self.session_last.popitem(last=False)
            self.session_p.pop(old, None)

    def _end_sessions(self, now: float) -> None:
        """Sessions silent for longer than almost any gap of their kind have ended: label 0."""
        for app, queue in self.pending.items():
            if not queue:
                continue
            cutoff = self.gaps[app].quantile(END_QUANTILE)
            while queue:
                x, t = next(iter(queue.values()))
                if now - t <= cutoff:
                    break
                queue.popitem(last=False)
                self.continuation.update(x, 0.0)

    def on_insert(self, node, ctx: RequestContext, offset: int, is_new: bool) -> None:
        if not is_new:
            info = getattr(node, "sae", None)
            if info is not None and ctx.session_id and ctx.session_id != info.last_session:
                info.sessions_seen += 1
                info.last_session = ctx.session_id
                info.queue = self.route(info)
            return
        self.events["inserts"] += 1
        ttype = ctx.token_type_at(offset)
        info = BlockInfo(ttype, ctx.session_id, ctx.app_type or "chat", offset,
                         max(ctx.prompt_len, offset + len(node.key)), 1, ctx.session_id, ctx)
        info.queue = self.route(info)
        node.sae = info
        self.w[ttype, info.app_type].add_block()
        self.resident[info.queue] += len(node.key)
        ghost_key = block_key(node)
        if ghost_key in self.ghost:  # asked for again after we evicted it: a mistake
            self.w[self.ghost.pop(ghost_key)].add_hit()
            self.events["miss_after_eviction"] += 1

    def on_split(self, head, tail) -> None:
        """SGLang split ``tail`` into ``head`` (its first part, a new node) + ``tail``."""
        info: BlockInfo | None = getattr(tail, "sae", None)
        if info is None:
            return
        head.sae = BlockInfo(info.token_type, info.session_id, info.app_type, info.offset,
                             info.prompt_len, info.sessions_seen, info.last_session, info.ctx,
                             info.last_hit, info.interval, info.queue)
        old_queue = info.queue
        info.offset = block_offset(tail)  # the hooks move offsets on a split
        if info.ctx is not None:
            info.token_type = info.ctx.token_type_at(info.offset)
        info.queue = self.route(info)
        self.resident[old_queue] -= len(tail.key) + len(head.key)
        self.resident[head.sae.queue] += len(head.key)
        self.resident[info.queue] += len(tail.key)

    def on_hit(self, node, tokens: int, ctx: RequestContext | None) -> None:
        info: BlockInfo | None = getattr(node, "sae", None)
        if info is None:
            return
        if ctx is not None and ctx.session_id and ctx.session_id != info.last_session:
            info.sessions_seen += 1
            info.last_session = ctx.session_id
            info.queue = self.route(info)
        now = self.now_fn() if ctx is None or ctx.now is None else ctx.now
        if info.last_hit is not None:
            gap = max(now - info.last_hit, 1e-3)
            info.interval = gap if info.interval is None else 0.7 * info.interval + 0.3 * gap
        info.last_hit = now
        self.w[info.token_type, info.app_type].add_hit()
        self.hit_tokens[info.queue].value += tokens
        self.position.observe(info.offset / max(info.prompt_len, 1), True)
        self.events["hits"] += 1

    def on_evict(self, node) -> None:
        info: BlockInfo | None = getattr(node, "sae", None)
        if info is None:
            return
        queue = info.queue
        self.resident[queue] = max(self.resident[queue] - len(node.key), 0)
        self.position.observe(info.offset / max(info.prompt_len, 1), False)
        self.ghost[block_key(node)] = (info.token_type, info.app_type)
        if len(self.ghost) > self.ghost_capacity:
            self.ghost.popitem(last=False)
        self.events["evictions"] += 1
        if self.events["evictions"] % 64 == 0:
            self._refresh_alpha()

    def _refresh_alpha(self) -> None:
        scores = {}
        for q in QUEUES:
            hits = self.hit_tokens[q]
            scores[q] = math.log1p(hits.value / max(self.resident[q], 1))
            hits.value *= 0.9  # forget slowly, so alpha follows workload shifts
        self.alpha = softmax_weights(scores, self.temperature)
