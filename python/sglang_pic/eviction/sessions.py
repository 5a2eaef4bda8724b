"""SAE's session model: when each session last sent a request, how far it has got, how long its
application's sessions stay silent between requests, and the chance it sends another.

Why apart from the policy (``sae.SAEStrategy``): the policy scores blocks; what it asks of a
session is two numbers - how long it has been silent and ``q``, the chance it comes back - and
the gap distribution of its application, which ``estimators.SessionIndex`` turns into reuses
per second. How those are learnt online is this module:

- gaps: per application type a log-normal fitted to the gaps between a session's requests
  (``estimators.LogNormalGaps``), with the gaps still open counted (``censored_gaps``) every
  ``GAP_REFIT_EVERY`` completed ones;
- ``q``: the session predictor's output for the session's last request
  (``estimators.ContinuationModel``), labelled 1 when the session comes back and 0 once it has
  been silent past its application's ``END_QUANTILE`` gap; with the predictor off, the share of
  the application's requests that were a return.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from .context import APP_TYPES, RequestContext
from .estimators import ContinuationModel, LogNormalGaps

# Priors for the session-gap log-normals: chat users think for ~a minute, agents call back fast.
GAP_PRIORS = {"chat": (math.log(60.0), 1.2), "agent": (math.log(5.0), 1.2),
              "single": (math.log(600.0), 1.5)}
# A session with no request for this quantile of its application's gaps has ended (label 0 for
# the session predictor).
END_QUANTILE = 0.99
# the gap fit counts the open gaps (``_refit_gaps``) after every this many completed ones
GAP_REFIT_EVERY = 16
TRACKED_SESSIONS = 1 << 17


class SessionModel:
    def __init__(self, use_predictor: bool) -> None:
        self.gaps = {a: LogNormalGaps(*GAP_PRIORS[a]) for a in APP_TYPES}
        self.last: OrderedDict[str, float] = OrderedDict()  # session -> its last request's time
        self.turn: dict[str, int] = {}  # requests seen per session
        # per application type: requests with a session, and how many of them were a return
        self.requests = dict.fromkeys(APP_TYPES, 0)
        self.returns = dict.fromkeys(APP_TYPES, 0)
        self.continuation = ContinuationModel()
        # the gap fits count the open gaps (``_refit_gaps``); off: completed gaps only (the
        # replay's sae-uncensored ablation)
        self.censored_gaps = True
        # per application type (each has its own silence cutoff): session -> (features of its
        # last request, its time), oldest first
        self.pending: dict[str, OrderedDict[str, tuple[list[float], float]]] = {
            a: OrderedDict() for a in APP_TYPES}
        self.p: dict[str, float] = {}  # P(another request) after the session's last one
        # q from the predictor (per session) or, off, per application
        self.use_predictor = use_predictor

    def continuation_odds(self, app: str, session_id: str) -> float:
        """``q``: the chance that the session sends another request."""
        if self.use_predictor and session_id in self.p:
            return self.p[session_id]
        return self.return_rate(app)

    def return_rate(self, app: str) -> float:
        """The share of the application's requests that were a return, from the predictor's
        prior weighing as 10 requests."""
        prior = self.continuation.prior
        return (self.returns[app] + 10 * prior) / (self.requests[app] + 10)

    def silence(self, session_id: str, now: float) -> float:
        """Seconds since the session's last request (0 for one not tracked)."""
        return now - self.last.get(session_id, now)

    def turns(self, session_id: str | None) -> int:
        """The session's requests so far."""
        return self.turn.get(session_id, 0)

    def observe(self, ctx: RequestContext, now: float, inferred: bool) -> None:
        """A request of session ``ctx.session_id`` (``inferred``: a conversation guessed from
        the prefix chain, whose prompt holds one ``user`` segment of raw token ids)."""
        sid, app = ctx.session_id, ctx.app_type or "chat"
        self._end_sessions(now)
        for queue in self.pending.values():
            prev = queue.pop(sid, None)
            if prev is not None:  # the session came back: its last request was not its final one
                self.continuation.update(prev[0], 1.0)
        types = [t for _, t in ctx.segments]
        # how long the session already is: its user turns in the prompt; for an inferred
        # conversation its requests so far
        turns = types.count("user")
        if inferred:
            turns = max(turns, self.turn.get(sid, 0) + 1)
        x = ContinuationModel.features(ctx.prompt_len, turns, app, "system" in types)
        self.pending[app][sid] = (x, now)
        if len(self.pending[app]) > TRACKED_SESSIONS:
            # the oldest waits for a label we can no longer afford to track: dropped unlabelled
            self.pending[app].popitem(last=False)
        self.p[sid] = self.continuation.predict(x)
        self.requests[app] += 1
        self.turn[sid] = self.turn.get(sid, 0) + 1
        last = self.last.pop(sid, None)
        if last is not None:
            self.returns[app] += 1
            self.gaps[app].observe(now - last)
            if self.censored_gaps and self.gaps[app].n % GAP_REFIT_EVERY == 0:
                self._refit_gaps(app, now)
        self.last[sid] = now
        if len(self.last) > TRACKED_SESSIONS:
            old, _ = self.last.popitem(last=False)
            self.p.pop(old, None)
            self.turn.pop(old, None)

    def _refit_gaps(self, app: str, now: float) -> None:
        """The gap fit of ``app`` with its sessions' open gaps counted
        (``LogNormalGaps.refit_censored``): those awaiting their next request and not yet
        labelled ended."""
        open_gaps = [now - t for _, t in self.pending[app].values() if now > t]
        self.gaps[app].refit_censored(open_gaps, self.return_rate(app))

    def _end_sessions(self, now: float) -> None:
        """Sessions silent for longer than almost any gap of their kind have ended: label 0.
        The cutoff is the completed gaps' quantile: by the fit with open gaps counted it would
        grow with the sessions it keeps waiting for, and a tight host tier would fill with
        ended sessions."""
        for app, queue in self.pending.items():
            if not queue:
                continue
            cutoff = self.gaps[app].quantile(END_QUANTILE, completed_only=True)
            while queue:
                x, t = next(iter(queue.values()))
                if now - t <= cutoff:
                    break
                queue.popitem(last=False)
                self.continuation.update(x, 0.0)
