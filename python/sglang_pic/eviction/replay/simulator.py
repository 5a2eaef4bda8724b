"""Replay a request trace against SGLang's real ``RadixCache`` with a token capacity.

The cache is SGLang's own ``sglang.srt.mem_cache.radix_cache.RadixCache`` with the
eviction policy under test (SGLang's or ours, through the same policy table the server uses), a
counting allocator instead of GPU memory, and a virtual clock: ``RadixCache`` stamps nodes with
``time.monotonic()``, so while a replay runs, the module's ``time`` is a proxy whose
``monotonic()`` returns trace time (everything else is the real ``time``).

Each request does what SGLang's scheduler does: match the prompt (prefix hit), lock the matched
path, make room for the tokens it adds by evicting, insert prompt + output when it finishes,
unlock. Reported per replay: token hit rate, an estimated TTFT per request (prefill cost of the
missed tokens, fitted to vanilla SGLang's H200 prefill times), and policy time per call.
"""

from __future__ import annotations

import contextlib
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sglang_pic.compat.radix_api import matched_indices, matched_tokens

from ..baselines import TLRU_TUNED
from ..policy import configure
from .traces import Request

# Prefill time model t(n) = A*n + B*n^2 ms for n new tokens after `h` cached ones:
# t = A*(L-h) + B*(L^2-h^2), least-squares fit to vanilla SGLang 0.5.17 on the H200
# (Llama-3-8B, triton: 1K 32 ms, 8K 265 ms, 32K 2574 ms; benchmark/results/position_free_h200_*).
PREFILL_A_MS = 0.0286
PREFILL_B_MS = 1.53e-6
TTFT_OVERHEAD_MS = 8.0


def estimated_ttft_ms(prompt_len: int, cached: int) -> float:
    new = prompt_len - cached
    return TTFT_OVERHEAD_MS + PREFILL_A_MS * new + PREFILL_B_MS * (prompt_len**2 - cached**2)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class _TimeProxy:
    """Stands in for the ``time`` module inside ``radix_cache`` during a replay."""

    def __init__(self, clock: _Clock) -> None:
        self._clock = clock

    def monotonic(self) -> float:
        return self._clock.now

    def __getattr__(self, name):
        return getattr(time, name)


class CountingAllocator:
    """What ``RadixCache`` needs from a KV allocator: a device and ``free_*`` calls."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free_segment(self, value, start_pos: int = 0) -> None:
        self.freed += len(value)

    def free_segments(self, segments) -> None:
        for value, _ in segments:
            self.freed += len(value)

    def free(self, value) -> None:
        self.freed += len(value)


@dataclass
class ReplayResult:
    policy: str
    capacity: int
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    evict_calls: int = 0
    evict_s: float = 0.0
    insert_calls: int = 0
    insert_s: float = 0.0
    nodes_max: int = 0
    max_used_tokens: int = 0
    hits_by_phase: list[tuple[int, int]] = field(default_factory=list)
    hits_by_app: dict[str, list[int]] = field(default_factory=dict)
    split_t: float | None = None  # requests at or after this time are the held-out part
    before_split: list[int] = field(default_factory=lambda: [0, 0])  # hit, prompt tokens
    after_split: list[int] = field(default_factory=lambda: [0, 0])
    refused: int = 0  # requests longer than the cache, left out (``servable``)
    refused_prompt_tokens: int = 0
    wall_s: float = 0.0
    # ``auto``: its changes of leader, (requests replayed before it, from, to)
    leader_changes: list[tuple[int, str, str]] | None = None

    def summary(self) -> dict:
        t = np.array(self.ttft_ms) if self.ttft_ms else np.zeros(1)
        return {
            "policy": self.policy, "capacity": self.capacity, "requests": self.requests,
            "token_hit_rate": self.hit_tokens / max(self.prompt_tokens, 1),
            "ttft_mean_ms": float(t.mean()), "ttft_p50_ms": float(np.percentile(t, 50)),
            "ttft_p99_ms": float(np.percentile(t, 99)),
            "evict_us_per_call": 1e6 * self.evict_s / max(self.evict_calls, 1),
            "insert_us_per_call": 1e6 * self.insert_s / max(self.insert_calls, 1),
            "evict_calls": self.evict_calls, "nodes_max": self.nodes_max,
            "max_used_tokens": self.max_used_tokens,
            "phase_hit_rates": [h / max(p, 1) for h, p in self.hits_by_phase],
            "app_hit_rates": {a: h / max(p, 1) for a, (h, p) in self.hits_by_app.items()},
            **({} if self.split_t is None else {
                "split_t": self.split_t,
                "first_hit_rate": self.before_split[0] / max(self.before_split[1], 1),
                "heldout_hit_rate": self.after_split[0] / max(self.after_split[1], 1),
                "first_prompt_tokens": self.before_split[1],
                "heldout_prompt_tokens": self.after_split[1]}),
            **({} if self.leader_changes is None else {
                "leader_changes": [list(c) for c in self.leader_changes]}),
            "refused_requests": self.refused, "refused_prompt_tokens": self.refused_prompt_tokens,
            "wall_s": self.wall_s,
        }


ABLATIONS = {"sae-alpha": ("sae", {"queue_weights": True}),
             "sae-nopred": ("sae", {"sessions.use_predictor": False}),
             "sae-uncensored": ("sae", {"sessions.censored_gaps": False}),
             "sae-conv": ("sae", {"guess.infer_sessions": True}),
             "sae-copy-all": ("sae", {"defer_host_copies": False}),
             "sae-noapp": ("sae", {"guess.infer_apps": False}),
             "tlru": ("tlru", TLRU_TUNED),
             "auto-regret": ("auto", {"selection": "regret"}),
             "auto-nomirror": ("auto", {"mirror": False}),
             "auto-margin": ("auto", {"confidence": None}),
             "auto-lru": ("auto", {"start": "lru"}),
             "auto-gdsf": ("auto", {"start": "gdsf"}),
             "auto-greedy": ("auto", {"selection": "regret", "greedy": True}),
             "auto-fast": ("auto", {"selection": "regret", "learning_rate": 2.0}),
             "auto-greedy-fast": ("auto", {"selection": "regret", "greedy": True,
                                           "learning_rate": 2.0})}
"""Variants of our policies for ablations: name -> (registered policy, strategy attributes;
a dotted name sets an attribute of an attribute, ``configure``).
``tlru:<xi>:<q_hat>`` names T-LRU at other settings (``policy_spec``)."""


def policy_spec(policy: str) -> tuple[str, dict]:
    """(registered policy, strategy attributes) for a replay policy name."""
    if policy.startswith("tlru:"):
        _, xi, q_hat = policy.split(":")
        return "tlru", {"threshold": float(xi), "next_prompt_estimate": float(q_hat)}
    return ABLATIONS.get(policy, (policy, {}))

ORACLE = "belady"
"""Not a policy anyone can run: Belady's offline rule (evict the block whose next use is farthest
in the future) with the whole trace known in advance, as an upper bound for the real ones."""

ENDS_ORACLE = "sae-ends"
"""Not a policy anyone can run either: ``sae`` told at every request whether its session will
send another one (its ``q`` is 1 or 0 instead of the session predictor's guess), but not when.
Between it and ``belady`` lies what knowing *when* sessions come back is worth; between ``sae``
and it, what knowing *whether* they do."""

CONV_ENDS_ORACLE = "sae-conv-ends"
"""Not a policy anyone can run: ``sae-conv`` (conversations inferred from the prefix chain, for
traces without sessions) told at every request whether a later request continues its
conversation (``_conversation_continues``; its ``q`` is 1 or 0), but not when: what knowing
which conversations go on is worth on a block trace."""

PARAMS_ORACLE = "sae-params"
"""``sae`` handed the generator's true session parameters (gap log-normals and continuation
odds per application, ``traces.session_params``) instead of learning them online: what learning
costs."""

_MOD = (1 << 61) - 1
_BASE = 1_000_003


class BeladyOracle:
    """``get_priority(node)`` = minus the index of the next request whose prompt reaches the
    node's first token (never again: minus infinity), so ``RadixCache.evict`` takes the
    farthest-needed leaf first. A path is identified by a polynomial hash of its tokens; the
    hash of the path *through* a node is split-invariant, so it is cached per node."""

    _last: tuple[list[Request], dict] | None = None  # the last trace indexed: every cache size
    # of a workload replays the same trace

    def __init__(self, trace: list[Request]) -> None:
        self.uses = self._index(trace)
        self.now = 0  # index of the request being served
        self._through: dict[int, tuple] = {}  # id(node) -> (depth, hash, node) of its path

    @classmethod
    def _index(cls, trace: list[Request]) -> dict[tuple[int, int], list[int]]:
        """(depth, path hash) of every prompt prefix -> the requests that have it, ascending."""
        from collections import defaultdict

        if cls._last is not None and cls._last[0] is trace:
            return cls._last[1]
        uses: dict[tuple[int, int], list[int]] = defaultdict(list)
        for j, req in enumerate(trace):
            h = 0
            for depth, tok in enumerate(req.prompt, 1):
                h = (h * _BASE + tok + 1) % _MOD
                uses[(depth, h)].append(j)  # j ascending: lists stay sorted
        cls._last = (trace, dict(uses))
        return cls._last[1]

    def _path(self, node) -> tuple[int, int]:
        """(depth, hash) of the token path from the root through the end of ``node``."""
        got = self._through.get(id(node))
        if got is not None and got[2] is node:
            return got[0], got[1]
        if node.parent is None:
            return 0, 0
        depth, h = self._path(node.parent)
        for tok in node.key.token_ids:
            h = (h * _BASE + tok + 1) % _MOD
        depth += len(node.key.token_ids)
        self._through[id(node)] = (depth, h, node)
        return depth, h

    def get_priority(self, node) -> float:
        from bisect import bisect_right

        depth, h = self._path(node.parent)
        key = (depth + 1, (h * _BASE + node.key.token_ids[0] + 1) % _MOD)
        later = self.uses.get(key, ())
        i = bisect_right(later, self.now)
        return -later[i] if i < len(later) else float("-inf")


class BlockBeladyOracle:
    """``BeladyOracle`` for block traces (``Request.blocks``, e.g. Mooncake's): the path to a
    token of block ``h`` is the chain of blocks ending in ``h`` (prefix-chained hashes), so the
    next use of a node starting at token ``j`` of block ``h`` is the next request whose prompt
    has more than ``j`` tokens of ``h``. Indexed per block (~290K entries for the 12K-request
    trace) instead of per token prefix (145M); outputs (ids below the block range) are never
    resent. Same rule and priorities as ``BeladyOracle``."""

    def __init__(self, trace: list[Request], block: int = 512, base: int = 1_000_000) -> None:
        from collections import defaultdict

        uses: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for i, req in enumerate(trace):
            n = len(req.prompt)
            for b, h in enumerate(req.blocks or ()):
                k = min(block, n - b * block)
                if k <= 0:
                    break
                uses[h].append((i, k))  # i ascending
        self.uses = dict(uses)
        self.block, self.base = block, base
        self.now = 0

    def get_priority(self, node) -> float:
        from bisect import bisect_right

        tok = node.key.token_ids[0] - self.base
        if tok < 0:
            return float("-inf")
        h, j = divmod(tok, self.block)
        later = self.uses.get(h, ())
        i = bisect_right(later, (self.now, self.block + 1))
        while i < len(later):
            if later[i][1] > j:
                return -later[i][0]
            i += 1
        return float("-inf")


def make_cache(policy: str):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    allocator = CountingAllocator()
    base, attrs = policy_spec(policy)
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=allocator, page_size=1,
                             eviction_policy=base)
    cache = RadixCache(params)
    configure(cache.eviction_strategy, attrs)
    return cache, allocator


def _count_nodes(cache) -> int:
    n, stack = 0, [cache.root_node]
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(node.children.values())
    return n


def _node_hash(node) -> int:
    """``TreeNode``'s hash during a replay: its creation number (``TreeNode.id``, counted from 0
    per replay) instead of its address. SGLang's evictable leaves are a ``set`` and ties in
    eviction priority break in its iteration order, which follows the hashes; by address, two
    replays of one trace in one process broke ties differently (LRU on the Mooncake trace's
    first 1500 requests: 0.0623 and 0.0627). By creation number the same operations give the
    same order, so a replay is repeatable and two ways of running it can be compared."""
    return node.id


_SLOTS = torch.arange(0)


def _slots(n: int) -> torch.Tensor:
    """KV "slot" values for an insert of ``n`` tokens: a view of one shared range. The counting
    allocator only counts what it frees and the tree only slices and copies values, so no
    decision depends on them; building ``match + arange`` per request (the original path,
    ``fast=False``) was 60 % of a replay's time on the Mooncake trace."""
    global _SLOTS
    if len(_SLOTS) < n:
        _SLOTS = torch.arange(max(n, 2 * len(_SLOTS)))
    return _SLOTS[:n]


def servable(trace: list[Request], capacity: int) -> tuple[list[Request], list[int], int]:
    """The requests of ``trace`` a server with a KV pool of ``capacity`` tokens can run, the
    indices of those it refuses and their prompt tokens: a request's prompt and output need the
    pool at once, and
    SGLang refuses a prompt as long as its pool (``max_req_input_len``). A replay that matched
    such a request anyway would count hits that no server gets, and never insert it, so a
    policy would not see its session's activity: at 5 % of the unique tokens 47 of one agent
    seed's 344 requests (45 % of its prompt tokens) are such, and ``sae`` took their sessions
    for ended. Every policy replays the same served requests."""
    served, refused, refused_tokens = [], [], 0
    for i, req in enumerate(trace):
        if len(req.prompt) + len(req.output) > capacity:
            refused.append(i)
            refused_tokens += len(req.prompt)
        else:
            served.append(req)
    return served, refused, refused_tokens


def replay_context(req: Request):
    """What a replayed request tells the policy, as the server's ``request_context`` would:
    session, application, token types of prompt and output, and its arrival time."""
    from sglang_pic.eviction.context import RequestContext

    return RequestContext(session_id=req.session_id, app_type=req.app_type,
                          segments=req.segments, decode_start=len(req.prompt),
                          output_segments=req.output_segments, prompt_len=len(req.prompt),
                          now=req.t)


def replay(trace: list[Request], policy: str, capacity: int, phases: int = 2,
           session_params: dict[str, tuple[float, float, float]] | None = None,
           split_t: float | None = None, fast: bool = True,
           told_q: list[float] | None = None,
           observe: Callable[[int, Any], None] | None = None) -> ReplayResult:
    """Replay `trace` through a RadixCache of `capacity` tokens evicting with `policy`;
    ``session_params`` (``traces.session_params``) is what ``sae-params`` is handed.

    ``split_t``: hits are also counted apart for requests before it and at or after it
    (``first_hit_rate`` / ``heldout_hit_rate``). The whole trace is replayed either way, so the
    held-out part starts from the cache state the first part left; an online policy's decisions
    before ``split_t`` are the same as in a replay of the first part alone, so its
    ``first_hit_rate`` is what tuning on that part alone would see.

    ``told_q`` (``sae-conv-ends`` only): per request, the ``q`` it is told instead of the true
    0 / 1 of ``_conversation_continues`` - a predictor of a chosen quality
    (``analyze_trace.py``).

    ``fast`` (default) inserts views of one shared range as KV values (``_slots``) instead of
    the matched indices plus fresh ones; ``fast=False`` is the original path, which the tests
    check makes the same evictions.

    Requests longer than ``capacity`` are left out, as a server refuses them (``servable``):
    the result counts them apart (``refused``).

    ``observe(i, cache)``, if given, is called after the ``i``-th replayed request with the
    ``RadixCache`` (on the trace's clock), to check the cache's state as it goes."""
    from sglang.srt.mem_cache import radix_cache as rc
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_pic.eviction.context import using

    trace, refused, refused_tokens = servable(trace, capacity)
    if refused and told_q is not None:
        skip = set(refused)
        told_q = [q for i, q in enumerate(told_q) if i not in skip]
    rc.TreeNode.counter = 0  # creation numbers, the nodes' hashes (_node_hash), from 0
    cache, _ = make_cache({ORACLE: "lru", ENDS_ORACLE: "sae", PARAMS_ORACLE: "sae",
                           CONV_ENDS_ORACLE: "sae-conv"}.get(policy, policy))
    if policy == ORACLE:
        blocks = bool(trace) and all(r.blocks is not None for r in trace)
        cache.eviction_strategy = BlockBeladyOracle(trace) if blocks else BeladyOracle(trace)
    continues = None
    if policy == ENDS_ORACLE:
        continues = _session_continues(trace)
        cache.eviction_strategy.sessions.use_predictor = True  # q is read from sessions.p below
    if policy == CONV_ENDS_ORACLE:
        continues = _conversation_continues(trace) if told_q is None else list(told_q)
        cache.eviction_strategy.sessions.use_predictor = True
    if policy == PARAMS_ORACLE:
        if session_params is None:
            raise ValueError(f"{PARAMS_ORACLE} needs the generator's session_params")
        _hand_params(cache.eviction_strategy, session_params)
    clock = _Clock()
    strategy = cache.eviction_strategy
    if hasattr(strategy, "now_fn"):
        strategy.now_fn = clock.monotonic
    result = ReplayResult(policy, capacity, split_t=split_t, refused=len(refused),
                          refused_prompt_tokens=refused_tokens)
    wall0 = time.perf_counter()
    phase_len = max(len(trace) // phases, 1)
    phase_stats = [[0, 0] for _ in range(phases)]
    next_slot = 0
    with _patched(rc, "time", _TimeProxy(clock)), _patched(rc.TreeNode, "__hash__", _node_hash):
        for i, req in enumerate(trace):
            clock.now = req.t
            if policy == ORACLE:
                strategy.now = i
            ctx = replay_context(req)
            with using(ctx):
                key = RadixKey(token_ids=array("q", req.prompt), extra_key=None)
                match = cache.match_prefix(MatchPrefixParams(key=key))
                hit = matched_tokens(match)
                cache.inc_lock_ref(match.last_device_node)
                full = array("q", req.prompt) + array("q", req.output)
                need = len(full) - hit
                used = cache.evictable_size() + cache.protected_size()
                if used + need > capacity:
                    t0 = time.perf_counter()
                    cache.evict(EvictParams(num_tokens=used + need - capacity))
                    result.evict_s += time.perf_counter() - t0
                    result.evict_calls += 1
                room = capacity - cache.evictable_size() - cache.protected_size()
                if room >= need:
                    if fast:
                        value = _slots(len(full))
                    else:
                        value = torch.cat((matched_indices(cache, match).to(torch.int64),
                                           torch.arange(next_slot, next_slot + need)))
                        next_slot += need
                    t0 = time.perf_counter()
                    cache.insert(InsertParams(key=RadixKey(token_ids=full, extra_key=None),
                                              value=value))
                    result.insert_s += time.perf_counter() - t0
                    result.insert_calls += 1
                cache.dec_lock_ref(match.last_device_node)
                sid = req.session_id if policy != CONV_ENDS_ORACLE else ctx.session_id
                if continues is not None and sid is not None:
                    # after the request's own on_request, which set the predictor's guess
                    strategy.sessions.p[sid] = continues[i]
                result.max_used_tokens = max(result.max_used_tokens,
                                             cache.evictable_size() + cache.protected_size())
            if observe is not None:
                observe(i, cache)
            result.requests += 1
            result.prompt_tokens += len(req.prompt)
            result.hit_tokens += hit
            result.ttft_ms.append(estimated_ttft_ms(len(req.prompt), hit))
            app = result.hits_by_app.setdefault(req.app_type or "unknown", [0, 0])
            app[0] += hit
            app[1] += len(req.prompt)
            ph = phase_stats[min(i // phase_len, phases - 1)]
            ph[0] += hit
            ph[1] += len(req.prompt)
            if split_t is not None:
                part = result.after_split if req.t >= split_t else result.before_split
                part[0] += hit
                part[1] += len(req.prompt)
            if i % 500 == 0:
                result.nodes_max = max(result.nodes_max, _count_nodes(cache))
    result.hits_by_phase = [tuple(p) for p in phase_stats]
    if getattr(strategy, "leader_changes", None) is not None:
        result.leader_changes = list(strategy.leader_changes)
    result.wall_s = time.perf_counter() - wall0
    return result


def _hand_params(strategy, params: dict[str, tuple[float, float, float]]) -> None:
    """Freeze ``sae``'s gap fits and continuation odds at the given values."""
    import math

    from sglang_pic.eviction.estimators import LogNormalGaps

    for app, (median, sigma, _) in params.items():
        # a fit that never has enough samples to leave its prior
        strategy.sessions.gaps[app] = LogNormalGaps(math.log(median), sigma,
                                                    min_samples=sys.maxsize)
    odds = {app: q for app, (_, _, q) in params.items()}
    strategy.sessions.use_predictor = False
    strategy.sessions.continuation_odds = lambda app, _sid: odds.get(app, 0.5)


def _session_continues(trace: list[Request]) -> list[float]:
    """Per request: 1.0 when a later request of its session follows, else 0.0."""
    out, seen = [0.0] * len(trace), set()
    for i in range(len(trace) - 1, -1, -1):
        sid = trace[i].session_id
        if sid is not None:
            out[i] = float(sid in seen)
            seen.add(sid)
    return out


def resent_blocks(req: Request, last_use: dict[int, int], block: int = 512) -> int:
    """How many of ``req``'s leading blocks are full blocks an earlier request used
    (``last_use``: block hash -> index of the latest request that used it)."""
    n, k = len(req.prompt), 0
    for b, h in enumerate(req.blocks):
        if h not in last_use or min(block, n - b * block) < block:
            break
        k += 1
    return k


def _conversation_continues(trace: list[Request], block: int = 512) -> list[float]:
    """Per request of a block trace: 1.0 when a later request continues its conversation - its
    prompt resends this one's full blocks beyond the first (a shared opening alone is not a
    continuation) and this request is the latest to have used the deepest of them - else 0.0.
    Generated traces (no blocks): their sessions (``_session_continues``)."""
    if not trace or any(r.blocks is None for r in trace):
        return _session_continues(trace)
    out = [0.0] * len(trace)
    last_use: dict[int, int] = {}
    for i, req in enumerate(trace):
        k = resent_blocks(req, last_use, block)
        if k >= 2:
            out[last_use[req.blocks[k - 1]]] = 1.0
        for h in req.blocks:
            last_use[h] = i
    return out


@contextlib.contextmanager
def _patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)
