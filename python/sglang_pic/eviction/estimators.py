"""Online estimators behind SAECache's scores; each adapts from observed cache events.

No constant here is a tuned knob of the hot path: the few numbers are priors (what the estimator
says before it has data) or smoothing rates, documented with each class and in
``docs/eviction.md``.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ClassRate:
    """Hit tokens per resident token-second of one kind of block (token type x application).

    This is the reuse rate a block of that kind can expect - a token type's weight ``w_tau`` in
    the unit every SAE index uses (reuses per second), learned from what the cache saw: hits
    on resident blocks, and misses-after-eviction (an evicted block asked for again counts as
    the hit it would have been, with its tokens). Counting against resident token-seconds
    rather than per eviction keeps the estimate free of the policy's own feedback: a kind that
    is evicted early is charged only for the time it was held. Before data, ``prior`` (reuses
    per second) weighs as ``k`` token-seconds; both counts halve every ``period`` inserted
    blocks so the rate follows workload shifts.
    """

    prior: float
    k: float = 20_000.0
    period: int = 2000
    resident: int = 0
    hits: float = 0.0
    token_seconds: float = 0.0
    _t: float | None = None
    _n: int = 0

    def _advance(self, now: float) -> None:
        if self._t is None or now > self._t:
            if self._t is not None:
                self.token_seconds += self.resident * (now - self._t)
            self._t = now

    def add(self, tokens: int, now: float, block: bool = True) -> None:
        """``tokens`` more resident (``block``: a newly inserted block, not a re-typed part)."""
        self._advance(now)
        self.resident += tokens
        if not block:
            return
        self._n += 1
        if self._n >= self.period:
            self._n = 0
            self.hits *= 0.5
            self.token_seconds *= 0.5

    def remove(self, tokens: int, now: float) -> None:
        self._advance(now)
        self.resident = max(self.resident - tokens, 0)

    def hit(self, tokens: int, now: float) -> None:
        self._advance(now)
        self.hits += tokens

    def value(self, now: float | None = None) -> float:
        if now is not None:
            self._advance(now)
        return (self.hits + self.k * self.prior) / (self.token_seconds + self.k)


@dataclass
class InsertRate:
    """Tokens newly cached per second: how fast new requests fill freed room. Both counts
    (tokens, and the time span they were counted over) halve every ``period`` inserted blocks
    so the rate follows the traffic, as ``ClassRate``'s do."""

    period: int = 2000
    tokens: float = 0.0
    start: float | None = None
    _n: int = 0

    def add(self, tokens: int, now: float) -> None:
        if self.start is None:
            self.start = now
        self.tokens += tokens
        self._n += 1
        if self._n >= self.period:
            self._n = 0
            self.tokens *= 0.5
            self.start = now - 0.5 * (now - self.start)

    def value(self, now: float) -> float:
        """Tokens per second (0 before any insert); the span counts as at least a second."""
        if self.start is None:
            return 0.0
        return self.tokens / max(now - self.start, 1.0)


@dataclass
class LogNormalGaps:
    """Online maximum-likelihood log-normal fit of inter-request gaps of one session type.

    The MLE of a log-normal is the mean and (biased) variance of ``log(gap)``; Welford's update
    keeps them exactly, in O(1) per observation. Before ``min_samples`` gaps the prior
    ``(mu0, sigma0)`` is used (median gap ``exp(mu0)`` seconds).
    """

    mu0: float = math.log(30.0)
    sigma0: float = 1.5
    min_samples: int = 8
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def observe(self, gap_s: float) -> None:
        x = math.log(max(gap_s, 1e-3))
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    # the fit with the open gaps counted (``refit_censored``); None: the completed gaps' MLE
    censored_fit: tuple[float, float] | None = None

    @property
    def mu(self) -> float:
        if self.n < self.min_samples:
            return self.mu0
        return self.censored_fit[0] if self.censored_fit else self.mean

    @property
    def sigma(self) -> float:
        if self.n < self.min_samples:
            return self.sigma0
        return self.censored_fit[1] if self.censored_fit else self._completed_sigma()

    def _completed_sigma(self) -> float:
        return max(math.sqrt(self.m2 / self.n), 1e-3)

    def refit_censored(self, open_gaps: list[float], q: float, iterations: int = 5) -> None:
        """Fit with the gaps still open counted: ``open_gaps`` are the silences (s) of the
        sessions whose next request has not come yet, each either a gap longer than its
        silence (odds ``q S(e)``) or a session that has ended (``1 - q``).

        Completed gaps alone are a sample biased short: a long gap completes late, and until
        then only the short ones are seen (early in a chat trace with 45 s median gaps the fit
        said 23 s, and sessions silent for 60-80 s looked ended). EM on that mixture: each
        open gap adds, with the weight of its still-going odds, the moments of a normal
        log-gap truncated below at its log silence. With nothing open, the completed gaps'
        MLE again."""
        if self.n < self.min_samples or not open_gaps:
            self.censored_fit = None
            return
        from scipy.special import ndtr  # standard normal CDF

        # vectorised: it runs in the scheduler, over every session awaiting its next request
        mu, sigma = self.mean, self._completed_sigma()
        xs = np.log(np.maximum(np.asarray(open_gaps, dtype=np.float64), 1e-3))
        sum_x, sum_x2 = self.n * self.mean, self.m2 + self.n * self.mean * self.mean
        for _ in range(iterations):
            z = (xs - mu) / sigma
            tail = np.maximum(ndtr(-z), 1e-12)
            w = q * tail / (q * tail + 1.0 - q)  # P(a gap still going | silent this long)
            lam = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) / tail
            m = mu + sigma * lam  # E[log gap | log gap > x]
            v = sigma * sigma * np.maximum(1.0 + z * lam - lam * lam, 1e-6)
            total = self.n + float(w.sum())
            mu = (sum_x + float((w * m).sum())) / total
            second = float((w * (v + m * m)).sum())
            sigma = max(math.sqrt(max((sum_x2 + second) / total - mu * mu, 0.0)), 1e-3)
        self.censored_fit = (mu, sigma)

    def survival(self, elapsed_s: float) -> float:
        """P(next gap > elapsed): the chance the session is still going to come back."""
        if elapsed_s <= 0:
            return 1.0
        z = (math.log(elapsed_s) - self.mu) / self.sigma
        return 0.5 * math.erfc(z / math.sqrt(2.0))  # standard normal tail, stdlib only

    def quantile(self, q: float, completed_only: bool = False) -> float:
        """Gap (seconds) below which a fraction ``q`` of gaps fall; ``completed_only``: by the
        completed gaps' fit, without the open ones."""
        from scipy.special import ndtri  # inverse standard normal CDF

        if completed_only and self.n >= self.min_samples:
            return math.exp(self.mean + self._completed_sigma() * float(ndtri(q)))
        return math.exp(self.mu + self.sigma * float(ndtri(q)))


@dataclass
class ContinuationModel:
    """P(a session sends another request | this request), learned online.

    The session predictor for requests whose session has no history yet (and every later
    request): a logistic model over cheap request features (``features``), trained by SGD on
    labels the traffic itself provides - 1 when the session's next request arrives, 0 when none
    came within a high quantile of its application's gap distribution (the caller's choice:
    ``sessions.END_QUANTILE``). The seed uses the
    model's final hidden state as features; SGLang's scheduler does not expose it to the radix
    cache, so this is the fallback the seed describes. Starts at ``prior`` for every request.
    """

    prior: float = 0.7
    lr: float = 0.05
    lr_decay: float = 100.0  # step size lr / sqrt(1 + updates / lr_decay), at least lr_floor
    lr_floor: float = 0.005
    l2: float = 1e-4
    weights: list[float] = field(default_factory=list)
    updates: int = 0

    N_FEATURES = 8

    def __post_init__(self) -> None:
        if not self.weights:
            self.weights = [math.log(self.prior / (1 - self.prior))] + [0.0] * (self.N_FEATURES - 1)

    @staticmethod
    def features(prompt_len: int, turns: int, app_type: str, has_system: bool) -> list[float]:
        """Bias, log prompt length, turn-count bucket (1, 2, 3-4, 5+; one-hot against 3-4: how
        likely a session goes on depends on how long it already is), application type, system
        prompt."""
        return [1.0, math.log1p(prompt_len) / 10.0, float(turns <= 1), float(turns == 2),
                float(turns >= 5), float(app_type == "agent"), float(app_type == "single"),
                float(has_system)]

    def predict(self, x: list[float]) -> float:
        z = sum(w * v for w, v in zip(self.weights, x, strict=True))
        return 1.0 / (1.0 + math.exp(-min(max(z, -30.0), 30.0)))

    def update(self, x: list[float], label: float) -> None:
        err = self.predict(x) - label
        # a step size that decays as labels accumulate (to a floor that keeps it adapting):
        # with a constant one the weights drift between a session's requests, and sessions
        # that are alike would be ranked apart by that noise
        lr = max(self.lr / math.sqrt(1.0 + self.updates / self.lr_decay), self.lr_floor)
        self.weights = [w - lr * (err * v + self.l2 * w)
                        for w, v in zip(self.weights, x, strict=True)]
        self.updates += 1


@dataclass
class PositionDecay:
    """``1 - (o / o_max)^gamma`` for the structural queue, with gamma fitted online.

    We record, for hits and for all inserted blocks, their relative offset ``o / o_max`` in
    buckets. The hit rate per bucket ``h(x)`` is modelled as ``h(0) (1 - x^gamma)``; gamma is
    the least-squares fit of ``log(1 - h(x)/h(0))`` against ``log x`` over populated buckets.
    A large gamma means only the tail of prompts is cold; a small one, that hits fade early.
    """

    gamma: float = 1.0
    buckets: int = 10
    hits: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)
    _since_fit: int = 0

    def __post_init__(self) -> None:
        self.hits = [0.0] * self.buckets
        self.seen = [0.0] * self.buckets

    def _bucket(self, rel: float) -> int:
        return min(int(rel * self.buckets), self.buckets - 1)

    def observe(self, rel_offset: float, hit: bool) -> None:
        b = self._bucket(min(max(rel_offset, 0.0), 1.0))
        self.seen[b] += 1
        self.hits[b] += float(hit)
        self._since_fit += 1
        if self._since_fit >= 256:
            self.fit()

    def fit(self) -> float:
        self._since_fit = 0
        rates = [h / s if s >= 4 else None for h, s in zip(self.hits, self.seen, strict=True)]
        if rates[0] is None or rates[0] <= 0:
            return self.gamma
        xs, ys = [], []
        for i, r in enumerate(rates[1:], start=1):
            if r is None:
                continue
            frac = 1.0 - min(r / rates[0], 0.999)
            if frac <= 0:
                continue
            xs.append(math.log((i + 0.5) / self.buckets))
            ys.append(math.log(frac))
        if len(xs) < 2:
            return self.gamma
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var <= 0:
            return self.gamma
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
        self.gamma = min(max(slope, 0.1), 10.0)
        # forget slowly (an effective window of ~25K observations) to follow workload shifts
        self.hits = [h * 0.99 for h in self.hits]
        self.seen = [s * 0.99 for s in self.seen]
        return self.gamma

    def value(self, rel_offset: float) -> float:
        rel = min(max(rel_offset, 0.0), 1.0)
        return max(1.0 - rel**self.gamma, 1e-3)


def softmax_weights(scores: dict[str, float], temperature: float) -> dict[str, float]:
    """Queue weights alpha_q from hit tokens per allocated capacity, with a temperature."""
    if not scores:
        return {}
    t = max(temperature, 1e-6)
    m = max(scores.values())
    exps = {k: math.exp((v - m) / t) for k, v in scores.items()}
    z = sum(exps.values())
    n = len(scores)
    # scaled so that equal scores give alpha = 1 for every queue
    return {k: n * e / z for k, e in exps.items()}


class SessionIndex:
    """Reuse index of a session's cached blocks after ``e`` seconds of silence.

    A session's context is reused when its next request arrives: with probability ``q`` there is
    one, after a log-normal gap (survival ``S``). Holding the context from ``e`` to ``e + h``
    earns ``q (S(e) - S(e + h))`` expected reuses and costs ``int_e^{e+h} (q S(u) + 1 - q) du``
    expected seconds of occupancy (a session that has ended still occupies the cache). The
    index is the best ratio over all horizons ``h`` (a Gittins-style index):

        index(e) = max_h  q (S(e) - S(e+h)) / int_e^{e+h} (q S(u) + 1 - q) du     [reuses / s]

    Maximising over ``h`` matters because a log-normal's hazard first rises: a block that was
    used a second ago is worth keeping for the return that is likely a minute later, which a
    ratio at any single horizon would miss or overstate. Being in reuses per second, it
    compares directly with the other queues' indices (a shared block's ``1 / reuse interval``,
    a kind's ``ClassRate``) - no per-queue weights are needed to make them comparable.

    Tabulated on a log grid of ``e`` (1/100 to 1000 medians) per (fit, ``q`` rounded to 0.05)
    and interpolated in ``log e``; a table is rebuilt only when its fit has moved.
    """

    GRID = np.exp(np.linspace(math.log(1e-2), math.log(1e3), 241))

    def __init__(self) -> None:
        self._tables: dict[tuple[int, float], tuple[tuple[float, float], list[float],
                                                     list[float]]] = {}

    def value(self, gaps: LogNormalGaps, q: float, elapsed_s: float) -> float:
        q = min(max(round(q * 20) / 20, 0.05), 1.0)
        log_e, index = self._table(gaps, q)
        x = math.log(max(elapsed_s, 1e-9))
        i = bisect.bisect_left(log_e, x)  # plain lists: a numpy call per lookup costs ~10x
        if i == 0 or i == len(index):
            return index[min(i, len(index) - 1)]
        f = (x - log_e[i - 1]) / (log_e[i] - log_e[i - 1])  # linear in log(e)
        return index[i - 1] + f * (index[i] - index[i - 1])

    def _table(self, gaps: LogNormalGaps, q: float) -> tuple[list[float], list[float]]:
        fit = (round(gaps.mu, 2), round(gaps.sigma, 2))
        key = (id(gaps), q)
        got = self._tables.get(key)
        if got is not None and got[0] == fit:
            return got[1], got[2]
        from scipy.special import ndtr  # standard normal CDF

        mu, sigma = fit[0], max(fit[1], 1e-2)
        e = self.GRID * math.exp(mu)
        survival = ndtr(-(np.log(e) - mu) / sigma)
        occupancy = q * survival + (1 - q)
        cum = np.concatenate(([0.0], np.cumsum(0.5 * (occupancy[1:] + occupancy[:-1])
                                                * np.diff(e))))
        gain = q * (survival[:, None] - survival[None, :])  # [from e_i, until e_j]
        cost = cum[None, :] - cum[:, None]
        ratio = np.where(np.triu(np.ones_like(cost, dtype=bool), 1), gain / np.maximum(cost, 1e-12),
                         0.0)
        index = ratio.max(axis=1)
        index[-1] = index[-2]
        self._tables[key] = (fit, np.log(e).tolist(), index.tolist())
        return self._tables[key][1], self._tables[key][2]
