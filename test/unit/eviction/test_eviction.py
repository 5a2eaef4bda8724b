"""SAECache estimators, routing, baselines and the trace simulator (SGLang's real RadixCache)."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
from conftest import REPO, needs_hiradix
from sglang_pic.compat.radix_api import matched_tokens
from sglang_pic.eviction.estimators import (
    ClassRate,
    ContinuationModel,
    LogNormalGaps,
    PositionDecay,
    SessionIndex,
    softmax_weights,
)

pytestmark = pytest.mark.capability("eviction")


@pytest.fixture(scope="module", autouse=True)
def policies_registered():
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_pic.plugin import register_feature

    register_feature("eviction")
    HookRegistry.apply_hooks()


def test_lognormal_mle_recovers_known_parameters():
    rng = np.random.default_rng(0)
    est = LogNormalGaps(mu0=0.0, sigma0=1.0)
    for x in rng.lognormal(2.0, 0.7, size=5000):
        est.observe(float(x))
    assert est.mu == pytest.approx(2.0, abs=0.05)
    assert est.sigma == pytest.approx(0.7, abs=0.03)
    assert est.survival(math.exp(2.0)) == pytest.approx(0.5, abs=0.02)
    assert est.survival(1e-6) > 0.99 and est.survival(1e4) < 0.01


def test_lognormal_uses_prior_until_enough_samples():
    est = LogNormalGaps(mu0=math.log(30.0), sigma0=1.5, min_samples=8)
    for _ in range(7):
        est.observe(1.0)
    assert est.mu == pytest.approx(math.log(30.0))
    est.observe(1.0)
    assert est.mu == pytest.approx(0.0)


def test_lognormal_quantile_inverts_survival():
    gaps = LogNormalGaps(math.log(60.0), 1.0)
    assert gaps.quantile(0.5) == pytest.approx(60.0)
    assert gaps.survival(gaps.quantile(0.99)) == pytest.approx(0.01, rel=1e-6)


def test_gap_fit_with_open_gaps_counted_is_not_biased_short():
    """Chat gaps of median 45 s (sigma 1) in sessions that go on with odds 0.75, seen 150 s
    into the trace: the gaps completed by then are the short ones (their MLE says a median
    under 30 s); counting the open gaps, each a longer gap or an ended session, the fit comes
    back near the truth. The sessions' end cutoff stays the completed gaps' quantile."""
    rng = np.random.default_rng(4)
    now, q = 150.0, 0.75
    fit, open_gaps = LogNormalGaps(), []
    for _ in range(400):
        t = float(rng.uniform(0.0, now))  # the session's last request before now
        while True:
            if rng.random() > q:  # ended: silent from t on
                open_gaps.append(now - t)
                break
            gap = float(rng.lognormal(math.log(45.0), 1.0))
            if t + gap > now:  # still open at now
                open_gaps.append(now - t)
                break
            fit.observe(gap)
            t += gap
    completed_cutoff = fit.quantile(0.99)
    assert math.exp(fit.mu) < 30.0
    fit.refit_censored(open_gaps, q)
    assert math.exp(fit.mu) == pytest.approx(45.0, rel=0.25)
    assert fit.sigma == pytest.approx(1.0, abs=0.25)
    assert fit.quantile(0.99, completed_only=True) == pytest.approx(completed_cutoff)
    assert fit.quantile(0.99) > completed_cutoff
    fit.refit_censored([], q)  # nothing open: the completed gaps' MLE again
    assert fit.censored_fit is None and math.exp(fit.mu) < 30.0


def test_sae_counts_open_gaps_in_its_gap_fit():
    """Sessions with gaps of median 45 s, 150 s into the trace: the fit ``sae`` scores with
    counts the sessions still silent, and comes out longer than the completed gaps' fit that
    ``sae-uncensored`` uses; the end cutoff is the same for both."""
    from sglang_pic.eviction.context import RequestContext
    from sglang_pic.eviction.sae import SAEStrategy
    from sglang_pic.eviction.sessions import END_QUANTILE

    rng = np.random.default_rng(6)
    events = []
    for i in range(300):
        t = float(rng.uniform(0.0, 150.0))
        events.append((t, f"s{i}"))
        if rng.random() < 0.75:  # another request after a log-normal gap, if before the end
            back = t + float(rng.lognormal(math.log(45.0), 1.0))
            if back < 150.0:
                events.append((back, f"s{i}"))
    events.sort()

    def run(censored: bool) -> SAEStrategy:
        sae = SAEStrategy()
        sae.sessions.censored_gaps = censored
        for t, sid in events:
            sae.on_request(RequestContext(session_id=sid, app_type="chat", prompt_len=100), t)
        return sae

    plain, counted = run(False), run(True)
    assert plain.sessions.gaps["chat"].censored_fit is None
    assert counted.sessions.gaps["chat"].censored_fit is not None
    # biased short without the open gaps (log 45 s = 3.81); counted, closer to the truth
    assert plain.sessions.gaps["chat"].mu + 0.1 < counted.sessions.gaps["chat"].mu < math.log(45.0) + 0.3
    assert counted.sessions.gaps["chat"].quantile(END_QUANTILE, completed_only=True) == pytest.approx(
        plain.sessions.gaps["chat"].quantile(END_QUANTILE))


def test_continuation_model_learns_which_sessions_come_back():
    """Sessions past their third turn come back 90 % of the time, first turns 20 %: the online
    logistic model separates them from the request features alone."""
    rng = np.random.default_rng(0)
    model = ContinuationModel(prior=0.5)
    first = ContinuationModel.features(300, 1, "chat", True)
    later = ContinuationModel.features(1500, 4, "chat", True)
    assert model.predict(first) == pytest.approx(0.5)
    for _ in range(4000):
        turns = int(rng.integers(1, 6))
        x = ContinuationModel.features(300 * turns, turns, "chat", True)
        model.update(x, float(rng.random() < (0.2 if turns == 1 else 0.9 if turns >= 3 else 0.5)))
    assert model.predict(first) < 0.35
    assert model.predict(later) > 0.8


def test_sae_session_predictor_labels_from_traffic():
    """A session's next request labels its previous one 1; silence past the gap distribution's
    99th percentile labels it 0; the prediction is the ``q`` of the session's index."""
    from sglang_pic.eviction.context import RequestContext
    from sglang_pic.eviction.sae import BlockInfo, SAEStrategy

    sae = SAEStrategy()
    assert sae.sessions.use_predictor  # on by default (SGLANG_PIC_SAE_PREDICTOR=0 turns it off)
    t = 0.0
    for i in range(300):  # one-shot chat sessions, a new one every 30 s
        t += 30.0
        sae.on_request(RequestContext(session_id=f"s{i}", app_type="chat", prompt_len=200,
                                      segments=[(0, "system"), (20, "user")]), t)
    assert sae.sessions.continuation.updates > 250  # all but the last ~40 ended (no return in ~1000 s)
    p = sae.sessions.p["s299"]
    assert p < 0.2
    assert sae.sessions.continuation_odds("chat", "s299") == p
    info = BlockInfo("user", "s299", "chat", 0, 200, turn=1)  # its request's block
    assert sae.index("chat", info, 1.0, t) == pytest.approx(
        sae.session_index.value(sae.sessions.gaps["chat"], p, 0.0))
    sae.sessions.use_predictor = False  # then the application's return rate: none came back
    assert sae.sessions.continuation_odds("chat", "s299") == pytest.approx(7 / 310)


def test_sae_ends_sessions_per_application_type():
    """A chat session (cutoff ~16 min) waiting at the front does not hold back agent sessions
    (cutoff ~1.5 min) from being labelled as ended."""
    from sglang_pic.eviction.context import RequestContext
    from sglang_pic.eviction.sae import SAEStrategy

    sae = SAEStrategy()
    sae.on_request(RequestContext(session_id="c", app_type="chat", prompt_len=100), 0.0)
    sae.on_request(RequestContext(session_id="a", app_type="agent", prompt_len=100), 1.0)
    sae.on_request(RequestContext(session_id="a2", app_type="agent", prompt_len=100), 300.0)
    assert "a" not in sae.sessions.pending["agent"] and "c" in sae.sessions.pending["chat"]
    assert sae.sessions.continuation.updates == 1  # "a" ended (label 0); "c" still open


def test_sae_sessions_waiting_for_a_label_are_bounded(monkeypatch):
    """Single-turn traffic with session ids has an hours-long silence cutoff: the sessions
    waiting for a continuation label stay bounded (the oldest dropped, unlabelled)."""
    from sglang_pic.eviction import sae as sae_module
    from sglang_pic.eviction import sessions as sessions_module
    from sglang_pic.eviction.context import RequestContext

    monkeypatch.setattr(sessions_module, "TRACKED_SESSIONS", 50)
    monkeypatch.setattr(sae_module, "TRACKED_SESSIONS", 50)
    sae = sae_module.SAEStrategy()
    for i in range(500):  # one request per session, a second apart: none has ended yet
        sae.on_request(RequestContext(session_id=f"q{i}", app_type="single", prompt_len=50),
                       float(i))
    assert len(sae.sessions.pending["single"]) == 50 and "q499" in sae.sessions.pending["single"]
    assert sae.sessions.continuation.updates == 0  # dropped ones were not labelled as ended
    assert len(sae.sessions.last) <= 50


def test_class_rate_is_hits_per_resident_token_second():
    """Prior until data; then hit tokens over the token-seconds the kind was resident (a block
    evicted early is charged only for the time it was held)."""
    r = ClassRate(prior=0.01, k=100.0)
    assert r.value(0.0) == pytest.approx(0.01)
    r.add(1000, 0.0)  # 1000 tokens resident from t=0
    r.hit(500, 10.0)  # 500 hit tokens after 10 s: 10_000 token-seconds so far
    r.remove(1000, 10.0)
    assert r.value(50.0) == pytest.approx((500 + 1.0) / (10_000 + 100))  # nothing resident since
    r.add(10, 50.0, block=False)
    assert r.resident == 10 and r._n == 1  # a re-typed part is not a new block


def test_class_rate_forgets_old_evidence():
    r = ClassRate(prior=0.0, k=1.0, period=10)
    r.add(100, 0.0)
    r.hit(1000, 1.0)
    before = r.hits
    for _ in range(9):
        r.add(0, 1.0)
    assert r.hits == pytest.approx(before / 2)


def _index_brute_force(mu, sigma, q, e):
    """max over horizons of q (S(e) - S(e+h)) / int_e^{e+h} (q S + 1 - q), on a fine grid."""
    from scipy.stats import lognorm

    dist = lognorm(s=sigma, scale=math.exp(mu))
    u = e + np.geomspace(1e-3, 1e4, 20000)
    occupancy = q * dist.sf(u) + 1 - q
    cum = np.cumsum(np.diff(np.concatenate(([e], u))) * occupancy)
    return float(np.max(q * (dist.sf(e) - dist.sf(u)) / cum))


def test_session_index_matches_its_definition():
    gaps = LogNormalGaps(math.log(45.0), 1.0, min_samples=10**9)  # the prior only
    index = SessionIndex()
    for q in (0.5, 0.75, 1.0):
        for e in (0.5, 20.0, 45.0, 300.0):
            got = index.value(gaps, q, e)
            assert got == pytest.approx(_index_brute_force(math.log(45.0), 1.0, q, e), rel=0.07)


def test_session_index_orders_sessions_as_a_cache_should():
    """Per second of occupancy, a fast agent loop is worth more than a slow chat; a session more
    likely to come back more than one less likely; a long-silent session least."""
    index = SessionIndex()
    chat = LogNormalGaps(math.log(45.0), 1.0, min_samples=10**9)
    agent = LogNormalGaps(math.log(3.0), 0.8, min_samples=10**9)
    assert index.value(agent, 0.85, 1.0) > 5 * index.value(chat, 0.85, 1.0)
    assert index.value(chat, 0.9, 10.0) > index.value(chat, 0.5, 10.0)
    assert index.value(chat, 0.75, 10.0) > index.value(chat, 0.75, 600.0) > 0


def test_position_decay_fits_gamma():
    rng = np.random.default_rng(1)
    pd = PositionDecay()
    for _ in range(40000):
        x = rng.random()
        pd.observe(x, rng.random() < 0.8 * (1 - x**2))
    pd.fit()
    assert pd.gamma == pytest.approx(2.0, abs=0.5)
    assert pd.value(0.0) == pytest.approx(1.0) and pd.value(1.0) < 0.01


def test_softmax_weights_temperature():
    assert softmax_weights({"a": 1.0, "b": 1.0}, 1.0) == {"a": 1.0, "b": 1.0}
    w = softmax_weights({"a": 2.0, "b": 0.0}, 1.0)
    assert w["a"] > 1.0 > w["b"] and w["a"] + w["b"] == pytest.approx(2.0)
    flat = softmax_weights({"a": 2.0, "b": 0.0}, 1e6)
    assert flat["a"] == pytest.approx(1.0, abs=1e-3)


def test_routing_rules():
    from sglang_pic.eviction.sae import BlockInfo, SAEStrategy

    s = SAEStrategy()
    assert s.route(BlockInfo("cot", "s", "agent", 0, 10)) == "evict_first"
    assert s.route(BlockInfo("system", "s", "chat", 0, 10)) == "structural"
    assert s.route(BlockInfo("user", "s", "chat", 0, 10, sessions_seen=3)) == "structural"
    assert s.route(BlockInfo("user", None, "single", 5, 10)) == "evict_first"
    assert s.route(BlockInfo("decode", "s", "chat", 5, 10)) == "chat"
    assert s.route(BlockInfo("tool", "s", "agent", 5, 10)) == "agent"


def test_auto_moves_weight_away_from_the_expert_that_evicts_too_early():
    """Regret from the ghost list: the expert whose evictions come back loses weight, down to
    the floor, and is drawn less; one that stops being wrong recovers."""
    from sglang_pic.eviction.auto import WEIGHT_FLOOR, AutoStrategy

    auto = AutoStrategy(experts=("gdsf", "lru"), ghost_capacity=1000, selection="regret")
    for serial in range(200):
        auto.evictions = serial
        auto._regret(1, serial)  # lru's eviction came back at once
    w = auto.weight_of()
    assert w["lru"] == pytest.approx(WEIGHT_FLOOR / (1 + WEIGHT_FLOOR), rel=0.05)
    draws = []
    for _ in range(400):
        auto.begin_evict()
        draws.append(auto.names[auto.chosen])
        auto.end_evict()
    assert draws.count("gdsf") > 0.9 * len(draws)
    for serial in range(200, 400):
        auto.evictions = serial
        auto._regret(0, serial)  # now gdsf's are wrong
    assert auto.weight_of()["lru"] > auto.weight_of()["gdsf"]


def test_auto_blames_the_expert_that_chose_the_eviction():
    """A block evicted during a pass of one expert and inserted again charges that expert,
    and an old eviction charges less than a fresh one."""
    from types import SimpleNamespace

    from sglang_pic.eviction.auto import AutoStrategy

    auto = AutoStrategy(experts=("gdsf", "lru"), ghost_capacity=8, selection="regret")

    def node(first: int):
        return SimpleNamespace(key=SimpleNamespace(token_ids=[first, 1, 2]), _pic_offset=0,
                               hit_count=0, last_access_time=0.0, parent=None)

    auto.chosen = 1
    auto.on_evict(node(7))
    auto.chosen = 0
    for i in range(6):
        auto.on_evict(node(100 + i))
    auto.on_insert(node(7), None, 0, True)
    auto.on_insert(node(105), None, 0, True)
    assert auto.regrets[1] > 0 and auto.regrets[0] > 0
    assert auto.regrets[1] < auto.regrets[0]  # lru's was 6 evictions older
    charged = list(auto.regrets)
    auto.on_insert(node(7), None, 0, True)  # charged once: it left the ghost list
    assert auto.regrets == charged


def test_policies_are_in_sglangs_table():
    from sglang.srt.mem_cache.utils import get_eviction_strategy
    from sglang.srt.server_args import RADIX_EVICTION_POLICY_CHOICES
    from sglang_pic.launcher.serve_conflicts import EVICTION_POLICIES

    for name in ("auto", "sae", "gdsf", "s3fifo", "tlru"):
        assert get_eviction_strategy(name).name == name
    # the launcher's list (checked before anything loads) is what the server accepts
    assert set(EVICTION_POLICIES) == set(RADIX_EVICTION_POLICY_CHOICES)


def test_split_rederives_offset_and_type():
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import RequestContext, using
    from sglang_pic.eviction.replay.simulator import make_cache

    cache, _ = make_cache("sae")
    a = list(range(100, 120))
    ctx = RequestContext("s1", "chat", [(0, "system"), (8, "user")], decode_start=20,
                         prompt_len=20)
    with using(ctx):
        cache.insert(InsertParams(key=RadixKey(array("q", a), None), value=None))
    ctx2 = RequestContext("s2", "chat", [(0, "system"), (8, "user")], decode_start=20,
                          prompt_len=20)
    with using(ctx2):  # diverges at 12: splits the first node into [0, 12) + [12, 20)
        cache.insert(InsertParams(key=RadixKey(array("q", a[:12] + [7] * 8), None), value=None))
    head = cache.root_node.children[next(iter(cache.root_node.children))]
    assert len(head.key) == 12 and head.sae.offset == 0 and head.sae.token_type == "system"
    tails = sorted(head.children.values(), key=lambda n: n.sae.session_id)
    assert [t.sae.offset for t in tails] == [12, 12]
    assert all(t.sae.token_type == "user" for t in tails)


def test_simulator_counts_exact_prefix_hits_and_respects_capacity():
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import Request

    p1, out1 = list(range(1000, 1100)), list(range(5000, 5050))
    trace = [
        Request(0.0, "s", "chat", p1, out1, [(0, "user")]),
        Request(10.0, "s", "chat", p1 + out1 + list(range(6000, 6020)), [1, 2, 3], [(0, "user")]),
    ]
    for policy in ("lru", "sae", "gdsf", "s3fifo"):
        res = replay(trace, policy, capacity=10_000)
        assert res.hit_tokens == len(p1) + len(out1), policy
    small = replay(trace, "sae", capacity=120)
    assert small.summary()["max_used_tokens"] <= 120


def test_auto_follows_the_expert_whose_shadow_cache_hits_more():
    """A short prefix asked for again and again between long one-off prompts, in a cache that
    holds the prefix and one one-off: LRU keeps the prefix (the older one-off goes), GDSF does
    not. ``auto``, starting on ``gdsf``, switches to ``lru``, and the shadows rank the two as
    replays of each alone do."""
    from sglang_pic.eviction.auto import AutoStrategy
    from sglang_pic.eviction.context import RequestContext
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import Request

    hot = list(range(1, 41))
    trace = []
    for i in range(60):
        trace.append(Request(t=float(2 * i), session_id=None, app_type="chat",
                             prompt=hot + [5000 + i], output=[7]))
        trace.append(Request(t=float(2 * i + 1), session_id=None, app_type="chat",
                             prompt=list(range(10_000 + 300 * i,
                                                                     10_000 + 300 * i + 280)),
                             output=[7]))
    capacity = 400
    auto = AutoStrategy(experts=("gdsf", "lru"))
    for req in trace:
        ctx = RequestContext(prompt_len=len(req.prompt), now=req.t)
        auto.on_lookup(req.prompt, ctx, 1)
        auto.on_store(req.prompt + req.output, ctx, 1, capacity)
    assert auto.names[auto.chosen] == "lru"
    hits = dict(zip(auto.names, auto.shadow_hits, strict=True))
    assert hits["lru"] > 1.5 * hits["gdsf"]
    alone = {p: replay(trace, p, capacity=capacity).hit_tokens for p in ("lru", "gdsf")}
    assert alone["lru"] > 1.5 * alone["gdsf"]
    # a replay of auto reports its changes of leader (here auto starting on gdsf leaves it)
    summary = replay(trace, "auto-gdsf", capacity=capacity).summary()
    assert summary["leader_changes"] and summary["leader_changes"][0][1] == "gdsf"
    leaders = ["gdsf"] + [to for _, _, to in summary["leader_changes"]]
    assert [old for _, old, _ in summary["leader_changes"]] == leaders[:-1]
    assert "leader_changes" not in replay(trace, "lru", capacity=capacity).summary()


def test_auto_changes_leader_only_on_a_lead_the_paired_test_passes():
    """The leader changes when another expert's lead in shadow hits, request by request, is more
    than ``CONFIDENCE`` (2) standard errors: four requests where ``lru``'s shadow hits 100
    tokens more are not enough (400 against 2 * 200), a fifth is (500 > 2 * 224); a lead built
    of large swings either way is not, however long it runs; the fixed-margin rule
    (``confidence=None``) moves on the first request."""
    from sglang_pic.eviction.auto import CONFIDENCE, AutoStrategy

    assert CONFIDENCE == 2.0

    class ScriptedShadow:
        def __init__(self, hits: list[int]) -> None:
            self.hits = iter(hits)

        def lookup(self, tokens) -> int:
            return next(self.hits)

    changes = []

    def run(lru_hits: list[int], sae_hits: list[int], **kw) -> list[str]:
        auto = AutoStrategy(experts=("sae", "lru"), **kw)
        auto.shadows = [ScriptedShadow(sae_hits), ScriptedShadow(lru_hits)]
        leaders = []
        for _ in lru_hits:
            auto.on_lookup([1] * 1000, None, 1)
            leaders.append(auto.names[auto.chosen])
        changes[:] = auto.leader_changes
        return leaders

    assert run([100] * 6, [0] * 6) == ["sae"] * 4 + ["lru"] * 2
    assert changes == [(5, "sae", "lru")]  # on the fifth prompt
    swings = [1000, 0] * 200  # lru ahead by 1000 on every other request, sae on the others
    assert set(run(swings, swings[1:] + [1000])) == {"sae"}
    assert run([100] * 2, [0] * 2, confidence=None) == ["lru"] * 2


def test_each_shadow_cache_hits_what_its_expert_hits_alone():
    """``auto``'s shadows against replays of each expert alone (SGLang's ``RadixCache``
    evicting with it) on generated traffic under pressure: a shadow caches as the real cache
    does (the prefix it holds locked, room made before the insert), so its hits are its
    expert's own; ``sae`` samples leaves at random, so its shadow is within 1 %."""
    from sglang.srt.mem_cache import radix_cache
    from sglang_pic.eviction.auto import VARIANTS, AutoStrategy
    from sglang_pic.eviction.replay import simulator
    from sglang_pic.eviction.replay.simulator import policy_spec, replay, replay_context
    from sglang_pic.eviction.replay.traces import generate

    trace = generate("mix", scale=12, seed=3)
    capacity = 4000
    auto = AutoStrategy()
    clock = simulator._Clock()
    auto.now_fn = clock.monotonic  # the trace's clock, for the policies and SGLang's tree
    with simulator._patched(radix_cache, "time", simulator._TimeProxy(clock)):
        for req in trace:
            if len(req.prompt) + len(req.output) > capacity:
                continue  # the replay refuses it, as a server would
            clock.now = req.t
            ctx = replay_context(req)
            auto.on_lookup(req.prompt, ctx, 1)
            auto.on_store(req.prompt + req.output, ctx, 1, capacity)
    shadow = dict(zip(auto.names, auto.shadow_totals, strict=True))
    alone = {}
    for name in auto.names:
        # the replay's tlru has auto's settings; its sae-conv is auto's variant of sae (which
        # keeps its block state under a name of its own beside auto's sae)
        variant = {k: v for k, v in VARIANTS.get(name, (name, {}))[1].items()
                   if k != "block_attr"}
        assert policy_spec(name)[1] == {**auto.settings.get(name, {}), **variant}
        alone[name] = replay(trace, name, capacity=capacity).hit_tokens
    assert len(set(alone.values())) >= 5, alone  # the experts differ on this traffic
    for name in ("lru", "gdsf", "s3fifo", "tlru"):
        assert shadow[name] == alone[name], (name, shadow, alone)
    for name in ("sae", "sae-conv"):
        assert abs(shadow[name] - alone[name]) <= 0.01 * alone[name], (name, shadow, alone)


def test_auto_held_on_sae_caches_as_sae_alone_beside_an_expert_inferring_conversations(
        monkeypatch):
    """``sae-conv`` writes the conversations it infers into a request's context; in ``auto``
    it reads a copy of its own, so ``sae`` beside it sees what it sees alone. With the leader
    held on ``sae`` (a paired test no lead passes), ``auto``'s real cache makes ``sae``'s own
    decisions on traffic without hints: the same hits as ``sae`` replayed alone."""
    import dataclasses

    from sglang_pic.eviction.auto import AutoStrategy
    from sglang_pic.eviction.replay import simulator
    from sglang_pic.eviction.replay.traces import generate

    assert "sae-conv" in AutoStrategy().names
    trace = [dataclasses.replace(r, session_id=None, app_type=None, segments=[(0, "user")],
                                 output_segments=[])
             for r in generate("chat", scale=12, seed=3)]
    monkeypatch.setitem(simulator.ABLATIONS, "auto-held", ("auto", {"confidence": 1e12}))
    held = simulator.replay(trace, "auto-held", capacity=4000)
    alone = {p: simulator.replay(trace, p, capacity=4000).hit_tokens
             for p in ("sae", "sae-conv")}
    assert alone["sae"] != alone["sae-conv"], alone  # the inference changes sae's decisions
    assert held.hit_tokens == alone["sae"], (held.hit_tokens, alone)


@pytest.mark.parametrize("expert", ["lru", "s3fifo", "gdsf", "tlru"])
def test_auto_started_and_held_on_an_expert_caches_as_that_expert_alone(monkeypatch, expert):
    """``start`` picks the leader ``auto`` begins with (``auto-lru``): held there, its real
    cache makes that expert's own decisions, the same hits as the expert alone, and not
    ``sae``'s (the default start): the expert sees every event the cache reports, its size
    included (``s3fifo`` sizes its queues by it). An unknown expert is refused, naming the
    experts."""
    from sglang_pic.eviction.auto import AutoStrategy
    from sglang_pic.eviction.replay import simulator
    from sglang_pic.eviction.replay.traces import generate

    trace = generate("chat", scale=12, seed=3)
    monkeypatch.setitem(simulator.ABLATIONS, "auto-held",
                        ("auto", {"start": expert, "confidence": 1e12}))
    held = simulator.replay(trace, "auto-held", capacity=4000).hit_tokens
    alone = {p: simulator.replay(trace, p, capacity=4000).hit_tokens for p in (expert, "sae")}
    assert alone[expert] != alone["sae"], alone
    assert held == alone[expert], (held, alone)
    with pytest.raises(ValueError, match="auto: no expert 'lfu'; its experts are sae, "):
        AutoStrategy().start = "lfu"


@pytest.mark.parametrize("workload", ["chat", "single_heavy"])
def test_drop_marks_on_the_real_tree_say_which_blocks_each_shadow_lacks(workload):
    """``auto``'s mirror reads drop marks on the real tree: checked every third request of a
    replay under pressure, a node carries a shadow's bit exactly when that shadow does not hold
    the node's tokens to its end (SGLang's match on the shadow as the reference)."""
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import generate
    from sglang_pic.eviction.shadow import DROPS, path_tokens

    seen = {"checks": 0, "marked": 0, "wrong": []}

    def check(i: int, cache) -> None:
        if i % 3:
            return
        shadows = cache.eviction_strategy.shadows
        stack = list(cache.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            path = path_tokens(node)
            for bit, shadow in enumerate(shadows):
                marked = bool(getattr(node, DROPS, 0) >> bit & 1)
                held = shadow.lookup(path) == len(path)
                seen["checks"] += 1
                seen["marked"] += marked
                if marked == held:
                    seen["wrong"].append((i, bit, marked))

    replay(generate(workload, scale=20, seed=3), "auto", capacity=3000, observe=check)
    assert seen["checks"] > 300 and seen["marked"] > 20, seen
    assert not seen["wrong"], seen["wrong"][:10]


@pytest.mark.parametrize("policy", ["lru", "sae", "s3fifo", "gdsf", "auto"])
def test_replay_under_pressure_stays_within_capacity(policy):
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import generate

    trace = generate("mix", scale=12, seed=3)
    res = replay(trace, policy, capacity=4000).summary()
    assert 0.0 < res["token_hit_rate"] < 1.0
    assert res["max_used_tokens"] <= 4000
    assert res["evict_calls"] > 0



@needs_hiradix
@pytest.mark.parametrize("policy", ["lru", "sae"])
def test_two_tier_replay_reduces_to_one_tier_at_its_limits(policy):
    """The HiCache replay (SGLang's ``HiRadixCache`` on a counting controller) against the
    one-tier replay: with no host room it makes the same decisions as a ``RadixCache`` of the
    device tier's size; with an unbounded host tier every reuse is a hit, as in an unbounded
    ``RadixCache``, and the host tier serves what the device tier could not hold."""
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import generate

    from benchmark.eviction.two_tier import replay_two_tier

    trace = generate("mix", scale=12, seed=3)  # its largest request: 16K tokens with output
    one = replay(trace, policy, capacity=20_000).summary()
    two = replay_two_tier(trace, policy, device_tokens=20_000, host_tokens=0)
    assert two["token_hit_rate"] == one["token_hit_rate"] and two["host_hit_rate"] == 0
    unbounded = replay(trace, policy, capacity=10**9).summary()["token_hit_rate"]
    both = replay_two_tier(trace, policy, device_tokens=20_000, host_tokens=10**9)
    assert both["token_hit_rate"] == pytest.approx(unbounded, abs=1e-12)
    assert both["host_hit_rate"] > 0 and both["host_loaded_tokens"] > 0
    assert both["token_hit_rate"] > one["token_hit_rate"]


@pytest.mark.parametrize("policy", ["lru", "sae"])
def test_replays_leave_out_requests_longer_than_the_cache(policy):
    """A request whose prompt and output exceed the cache is refused, as a server refuses it:
    the replay leaves it out of every count and reports it apart."""
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import generate

    trace = generate("mix", scale=12, seed=3)
    long = [r for r in trace if len(r.prompt) + len(r.output) > _LONG_CAPACITY]
    assert 0 < len(long) < len(trace)
    one = replay(trace, policy, capacity=_LONG_CAPACITY).summary()
    assert one["requests"] == len(trace) - len(long)
    assert one["refused_requests"] == len(long)
    assert one["refused_prompt_tokens"] == sum(len(r.prompt) for r in long)


@needs_hiradix
@pytest.mark.parametrize("policy", ["lru", "sae"])
def test_the_two_tier_replay_leaves_out_the_same_requests(policy):
    """The two-tier replay refuses the same requests as the one-tier one, and still reduces to
    it with no host room."""
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import generate

    from benchmark.eviction.two_tier import replay_two_tier

    trace = generate("mix", scale=12, seed=3)
    long = [r for r in trace if len(r.prompt) + len(r.output) > _LONG_CAPACITY]
    one = replay(trace, policy, capacity=_LONG_CAPACITY).summary()
    two = replay_two_tier(trace, policy, device_tokens=_LONG_CAPACITY, host_tokens=0)
    assert two["refused_requests"] == len(long) and two["requests"] == one["requests"]
    assert two["prompt_tokens"] + two["refused_prompt_tokens"] == sum(len(r.prompt)
                                                                      for r in trace)
    assert two["token_hit_rate"] == one["token_hit_rate"]


_LONG_CAPACITY = 8_000  # under the largest request of the "mix" trace at scale 12


def test_sae_stats_time_the_policy_without_changing_its_choices(tmp_path, monkeypatch):
    """``SGLANG_PIC_SAE_STATS`` times the policy's callbacks and evict passes (how the server's
    overhead is measured) and must not change what it evicts."""
    import json

    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import generate

    trace = generate("mix", scale=12, seed=3)
    plain = replay(trace, "sae", capacity=4000).summary()
    stats = tmp_path / "sae.json"
    monkeypatch.setenv("SGLANG_PIC_SAE_STATS", str(stats))
    timed = replay(trace, "sae", capacity=4000).summary()
    assert timed["token_hit_rate"] == plain["token_hit_rate"]
    dumped = json.loads(stats.read_text())
    assert dumped["evict"]["passes"] == timed["evict_calls"]
    assert 0 < dumped["evict"]["max_seconds"] <= dumped["evict"]["seconds"]
    assert all(dumped["seconds"][name] > 0 for name in ("get_priority", "on_insert", "on_hit",
                                                          "on_request", "on_evict"))


def test_unwritable_sae_stats_path_is_a_warning_not_a_crash(monkeypatch, caplog):
    """The stats file is written inside SGLang's evict pass: a bad path must not raise there
    (it would take the scheduler down), it turns the stats off with one warning."""
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import generate

    monkeypatch.setenv("SGLANG_PIC_SAE_STATS", "/nonexistent-dir/sae.json")
    trace = generate("mix", scale=12, seed=3)
    with caplog.at_level("WARNING"):
        res = replay(trace, "sae", capacity=4000).summary()
    assert res["evict_calls"] > 1
    warned = [r for r in caplog.records if "SGLANG_PIC_SAE_STATS" in r.getMessage()]
    assert len(warned) == 1

def test_a_sae_stats_path_that_is_not_a_regular_file_is_left_alone(monkeypatch, caplog,
                                                                     tmp_path):
    """Each write replaces the stats file (a temporary file renamed over it): pointed at a
    device or a pipe, that replaced it (``/dev/null`` became a regular file). It is left alone,
    with one warning, and the stats are off."""
    import stat

    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import generate

    fifo = tmp_path / "stats.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv("SGLANG_PIC_SAE_STATS", str(fifo))
    with caplog.at_level("WARNING"):
        res = replay(generate("mix", scale=12, seed=3), "sae", capacity=4000).summary()
    assert res["evict_calls"] > 1 and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sum("not a regular file" in r.getMessage() for r in caplog.records) == 1


def test_belady_bound_keeps_what_is_needed_next_and_beats_every_policy():
    """The offline bound evicts the block needed farthest in the future: with room for two of
    three 100-token documents, the one asked for again stays, whatever was used last."""
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import Request, generate

    a, b, c = (list(range(k, k + 100)) for k in (1000, 2000, 3000))
    trace = [Request(float(t), "x", "single", doc, [9]) for t, doc in enumerate((a, b, c, a))]
    # c needs room: LRU drops a (used longest ago) and misses it; the oracle drops b (never
    # needed again) and hits a
    assert replay(trace, "lru", capacity=210).hit_tokens == 0
    assert replay(trace, "belady", capacity=210).hit_tokens == 100
    mix = generate("mix", scale=12, seed=3)
    bound = replay(mix, "belady", capacity=4000).summary()
    assert bound["max_used_tokens"] <= 4000
    for policy in ("lru", "fifo", "gdsf", "sae"):
        assert replay(mix, policy, capacity=4000).hit_tokens <= bound["token_hit_rate"] * sum(
            len(r.prompt) for r in mix), policy


def test_ends_oracle_keeps_the_session_that_goes_on():
    """``sae-ends`` is ``sae`` told whether each session sends another request: of two chat
    contexts that fit one at a time, it keeps the one whose session returns, where ``sae`` (no
    foreknowledge; a chat's chance of returning still rises seconds into its silence) keeps the
    older one, the wrong one."""
    from sglang_pic.eviction.replay.simulator import _session_continues, replay
    from sglang_pic.eviction.replay.traces import Request

    a, b, c = (list(range(k, k + 100)) for k in (1000, 2000, 3000))
    seg = [(0, "user")]
    trace = [Request(0.0, "B", "chat", b, [2], seg), Request(1.0, "A", "chat", a, [1], seg),
             Request(2.0, None, "single", c, [3], seg),
             Request(3.0, "A", "chat", a + [1, 7], [4], seg)]
    assert _session_continues(trace) == [0.0, 1.0, 0.0, 0.0]
    assert replay(trace, "sae", capacity=210).hit_tokens == 0
    assert replay(trace, "sae-ends", capacity=210).hit_tokens == 101


def test_agent_traces_type_only_the_shared_tool_definitions_as_system():
    """The generator's segmentation is what ``sae`` learns from: in agent traces the tokens
    typed ``system`` are the three shared tool-definition prefixes, the task after them is
    ``user`` (it once was typed ``system`` up to its last token)."""
    from sglang_pic.eviction.replay.traces import generate

    trace = generate("agent", scale=40, seed=0)
    system_parts = {tuple(r.prompt[:r.segments[1][0]]) for r in trace}
    assert [t for _, t in trace[0].segments[:2]] == ["system", "user"]
    assert len(system_parts) <= 3
    firsts = {}
    for r in trace:
        firsts.setdefault(r.session_id, r)
    assert all(len(r.prompt) - r.segments[1][0] > 20 for r in firsts.values())  # the task


def test_mooncake_and_bailian_loaders(tmp_path):
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import load_bailian, load_mooncake

    mc = tmp_path / "mooncake.jsonl"
    mc.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 9]},
    ]))
    reqs = load_mooncake(mc)
    assert [len(r.prompt) for r in reqs] == [1100, 1300]
    assert replay(reqs, "lru", 100_000).hit_tokens == 1024  # blocks 1 and 2 are shared
    bl = tmp_path / "bailian.jsonl"
    bl.write_text("\n".join(json.dumps(r) for r in [
        {"chat_id": 1, "parent_chat_id": -1, "turn": 1, "timestamp": 0.0, "input_length": 40,
         "output_length": 8, "hash_ids": [1, 2, 3]},
        {"chat_id": 2, "parent_chat_id": 1, "turn": 2, "timestamp": 30.0, "input_length": 64,
         "output_length": 8, "hash_ids": [1, 2, 3, 4]},
    ]))
    reqs = load_bailian(bl)
    assert reqs[0].session_id == reqs[1].session_id == "1"
    assert reqs[1].app_type == "chat"


def test_mooncake_slice_samples_whole_conversations_and_keeps_bad_lines(tmp_path):
    """The end-to-end replay's slice: one conversation in K keeps every turn of a picked
    conversation (the requests sharing the block after the system block) and none of the
    others; prompts past the engine's limit are left out; a malformed line is passed on for
    the loader to report with its line number; ``requests`` takes the head instead."""
    from benchmark.eviction.bench_e2e import conversation_key, mooncake_slice

    recs = [{"timestamp": 100 * i, "input_length": 600 * (1 + i % 3), "output_length": 4,
             "hash_ids": [0, 10 + i % 7] + [1000 + i] * (i % 3)} for i in range(70)]
    recs.append({"timestamp": 7100, "input_length": 50_000, "output_length": 4,
                 "hash_ids": [0, 10]})
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\nnot json\n")
    picked = mooncake_slice(str(path), sample=3, requests=None, max_prompt_tokens=24_000)
    keys = {conversation_key(json.loads(line)["hash_ids"]) for line in picked[:-1]}
    assert picked[-1].strip() == "not json"
    assert 0 < len(keys) < 7  # some conversations, not all of them
    for r in recs[:70]:  # a picked conversation is replayed whole, the others not at all
        assert (json.dumps(r) + "\n" in picked) == (conversation_key(r["hash_ids"]) in keys)
    assert all(json.loads(line)["input_length"] <= 24_000 for line in picked[:-1])
    head = mooncake_slice(str(path), sample=None, requests=5, max_prompt_tokens=24_000)
    assert [json.loads(line)["timestamp"] for line in head] == [0, 100, 200, 300, 400]


def test_e2e_figure_draws_per_request_cdfs_and_older_reports(tmp_path):
    """``bench_e2e.py``'s figure from a report with every request's TTFT (two runs a variant)
    and from an older one that kept only p50 / p99."""
    from benchmark.eviction.bench_e2e import plot_e2e

    run = {"policy": "lru", "requests": 3, "token_hit_rate": 0.2,
           "token_hit_rate_all": [0.2, 0.22], "ttft_p50_ms": 5.0, "ttft_p99_ms": 9.0,
           "request_ttft_ms_all": [[1.0, 5.0, 9.0], [2.0, 4.0, 8.0]]}
    older = {k: v for k, v in run.items() if k != "request_ttft_ms_all"}
    for name, result in (("new", run), ("older", older)):
        report = {"benchmark": name, "rounds": 2, "params": {},
                  "results": {"vanilla": result, "sglang-pic": {**result, "policy": "sae"}}}
        out = plot_e2e(report, tmp_path / f"{name}.png")
        assert out.stat().st_size > 10_000  # a drawn figure, not an empty file


def test_hits_are_those_of_the_match_that_admitted_the_request():
    """The scheduler matches a waiting request every round. Blocks another request inserted
    while it waited are its hits (they were counted as misses when the first match counted);
    they are reported once, when the request is cached, however often it was matched."""
    from array import array
    from types import SimpleNamespace

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import RequestContext, using
    from sglang_pic.eviction.replay.simulator import make_cache

    cache, _ = make_cache("sae")
    sae = cache.eviction_strategy
    shared, own = list(range(100, 164)), list(range(500, 532))
    waiting = SimpleNamespace(rid="b", origin_input_ids=shared + own, session_id="s-b")

    def match(ids):
        return cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids), None),
                                                    req=waiting))

    def insert(rid, ids):
        with using(RequestContext("s-" + rid, "chat", [(0, "user")], prompt_len=len(ids),
                                  rid=rid)):
            cache.insert(InsertParams(key=RadixKey(array("q", ids), None), value=None))

    assert matched_tokens(match(shared + own)) == 0  # first round: nothing cached yet
    insert("a", shared)  # another request caches the shared part meanwhile
    assert matched_tokens(match(shared + own)) == 64  # the round that admits "b"
    assert sae.events["hits"] == 0  # nothing reported before "b" is cached
    insert("b", shared + own)
    assert sae.events["hits"] == 1
    node = cache.root_node.children[next(iter(cache.root_node.children))]
    assert node.sae.last_hit is not None
    match(shared + own)  # matched again later (e.g. retracted): not a second reuse
    insert("b", shared + own)
    assert sae.events["hits"] == 1


def test_sampled_evict_frees_enough_and_keeps_leaf_set_consistent():
    """With a sample smaller than the tree, SGLang's evict runs over samples; afterwards the
    cache's evictable-leaf set must be exactly the unlocked leaves of the tree."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import RequestContext, using
    from sglang_pic.eviction.replay.simulator import make_cache

    cache, _ = make_cache("sae")
    cache.eviction_strategy.sample_size = 16
    for i in range(300):
        ctx = RequestContext(f"s{i}", "chat", [(0, "system"), (8, "user")], decode_start=12,
                             prompt_len=12)
        with using(ctx):
            tokens = [1 + i % 3] * 8 + [100 + i] * 4
            cache.insert(InsertParams(key=RadixKey(array("q", tokens), None), value=None))
    before = cache.evictable_size()
    # all 300 four-token leaves and then two of the three 8-token system prompts, which only
    # become leaves (and evictable) during the pass
    freed = cache.evict(EvictParams(num_tokens=1210)).num_tokens_evicted
    assert freed >= 1210 and cache.evictable_size() == before - freed

    def leaves(node):
        if not node.children:
            return {node} if node is not cache.root_node and node.lock_ref == 0 else set()
        return set().union(*(leaves(c) for c in node.children.values()))

    assert cache.evictable_leaves == leaves(cache.root_node)


def test_chat_template_segmentation_and_client_hints(model_dir):
    """Server-path token types come from the chat template's role headers; session and app type
    from custom_params."""
    from types import SimpleNamespace

    from sglang_pic.eviction.hooks import request_context
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "List three rivers."},
                {"role": "assistant", "content": "<think>Europe first.</think>Rhine, Danube, Po."},
                {"role": "user", "content": "And two lakes?"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    ids = list(tok(text, add_special_tokens=False)["input_ids"])

    def offset_of(s):  # token offset where the substring s starts
        for i in range(len(ids)):
            if s in tok.decode(ids[: i + 1]):
                return i
        raise AssertionError(s)

    req = SimpleNamespace(origin_input_ids=ids, tokenizer=tok, rid="r1", session_id=None,
                          sampling_params=SimpleNamespace(custom_params={
                              "app_type": "chat", "session_id": "s-42"}))
    ctx = request_context(req)
    assert "careful" in text
    assert ctx.token_type_at(offset_of("careful")) == "system"
    assert ctx.token_type_at(offset_of("three rivers")) == "user"
    assert ctx.token_type_at(offset_of("Europe")) == "cot"
    assert ctx.token_type_at(offset_of("Danube")) == "assistant"
    assert ctx.token_type_at(offset_of("two lakes")) == "user"
    assert ctx.token_type_at(len(ids)) == "decode"
    assert (ctx.session_id, ctx.app_type) == ("s-42", "chat")
    plain = SimpleNamespace(origin_input_ids=list(range(100, 200)), tokenizer=None, rid="r2",
                            session_id=None, sampling_params=SimpleNamespace(custom_params=None))
    ctx = request_context(plain)
    assert ctx.segments == [(0, "user")] and ctx.app_type is None
    # no session is guessed: the request is its own requester (a guess from the prompt's
    # opening merged every conversation with the same system prompt into one session)
    assert ctx.session_id is None and ctx.requester == "r2"


def test_blocks_shared_by_requests_outside_sessions_become_structural():
    """Without a session or a ``system`` type (no hints, no chat template), a block another
    request reuses is shared: it leaves the per-request queue for the structural one, as a
    block two sessions use does. Chunks of one request (same ``rid``) do not count as two. A
    template's blocks come back structural after an eviction (the ghost set remembers them)."""
    from array import array

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import RequestContext, using
    from sglang_pic.eviction.replay.simulator import make_cache

    cache, _ = make_cache("sae")
    slot = 0

    def serve(rid, ids, app=None):
        nonlocal slot
        key = RadixKey(array("q", ids), None)
        with using(RequestContext(app_type=app, segments=[(0, "user")], prompt_len=len(ids),
                                  rid=rid)):
            hit = matched_tokens(cache.match_prefix(MatchPrefixParams(key=key)))
            value = torch.arange(slot, slot + len(ids))
            slot += len(ids)
            cache.insert(InsertParams(key=key, value=value))
        return hit

    shared = list(range(100, 164))
    serve("a", shared + list(range(500, 532)), app="single")
    node = cache.root_node.children[next(iter(cache.root_node.children))]
    assert node.sae.queue == "evict_first"
    serve("a", shared + list(range(500, 532)) + list(range(600, 616)), app="single")  # a chunk
    assert node.sae.queue == "evict_first"
    assert serve("b", shared + list(range(700, 732)), app="single") == len(shared)
    template = cache.root_node.children[next(iter(cache.root_node.children))]
    assert len(template.key) == len(shared) and template.sae.queue == "structural"

    # evicted, a template (shared, and requests branched after it) asked for again is shared
    # still: it comes back structural; a block only one request used, or a conversation's
    # history that two turns shared along one path, comes back as any new block
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    alone, talk = list(range(900, 964)), list(range(2000, 2064))
    serve("d", alone + list(range(1000, 1032)), app="single")
    serve("t1", talk)
    serve("t2", talk + list(range(2100, 2132)))  # the next turn: one path on from the first
    turn = next(n for n in cache.root_node.children.values() if n.key.token_ids[0] == talk[0])
    assert turn.sae.queue == "structural" and turn.sae.branches == 1
    cache.evict(EvictParams(num_tokens=10_000))
    assert not cache.root_node.children
    assert serve("c", shared + list(range(800, 832)), app="single") == 0
    assert serve("e", alone + list(range(1100, 1132)), app="single") == 0
    assert serve("t3", talk + list(range(2200, 2232))) == 0
    back = {n.key.token_ids[0]: n for n in cache.root_node.children.values()}
    assert back[shared[0]].sae.queue == "structural"
    assert back[alone[0]].sae.queue == "evict_first"
    # as any new block of a request without hints that matched nothing: a guessed single-turn
    # request's (``RequestGuesser.infer_app``), not structural
    assert back[talk[0]].sae.queue == "evict_first" and back[talk[0]].sae.sessions_seen == 1


class _SaeCache:
    """A ``sae`` radix cache of the simulator and the two steps the tests below take with it:
    serve a request (match its prompt, insert prompt + output under its context) and find the
    node a token path ends in."""

    def __init__(self) -> None:
        from sglang_pic.eviction.replay.simulator import make_cache

        self.cache, _ = make_cache("sae")
        self.strategy = self.cache.eviction_strategy
        self.slot = 0

    def serve(self, ctx, prompt: list[int], output: list[int]):
        from array import array

        import torch
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang_pic.eviction.context import using

        full = prompt + output
        with using(ctx):
            self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt), None)))
            self.cache.insert(InsertParams(key=RadixKey(array("q", full), None),
                                           value=torch.arange(self.slot, self.slot + len(full))))
        self.slot += len(full)
        return ctx

    def node_at(self, ids: list[int]):
        node, rest = self.cache.root_node, list(ids)
        while rest:
            node = node.children[rest[0]]
            rest = rest[len(node.key):]
        return node


def test_a_branch_its_session_moved_past_is_scored_like_evict_first():
    """Without token types an agent's reasoning is typed ``decode`` like the call the next step
    resends. Once the session's next request diverges from it, the reasoning is a branch the
    session left: it loses the session's index (and goes first), while the history the new
    request resent keeps it."""
    from sglang_pic.eviction.context import RequestContext

    sc = _SaeCache()
    strategy, node_at = sc.strategy, sc.node_at
    now = 0.0
    strategy.now_fn = lambda: now  # the session clock; SGLang's access times stay its own

    def serve(prompt, output):
        sc.serve(RequestContext(session_id="s", app_type="agent", segments=[(0, "user")],
                                decode_start=len(prompt), prompt_len=len(prompt), now=now),
                 prompt, output)

    task, cot, call, tool_out = (list(range(k, k + 40)) for k in (100, 200, 300, 400))
    serve(task, cot + call)
    assert not strategy.abandoned(node_at(task + cot + call).sae)  # it may still be resent
    now = 2.0
    serve(task + call + tool_out, list(range(500, 520)))  # the next step drops the reasoning
    reasoning, history = node_at(task + cot), node_at(task)  # SGLang split the first block
    assert reasoning.sae.token_type == "decode" and reasoning.sae.queue == "agent"
    assert strategy.abandoned(reasoning.sae) and not strategy.abandoned(history.sae)
    assert not strategy.abandoned(node_at(task + call + tool_out).sae)
    now = 3.0
    # scored as its kind's rate (w / (1 + w dt) <= w), below the session's index
    assert strategy.get_priority(reasoning) <= strategy.w["decode", "agent"].value()
    assert strategy.get_priority(reasoning) < strategy.get_priority(history)


def test_requests_without_hints_get_their_application_from_their_match():
    """A request with neither a session nor an application type: ``chat`` when it goes on from
    where an earlier request ended, ``single`` when it branches off a block other requests
    already went on past (a template), or matched nothing; its blocks are routed and counted
    as that application's. A later context of the same request (the server builds one per
    insert) gets the same answer. A guessed single-turn request's blocks still get their host
    tier copy (the guess may be a conversation's first turn); a client's ``single`` does not
    until reused."""
    from sglang_pic.eviction.context import RequestContext

    sc = _SaeCache()
    strategy, node_at = sc.strategy, sc.node_at

    def serve(prompt, output, rid=None, app=None):
        return sc.serve(RequestContext(segments=[(0, "user")], decode_start=len(prompt),
                                       app_type=app, prompt_len=len(prompt),
                                       now=float(sc.slot), rid=rid), prompt, output)

    template, q1, out1, turn2 = (list(range(k, k + 40)) for k in (100, 200, 300, 400))
    assert serve(template + q1, out1).app_type == "single"  # matched nothing
    assert serve(template + q1 + out1 + turn2, [7] * 8).app_type == "chat"  # goes on from it
    new_turn = node_at(template + q1 + out1 + turn2)
    assert new_turn.sae.app_type == "chat" and new_turn.sae.queue == "chat"
    serve(template + list(range(500, 540)), [8] * 8)  # a second request branches off the template
    third = serve(template + list(range(600, 640)), [9] * 8, rid="r3")
    assert third.app_type == "single"  # two requests went on past the template already
    query = node_at(template + list(range(600, 640)))
    assert query.sae.app_type == "single" and query.sae.queue == "evict_first"
    assert strategy.worth_host_copy(query)
    told_single = serve(template + list(range(900, 940)), [2] * 8, app="single")
    assert not told_single.app_inferred
    assert not strategy.worth_host_copy(node_at(template + list(range(900, 940))))
    later = RequestContext(rid="r3")
    strategy.guess.resolve(later)
    assert later.app_type == "single"
    # the deepest node decides, in whatever order the match lists them (HiCache lists its
    # host-tier part after the device part); a span segment's block (its own tree) decides
    # nothing
    history = node_at(template + q1 + out1 + turn2)
    shared = node_at(template)
    ctx = RequestContext(segments=[(0, "user")], prompt_len=200, now=1e3)
    strategy.guess.infer_app([shared, history], ctx)
    assert ctx.app_type == "chat" and ctx.app_inferred
    history.sae.key_start = 64
    ctx = RequestContext(segments=[(0, "user")], prompt_len=200, now=1e3)
    strategy.guess.infer_app([shared, history], ctx)
    assert ctx.app_type is None and not ctx.app_inferred
    history.sae.key_start = 0
    told = serve(template + list(range(700, 740)), [1] * 8)
    strategy.guess.infer_apps = False
    assert serve(template + list(range(800, 840)), [1] * 8).app_type is None
    assert told.app_type == "single"


def test_guessed_requests_learn_rates_per_shared_block_they_branch_off():
    """Without hints a template's queries and a system prompt's first turns are both guessed
    ``single`` (they branch off a shared block): each shared block's branches learn their own
    reuse rate (``sae._rates``), so a template whose queries are never reused scores its
    queries below the first turns of a system prompt whose conversations go on. The tail of a
    block a request branched off inside is a branch left: it learns its rate apart."""
    from sglang_pic.eviction.context import RequestContext
    from sglang_pic.eviction.sae import _rate_kind

    sc = _SaeCache()
    strategy, node_at = sc.strategy, sc.node_at
    ids = iter(range(1000, 10**6, 50))

    def fresh(n=40):
        k = next(ids)
        return list(range(k, k + n))

    def serve(prompt, output):
        return sc.serve(RequestContext(segments=[(0, "user")], decode_start=len(prompt),
                                       prompt_len=len(prompt), now=float(sc.slot)),
                        prompt, output)

    template, system = fresh(), fresh()
    first_query = fresh()
    serve(template + first_query, fresh(8))
    # the first query's tail, left when the next request branched off the template inside it
    for _ in range(6):
        serve(template + fresh(), fresh(8))
    left = node_at(template + first_query)
    assert left.sae.left and _rate_kind(left.sae)[1] == "single/left"
    for _ in range(6):  # conversations open with the system prompt and go on
        turn = system + fresh()
        out = fresh(8)
        serve(turn, out)
        serve(turn + out + fresh(), fresh(8))
    query = serve(template + fresh(), fresh(8))
    opening = serve(system + fresh(), fresh(8))
    assert query.anchor == strategy.guess.anchor_ids[0, tuple(template[:32])]
    assert opening.anchor == strategy.guess.anchor_ids[0, tuple(system[:32])]
    of_template = strategy._rate_value(("user", "single", query.anchor))
    of_system = strategy._rate_value(("user", "single", opening.anchor))
    assert of_template < min(of_system, strategy.w["user", "single"].value())


def test_a_large_leaf_expected_back_before_its_surplus_is_needed_is_not_evicted_for_a_few_tokens():
    """SGLang evicts whole nodes. A pass that needs 10 tokens would free a 2000-token shared
    block (index 1/10 s) before a 40-token one (1/9 s); at the recent rate of new tokens its
    surplus would sit unused for ~24 s, in which it is expected back 2.4 times
    (``SAEStrategy.surplus_value``): the small block goes, the large one stays. Below one
    expected reuse the index is left alone."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang_pic.eviction.context import RequestContext

    sc = _SaeCache()
    strategy, node_at = sc.strategy, sc.node_at
    large, small = list(range(1000, 3000)), list(range(5000, 5040))
    for t_large, t_small in ((0.0, 0.0), (10.0, 9.0), (20.0, 18.0)):
        for prompt, t in ((large, t_large), (small, t_small)):
            sc.serve(RequestContext(segments=[(0, "user")], decode_start=len(prompt),
                                    prompt_len=len(prompt), now=t), prompt, [])
    a, b = node_at(large), node_at(small)
    assert a.sae.queue == b.sae.queue == "structural" and not a.children and not b.children
    a.last_access_time, b.last_access_time = 20.0, 18.0
    strategy.now_fn = lambda: 25.0
    assert strategy.get_priority(a) < strategy.get_priority(b)  # scored alone, it goes first
    assert sc.cache.evict(EvictParams(num_tokens=10)).num_tokens_evicted == 40
    assert large[0] in sc.cache.root_node.children and small[0] not in sc.cache.root_node.children
    assert strategy.evict_need is None  # only during a pass
    # fewer than one expected reuse while the surplus waits: the index as it is
    assert strategy.surplus_value(0.01, 100, 25.0) == 0.01


def test_reuse_rates_count_unshared_blocks_only():
    """``w`` scores unshared blocks, so it counts them only: without token types a single-turn
    template and its unique queries are both ``user``; the template's first reuse (by a second
    request) counts - it is how an unshared block shows it gets reused - but once shared its
    tokens and later hits leave ``w(user, single)``, and the queries are not kept for them."""
    from array import array

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import RequestContext, using
    from sglang_pic.eviction.replay.simulator import make_cache

    cache, _ = make_cache("sae")
    strategy = cache.eviction_strategy
    w = strategy.w["user", "single"]
    slot = 0

    def serve(ids):
        nonlocal slot
        key = RadixKey(array("q", ids), None)
        with using(RequestContext(app_type="single", segments=[(0, "user")],
                                  prompt_len=len(ids), now=0.0)):
            cache.match_prefix(MatchPrefixParams(key=key))
            cache.insert(InsertParams(key=key, value=torch.arange(slot, slot + len(ids))))
            slot += len(ids)

    template = list(range(100, 164))
    serve(template + list(range(500, 532)))
    assert w.resident == 96 and w.hits == 0
    serve(template + list(range(600, 632)))  # the template is shared now
    assert w.hits == 64  # its first reuse counted
    assert w.resident == 32 + 32  # the two queries; the template left the count
    for k in range(3):
        serve(template + list(range(700 + 40 * k, 732 + 40 * k)))
    assert w.hits == 64 and w.resident == 5 * 32  # later template hits are not the queries'


def _mooncake_lines(n: int, seed: int = 0) -> list[str]:
    """A small conversation-like block trace: sessions that resend their history and add
    blocks, over two shared system-prompt blocks; partial last blocks."""
    rng = np.random.default_rng(seed)
    sessions: list[list[int]] = []
    next_id, lines = 10, []
    for i in range(n):
        if not sessions or rng.random() < 0.3:
            sessions.append([int(rng.integers(2))])
        s = sessions[int(rng.integers(len(sessions)))]
        k = int(rng.integers(1, 4))
        s += list(range(next_id, next_id + k))
        next_id += k
        lines.append(json.dumps({"timestamp": 1000 * i, "hash_ids": list(s),
                                 "input_length": 512 * (len(s) - 1) + int(rng.integers(1, 513)),
                                 "output_length": int(rng.integers(1, 300))}))
    return lines


def test_mooncake_loader_reports_malformed_lines_and_replays_the_rest(tmp_path, capsys):
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import load_mooncake

    good = _mooncake_lines(4)
    bad = ["{not json", json.dumps({"timestamp": 5, "hash_ids": [1]}),
           json.dumps({"timestamp": 6, "input_length": 9000, "output_length": 1,
                       "hash_ids": [1, 2]}),
           json.dumps({"timestamp": 7, "input_length": 10, "output_length": 1,
                       "hash_ids": ["a"]})]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([good[0], bad[0], good[1], bad[1], "", bad[2], good[2], bad[3],
                               good[3]]) + "\n")
    reqs = load_mooncake(path)
    err = capsys.readouterr().err
    assert len(reqs) == 4
    for lineno, why in ((2, "not JSON"), (4, "missing input_length, output_length"),
                        (6, "input_length 9000 > 2 blocks"), (8, "hash_ids")):
        assert f"trace.jsonl:{lineno}: skipped malformed trace line: {why}" in err
    assert "skipped 4 malformed line(s), replaying 4 requests" in err
    assert replay(reqs, "lru", 1_000_000).requests == 4


@pytest.mark.parametrize("script", ["bench_eviction", "replay_trace", "two_tier"])
def test_unknown_policy_is_refused_with_the_list_in_one_line(script, monkeypatch, capsys):
    """The command line ``python -m benchmark.eviction.<script> --policies lru,sea``, run in
    this process (its ``main``): exit 2 with one line on stderr, before any replay."""
    import importlib

    module = importlib.import_module(f"benchmark.eviction.{script}")
    monkeypatch.setattr(sys, "argv", [module.__file__, "--policies", "lru,sea"])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{script}.py: ")
    assert "unknown policy 'sea'" in lines[0]
    assert "known: lru,lfu,fifo,mru,filo,priority,slru,gdsf,s3fifo,tlru,sae" in lines[0]
    assert ("sae-lru-host" in lines[0]) == (script == "two_tier")  # its own ablation


def _record_evictions(monkeypatch) -> list[list[tuple[int, int, int]]]:
    """Every node ``RadixCache.evict`` removes, as (depth of its first token, its first token,
    its length) - what identifies it across two replays - appended to the last list of the
    returned list (append a new list per replay)."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    runs: list[list[tuple[int, int, int]]] = [[]]
    original = RadixCache._delete_leaf

    def record(self, node, *args, **kwargs):
        depth, p = 0, node.parent
        while p is not None:
            depth += len(p.key)
            p = p.parent
        runs[-1].append((depth, node.key.token_ids[0], len(node.key)))
        return original(self, node, *args, **kwargs)

    monkeypatch.setattr(RadixCache, "_delete_leaf", record)
    return runs


@pytest.mark.parametrize("policy", ["lru", "sae", "tlru:1024:512"])
def test_fast_replay_makes_the_same_evictions_as_the_original(tmp_path, monkeypatch, policy):
    """The fast path (prompts as numpy-built ``array('q')``, unique tokens counted per block,
    shared KV slot values: ``simulator.replay(fast=True)``) against the original (the loader's
    Python lists, ``match + arange`` slot values per request): the same hits and the same
    evictions in the same order. Ties in priority break in the same (creation) order in both
    (``simulator._node_hash``), and a replay repeats itself exactly."""
    from sglang_pic.eviction.replay import simulator
    from sglang_pic.eviction.replay.traces import load_mooncake, unique_tokens

    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(_mooncake_lines(80, seed=1)) + "\n")
    lists, compact = load_mooncake(path, compact=False), load_mooncake(path)
    assert [list(r.prompt) for r in compact] == [r.prompt for r in lists]
    seen: set[int] = set()
    for r in lists:
        seen.update(r.prompt)
        seen.update(r.output)
    assert unique_tokens(compact) == len(seen)
    evictions, runs = _record_evictions(monkeypatch), []
    for trace, fast in ((lists, False), (compact, True), (compact, True)):
        evictions.append([])
        res = simulator.replay(trace, policy, capacity=len(seen) // 6, fast=fast)
        runs.append((res.hit_tokens, res.ttft_ms, evictions[-1]))
    assert len(runs[0][2]) > 20, "the capacity must force evictions"
    assert runs[0] == runs[1] == runs[2]


def _tlru_cache(threshold: float, q_hat: float):
    from sglang_pic.eviction.replay.simulator import make_cache

    cache, _ = make_cache("tlru")
    cache.eviction_strategy.threshold = threshold
    cache.eviction_strategy.next_prompt_estimate = q_hat
    return cache


def _insert(cache, tokens: list[int], t: float) -> None:
    from array import array

    import torch
    from sglang.srt.mem_cache import radix_cache as rc
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import RequestContext, using
    from sglang_pic.eviction.replay.simulator import _Clock, _patched, _TimeProxy

    clock = _Clock()
    clock.now = t
    ctx = RequestContext(session_id=None, app_type=None, segments=[(0, "user")],
                         decode_start=len(tokens), prompt_len=len(tokens), now=t)
    with _patched(rc, "time", _TimeProxy(clock)), using(ctx):
        cache.insert(InsertParams(key=RadixKey(array("q", tokens)),
                                  value=torch.tensor(tokens, dtype=torch.int64)))


def _evict_one(cache) -> list[int]:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    before = set(cache.all_values_flatten().tolist())
    cache.evict(EvictParams(num_tokens=1))
    return sorted(before - set(cache.all_values_flatten().tolist()))


@pytest.mark.parametrize("threshold,q_hat,evict_recent", [
    (0, 0, False), (4, 0, True), (4, 2, True), (4, 4, False), (4, 6, False), (2, -2, True)])
def test_tlru_drains_safe_tails_first_then_lru(threshold, q_hat, evict_recent):
    """SGLang's own test case for its ``TLRUStrategy`` (an old 8-token conversation in one node,
    a recent 2-token one), same settings, same expected victims: a conversation is TEL-safe
    when all of it fits the budget ``threshold - q_hat`` of uncached tokens."""
    cache = _tlru_cache(threshold, q_hat)
    _insert(cache, list(range(100, 108)), 1.0)
    _insert(cache, [1, 2], 2.0)
    assert _evict_one(cache) == ([1, 2] if evict_recent else list(range(100, 108)))


def test_tlru_stops_trimming_at_the_budget_and_keeps_the_high_water_mark_across_splits():
    """The tail past ``history - (threshold - q_hat)`` goes first; what is left is protected
    because the history length does not shrink when the tail goes; a split's head inherits it."""
    cache = _tlru_cache(threshold=4, q_hat=0)
    _insert(cache, list(range(10, 14)), 1.0)          # a conversation's first turn ...
    _insert(cache, list(range(10, 18)), 2.0)          # ... and its second: history 8
    _insert(cache, [50, 51, 52, 53, 54, 55], 3.0)     # a newer one, all of it beyond 4 tokens
    assert _evict_one(cache) == list(range(14, 18))   # the old tail, though older than [50..]
    assert _evict_one(cache) == list(range(10, 14))   # then LRU: the rest is protected ...
    cache = _tlru_cache(threshold=4, q_hat=0)
    _insert(cache, list(range(10, 18)), 1.0)
    _insert(cache, [10, 11, 12, 99], 2.0)             # splits [10..18) at 3
    head = cache.root_node.children[10]
    assert len(head.key) == 3 and head.tlru_history_len == 8
    # the split-off tail [13..18) starts at 3 < 8 - 4: protected; the new leaf [99] (history 4,
    # budget 0) is safe, so it goes first although it is the newer one
    assert _evict_one(cache) == [99]
    assert _evict_one(cache) == list(range(13, 18))


def test_block_belady_is_the_token_belady_on_block_traces(tmp_path, monkeypatch):
    """The offline bound indexed per block (``BlockBeladyOracle``, what makes it affordable on
    the 145M-token Mooncake trace) makes the same evictions as the per-token one, and no policy
    beats it."""
    from sglang_pic.eviction.replay import simulator
    from sglang_pic.eviction.replay.traces import load_mooncake, unique_tokens

    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(_mooncake_lines(80, seed=2)) + "\n")
    trace = load_mooncake(path)
    cap = unique_tokens(trace) // 6
    evictions = _record_evictions(monkeypatch)
    block = simulator.replay(trace, "belady", cap)
    monkeypatch.setattr(simulator, "BlockBeladyOracle",
                        lambda trace: simulator.BeladyOracle(trace))
    evictions.append([])
    token = simulator.replay(trace, "belady", cap)
    assert len(evictions[0]) > 20 and evictions[0] == evictions[1]
    assert block.hit_tokens == token.hit_tokens
    for policy in ("lru", "tlru", "sae"):
        assert simulator.replay(trace, policy, cap).hit_tokens <= block.hit_tokens, policy


def test_tlru_settings_are_validated_flags_that_reach_the_policy(monkeypatch, capsys):
    """``--tlru-threshold`` / ``--tlru-next-prompt-estimate``: integers >= 0, only with
    ``--radix-eviction-policy tlru``, listed in ``--help``, handed to the scheduler as variables
    the policy reads when it is built; the replay scripts take ``tlru:<xi>:<q_hat>``."""
    from sglang_pic.eviction.baselines import TLRUStrategy
    from sglang_pic.launcher import serve_conflicts, server_flags
    from sglang_pic.launcher.server_flags import UsageError

    from benchmark.eviction.bench_eviction import check_policies

    def refuse(args):
        serve_conflicts.refuse(*server_flags.parse(args))

    ok = ["--radix-eviction-policy", "tlru", "--tlru-threshold", "1536",
          "--tlru-next-prompt-estimate", "512"]
    refuse(ok)
    given, _ = server_flags.parse(ok)
    env = server_flags.handed_over(given, {})
    assert env == {"SGLANG_PIC_TLRU_THRESHOLD": "1536",
                   "SGLANG_PIC_TLRU_NEXT_PROMPT_ESTIMATE": "512"}
    for bad, message in [
            (["--tlru-threshold", "1024"], "T-LRU eviction flags need --radix-eviction-policy tlru"),
            (["--radix-eviction-policy", "tlru", "--tlru-threshold", "-1"], "out of range"),
            (["--radix-eviction-policy", "tlru", "--tlru-next-prompt-estimate", "lots"],
             "not an integer")]:
        with pytest.raises(UsageError, match=message):
            refuse(bad)
    text = server_flags.help_text()
    assert "--tlru-threshold TOKENS" in text and "--tlru-next-prompt-estimate TOKENS" in text
    assert TLRUStrategy().threshold == 0  # SGLang's defaults without the flags: LRU
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    tlru = TLRUStrategy()
    assert (tlru.threshold, tlru.next_prompt_estimate) == (1536, 512)
    assert check_policies("lru,tlru:1536:512") == ["lru", "tlru:1536:512"]
    for bad in ("tlru:1536", "tlru:x:0", "tlru:0:-5"):
        with pytest.raises(SystemExit):
            check_policies(bad)
        assert "tlru:<xi>:<q_hat>" in capsys.readouterr().err


def _conv_cache():
    """A ``sae`` cache with conversations inferred (``sae-conv``) and a ``serve`` that runs a
    request without session or application type as the trace replay does; returns the
    request's context (its inferred conversation in ``session_id``)."""
    from array import array

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import RequestContext, using
    from sglang_pic.eviction.replay.simulator import make_cache

    cache, _ = make_cache("sae-conv")

    def serve(ids, rid=None):
        ctx = RequestContext(segments=[(0, "user")], prompt_len=len(ids), rid=rid)
        key = RadixKey(array("q", ids), None)
        with using(ctx):
            cache.match_prefix(MatchPrefixParams(key=key))
            cache.insert(InsertParams(key=key, value=torch.arange(len(ids))))
        return ctx

    return cache, serve


def test_inferred_conversation_follows_the_prefix_chain_not_a_shared_opening():
    """Without session ids (``sae-conv``), a request that resends another's whole history and
    goes deeper continues its conversation: same session, the history stays unshared (scored
    with the conversation's index, not as a structural template). Requests branching where
    another one already branched off a block share it: the third user of a template opens a
    conversation of its own and the template becomes structural. Before (no inference) the
    second turn was a second requester and made the first turn's blocks structural."""
    cache, serve = _conv_cache()
    sae = cache.eviction_strategy
    opening, turn1, turn2 = list(range(10, 42)), list(range(100, 164)), list(range(200, 232))
    a = serve(opening + turn1)
    b = serve(opening + turn1 + turn2)
    assert a.session_id is not None and b.session_id == a.session_id
    assert sae.sessions.turn[a.session_id] == 2
    first = cache.root_node.children[next(iter(cache.root_node.children))]
    assert first.sae.queue == "chat" and first.sae.sessions_seen == 1
    assert sae.session_scored(first.sae.queue, first.sae)
    # a template: every request stops where the one before stopped
    template = list(range(1000, 1040))
    t1 = serve(template + [5000, 5001, 5002])
    t2 = serve(template + [6000, 6001])
    t3 = serve(template + [7000, 7001])
    assert t3.session_id not in (t1.session_id, t2.session_id)
    node = cache.root_node.children[1000]
    assert len(node.key) == len(template) and node.sae.queue == "structural"


def test_inferred_conversation_survives_the_eviction_of_its_history():
    """The conversation's last blocks were evicted before its next request: the match stops
    where they began, the ghost set knows whose they were, and the request still continues
    that conversation (its return is counted: a gap observed, a label for the predictor) -
    rather than opening a new one, which taught the predictor that few conversations go on."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache, serve = _conv_cache()
    sae = cache.eviction_strategy
    opening, turn1 = list(range(10, 42)), list(range(100, 164))
    serve(opening + list(range(300, 310)))  # other conversations: the opening is shared
    serve(opening + list(range(400, 410)))
    a = serve(opening + turn1)
    head = cache.root_node.children[10]
    assert head.sae.queue == "structural" and 100 in head.children
    while 100 in head.children:  # evict until the conversation's own blocks are gone
        cache.evict(EvictParams(num_tokens=1))
    assert cache.root_node.children.get(10) is head
    returns = sae.sessions.returns["chat"]
    b = serve(opening + turn1 + list(range(200, 232)))
    assert b.session_id == a.session_id and sae.sessions.returns["chat"] == returns + 1


def test_inferred_conversation_is_kept_for_later_inserts_of_the_request():
    """The server builds a new context for every insert of a request (chunks, the finished
    request): those of a request whose conversation was inferred get it too (by ``rid``)."""
    from sglang_pic.eviction.context import RequestContext

    cache, serve = _conv_cache()
    sae = cache.eviction_strategy
    a = serve(list(range(10, 60)), rid="r1")
    later = RequestContext(segments=[(0, "user")], prompt_len=50, rid="r1")
    sae.guess.resolve(later)
    assert later.session_id == a.session_id is not None


def test_conversation_continues_from_a_block_trace():
    """``sae-conv-ends``'s labels: a request continues when a later one resends its full
    blocks beyond the first (a shared first block alone is a new conversation)."""
    from sglang_pic.eviction.replay.simulator import _conversation_continues
    from sglang_pic.eviction.replay.traces import Request

    def req(t, blocks, n=None):
        n = 512 * len(blocks) if n is None else n
        return Request(t, None, None, [0] * n, [], blocks=tuple(blocks))

    trace = [req(0, [0, 1, 2]), req(1, [0, 5]), req(2, [0, 1, 2, 3]), req(3, [0, 5, 6], 1100)]
    assert _conversation_continues(trace) == [1.0, 1.0, 0.0, 0.0]


def test_sae_conv_ends_on_a_block_trace_reaches_belady_and_reads_told_q(tmp_path):
    """On a conversation-like block trace, ``sae-conv-ends`` (inferred conversations, told which
    go on) does at least as well as LRU and no better than ``belady``; told a ``q`` instead
    (``told_q``, what ``analyze_trace.py`` uses for predictors of a given quality), it uses
    it: told that every conversation ends, it scores differently than told the truth."""
    from sglang_pic.eviction.replay.simulator import _conversation_continues, replay
    from sglang_pic.eviction.replay.traces import load_mooncake, unique_tokens

    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(_mooncake_lines(120, seed=3)) + "\n")
    trace = load_mooncake(path)
    cap = unique_tokens(trace) // 8
    rate = {p: replay(trace, p, cap).summary()["token_hit_rate"]
            for p in ("lru", "belady", "sae-conv-ends")}
    assert rate["lru"] <= rate["sae-conv-ends"] <= rate["belady"] + 1e-9
    ended = replay(trace, "sae-conv-ends", cap, told_q=[0.0] * len(trace)).summary()
    assert ended["token_hit_rate"] != rate["sae-conv-ends"]
    assert sum(_conversation_continues(trace)) > 0


def test_noisy_predictor_ranks_at_the_asked_auc():
    """``analyze_trace.noisy_q``: a calibrated probability from the label plus noise, ranking
    continued requests above the others at the asked ROC AUC."""
    from benchmark.eviction.analyze_trace import auc, noisy_q

    labels = (np.random.default_rng(1).random(20000) < 0.4).astype(float)
    assert auc(labels, labels) == pytest.approx(1.0)
    for target in (0.65, 0.85):
        q = noisy_q(labels, target)
        assert auc(labels, q) == pytest.approx(target, abs=0.01)
        assert q.mean() == pytest.approx(labels.mean(), abs=0.02)  # calibrated on average


def test_results_table_takes_the_best_baseline_by_mean_and_each_seeds_own_for_the_range():
    """``bench_eviction.py --table``: the best baseline of a cell is the one with the best mean
    over the seeds; the per-seed range compares ``sae`` with each seed's own best."""
    from benchmark.eviction.bench_eviction import markdown_table

    def row(policy, seed, rate, ttft):
        return {"workload": "chat", "fraction": 0.1, "policy": policy, "seed": seed,
                "token_hit_rate": rate, "ttft_mean_ms": ttft}

    report = {"policies": ["lru", "gdsf", "sae", "belady"], "rows": [
        row("lru", 0, 0.50, 40), row("lru", 1, 0.30, 60),
        row("gdsf", 0, 0.38, 50), row("gdsf", 1, 0.40, 50),
        row("sae", 0, 0.45, 45), row("sae", 1, 0.41, 49),
        row("belady", 0, 0.70, 20), row("belady", 1, 0.60, 30)]}
    lines = markdown_table(report).splitlines()
    assert lines[0].startswith("| workload | cache | best baseline (mean) | **sae** |")
    assert "| belady |" in lines[0] and "sae w/o predictor" not in lines[0]
    assert lines[2] == ("| chat | 10 % | 0.400 (lru) | **0.430** | +3.0 pp | -5.0 .. +1.0 "
                        "| 0.650 | 50 → 47 ms |")


def test_results_table_refuses_what_is_not_a_report(tmp_path):
    """``bench_eviction.py --table`` on a missing file, a file that is not JSON and JSON of
    another shape: one line on stderr, exit 2, no traceback."""
    import subprocess

    bad_json, other = tmp_path / "bad.json", tmp_path / "other.json"
    bad_json.write_text("not json")
    other.write_text('{"rows": 3}')
    for path, why in ((tmp_path / "none.json", "no such file"),
                      (bad_json, "not a bench_eviction.py report"),
                      (other, "not a bench_eviction.py report")):
        proc = subprocess.run([sys.executable, "-m", "benchmark.eviction.bench_eviction",
                               "--table", str(path)], capture_output=True, text=True, cwd=REPO,
                              timeout=120)
        assert proc.returncode == 2
        assert why in proc.stderr and "Traceback" not in proc.stderr


# ---- session hints from OpenAI fields ----------------------------------------------------------


@pytest.mark.parametrize("body,session", [
    ({"model": "m", "prompt_cache_key": "conv-7", "user": "u"}, "conv-7"),
    ({"model": "m", "safety_identifier": "person-1"}, "person-1"),
    ({"model": "m", "user": "u-2"}, "u-2"),
    ({"model": "m", "prompt_cache_key": "k", "custom_params": {"session_id": "mine"}}, "mine"),
    ({"model": "m", "prompt_cache_key": "k", "custom_params": {"app_type": "agent"}}, "k"),
])
def test_openai_fields_become_the_session_hint(body, session):
    """What the policy reads (``segmentation.client_hints``, through SGLang's sampling params)
    after the front door's rewrite: the first hint field, unless the client named a session."""
    from types import SimpleNamespace

    from sglang_pic.eviction import segmentation
    from sglang_pic.eviction.openai_hints import with_session_hint

    out = with_session_hint(body)
    assert "prompt_cache_key" not in out and "safety_identifier" not in out
    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=out["custom_params"]))
    assert segmentation.client_hints(req)[0] == session
    plain = {"model": "m", "messages": []}
    assert with_session_hint(plain) is plain
    with pytest.raises(ValueError, match="prompt_cache_key"):
        with_session_hint({"prompt_cache_key": ""})


def test_hinted_chat_turns_get_sae_session_index():
    """Turns of one conversation, named only by ``prompt_cache_key``, reach ``sae`` as one
    session: the server's request context (``hooks.request_context``) carries it, and ``sae``
    tracks the session's gaps and scores its blocks by the session index."""
    from types import SimpleNamespace

    from sglang_pic.eviction import hooks
    from sglang_pic.eviction.openai_hints import with_session_hint
    from sglang_pic.eviction.sae import SAEStrategy

    hint = with_session_hint({"prompt_cache_key": "conv-1", "messages": []})["custom_params"]
    sae = SAEStrategy(sample_size=0)
    for turn in range(3):
        req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params=hint),
                              origin_input_ids=list(range(100 + 20 * turn)), rid=f"r{turn}",
                              session_id=None)
        ctx = hooks.request_context(req)
        assert ctx.session_id == "conv-1"
        sae.on_request(ctx, 60.0 * turn)
    assert sae.sessions.last["conv-1"] == 120.0


def _s3fifo_reference_hits(keys: list[int], capacity: int) -> int:
    """S3-FIFO over objects of one size (Yang et al., SOSP'23, Algorithm 1): ``capacity``
    objects, a small FIFO of 10 % of them, a main FIFO with reinsertion (frequency capped at 3)
    and a ghost FIFO of evicted small keys as large as main. Returns the hits."""
    from collections import OrderedDict

    small_cap = max(capacity // 10, 1)
    small: OrderedDict[int, int] = OrderedDict()  # key -> frequency, oldest first
    main: OrderedDict[int, int] = OrderedDict()
    ghost: OrderedDict[int, None] = OrderedDict()
    hits = 0

    def evict_main() -> None:
        while True:
            key, freq = main.popitem(last=False)
            if freq == 0:
                return
            main[key] = freq - 1  # reinserted at the tail

    def evict() -> None:
        if len(small) >= small_cap:
            while small:
                key, freq = small.popitem(last=False)
                if freq > 0:
                    main[key] = 0
                    if len(main) + len(small) > capacity:
                        evict_main()
                else:
                    ghost[key] = None
                    if len(ghost) > capacity - small_cap:
                        ghost.popitem(last=False)
                    return
        else:
            evict_main()

    for key in keys:
        for queue in (small, main):
            if key in queue:
                queue[key] = min(queue[key] + 1, 3)
                hits += 1
                break
        else:
            while len(small) + len(main) >= capacity:
                evict()
            if key in ghost:  # evicted from small lately: straight to main
                del ghost[key]
                main[key] = 0
            else:
                small[key] = 0
    return hits


def test_s3fifo_hits_as_the_reference_s3fifo_on_one_size_objects():
    """On a trace of one-block requests (every block a leaf of the root, all of one size) our
    lazy S3-FIFO over the radix tree hits what the paper's algorithm hits, within a point of the
    requests, on Zipf traffic with one-hit requests whose popular set moves half-way."""
    from sglang_pic.eviction.replay.simulator import replay
    from sglang_pic.eviction.replay.traces import Request

    rng = np.random.default_rng(0)
    block = 16
    popular = rng.zipf(1.2, size=6000) % 400
    # a third one-hit; the popular set moves half-way
    keys = [int(k) + 500 * (i >= 3000) if i % 3 else 10_000 + i for i, k in enumerate(popular)]
    trace = [Request(float(i), None, "single", [100_000 + 64 * k + j for j in range(block)], [],
                     [(0, "user")]) for i, k in enumerate(keys)]
    for objects in (40, 120):
        ours = replay(trace, "s3fifo", capacity=objects * block).hit_tokens / block
        ref = _s3fifo_reference_hits(keys, objects)
        assert abs(ours - ref) <= 0.01 * len(keys), (objects, ours, ref)
