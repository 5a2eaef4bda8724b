"""What a block trace (Mooncake's conversation trace) offers an eviction policy, on the part
before the held-out split only: which requests a later one continues, what predicts it, and
how good a predictor of it would have to be.

    .venv/bin/python -m benchmark.eviction.analyze_trace [--trace FILE] [--no-replay]

1. An offline pass over the requests (block level, as an infinite cache sees them): request B
   *continues* A when B resends A's full blocks beyond the first one and A is the latest request
   through the deepest of them (``simulator._conversation_continues``, the labels
   ``sae-conv-ends`` is told). Per request: its turn in its conversation, the gap since the
   conversation's previous request, prompt, output and new lengths, the depth it resends.
   Printed: continuation odds by turn and by prompt length, the gaps to the next request,
   and how well each feature ranks the continued requests (ROC AUC), alone and in a logistic
   model (fitted on the first 60 % of the part, tested on the rest and on the held-out part).
2. Replays of the part before the split (cache sizes from the whole trace's unique tokens, as
   ``replay_trace.py``) of ``sae-conv-ends`` told a ``q`` per request of a chosen quality
   (``simulator.replay(told_q=...)``): the true label plus Gaussian noise, turned into a
   calibrated probability, at ROC AUC 0.75 / 0.85 / 0.95; the logistic model's probability;
   the model's top share (as many as are continued) as certain returns, the rest as ends.

Writes ``benchmark/results/eviction_mooncake_analysis.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
from sglang_pic.eviction.replay.simulator import resent_blocks

from benchmark import description
from benchmark.eviction.replay_trace import TRACE, _register

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

OUT = REPO / "benchmark" / "results" / "eviction_mooncake_analysis.json"
BLOCK = 512


def auc(labels: np.ndarray, score: np.ndarray) -> float:
    """ROC AUC of ``score`` ranking the 1-labels above the 0-labels (ties count half)."""
    from scipy.stats import rankdata

    r = rankdata(score)
    pos = labels.sum()
    neg = len(labels) - pos
    return float((r[labels == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def request_features(trace) -> dict[str, np.ndarray]:
    """Per request what a server could know when it arrives (and its output length)."""
    n = len(trace)
    turn = np.ones(n)
    gap_prev = np.full(n, np.nan)
    resent = np.zeros(n)
    last_use: dict[int, int] = {}
    for i, req in enumerate(trace):
        k = resent_blocks(req, last_use, BLOCK)
        resent[i] = k
        if k >= 2:
            parent = last_use[req.blocks[k - 1]]
            turn[i] = turn[parent] + 1
            gap_prev[i] = req.t - trace[parent].t
        for h in req.blocks:
            last_use[h] = i
    plen = np.array([len(r.prompt) for r in trace], dtype=float)
    return {"t": np.array([r.t for r in trace]), "turn": turn, "gap_prev": gap_prev,
            "resent_blocks": resent, "prompt_len": plen,
            "output_len": np.array([len(r.output) for r in trace], dtype=float),
            "new_tokens": np.maximum(plen - BLOCK * resent, 0)}


def design(f: dict[str, np.ndarray]) -> np.ndarray:
    turn, gap = f["turn"], f["gap_prev"]
    return np.stack([np.ones(len(turn)), np.log1p(f["prompt_len"]) / 10, turn == 1, turn == 2,
                     (turn >= 3) & (turn < 5), turn >= 5, np.log1p(np.nan_to_num(gap)) / 6,
                     np.isnan(gap), np.log1p(f["new_tokens"]) / 10,
                     np.log1p(f["output_len"]) / 7], 1).astype(float)


def logistic(x: np.ndarray, y: np.ndarray, steps: int = 3000, lr: float = 1.0) -> np.ndarray:
    w = np.zeros(x.shape[1])
    for _ in range(steps):
        p = 1 / (1 + np.exp(-x @ w))
        w -= lr * x.T @ (p - y) / len(y)
    return w


def noisy_q(labels: np.ndarray, target_auc: float, seed: int = 0) -> np.ndarray:
    """A calibrated ``P(continued)`` from the label plus N(0, s^2) noise, ``s`` chosen so that
    the noisy score ranks at ``target_auc`` (AUC = Phi(1 / (s sqrt 2)))."""
    from scipy.stats import norm

    s = 1 / (math.sqrt(2) * norm.ppf(target_auc))
    score = labels + np.random.default_rng(seed).normal(0, s, len(labels))
    prior = labels.mean()
    a = prior * norm.pdf((score - 1) / s)
    b = (1 - prior) * norm.pdf(score / s)
    return a / (a + b)


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--heldout", type=float, default=0.4)
    ap.add_argument("--fractions", default="0.05,0.1,0.2")
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    from sglang_pic.eviction.replay.simulator import _conversation_continues, replay
    from sglang_pic.eviction.replay.traces import load_mooncake, unique_tokens

    trace = load_mooncake(args.trace)
    labels = np.array(_conversation_continues(trace))
    f = request_features(trace)
    start, end = trace[0].t, trace[-1].t
    split_t = start + (1 - args.heldout) * (end - start)
    first = f["t"] < split_t
    n_first = int(first.sum())
    y = labels[first]
    report: dict = {"benchmark": "eviction_mooncake_analysis", "trace": args.trace,
                    "requests_before_split": n_first, "split_t": split_t,
                    "continued_share": float(y.mean()), "time_utc": time.strftime(
                        "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"first {n_first} requests (t < {split_t:.0f} s): {y.mean():.3f} continued")

    turns = {}
    for lo, hi in ((1, 2), (2, 3), (3, 4), (4, 6), (6, 10), (10, 10**9)):
        m = first & (f["turn"] >= lo) & (f["turn"] < hi)
        turns[f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+"] = [int(m.sum()),
                                                                float(labels[m].mean())]
    lengths = {}
    for lo, hi in ((1024, 4096), (4096, 8192), (8192, 16384), (16384, 32768), (32768, 10**9)):
        m = first & (f["prompt_len"] >= lo) & (f["prompt_len"] < hi)
        lengths[f"{lo}-{hi}"] = [int(m.sum()), float(labels[m].mean())]
    print("odds by turn (n, P):", turns)
    print("odds by prompt length (n, P):", lengths)
    # gaps from a continued request to its conversation's next one
    nxt = np.full(len(trace), np.nan)
    gp = f["gap_prev"]
    has_parent = ~np.isnan(gp)
    # the next request's gap_prev is this request's gap to it: pair them by parent
    last_use: dict[int, int] = {}
    for i, req in enumerate(trace):
        k = int(f["resent_blocks"][i])
        if k >= 2:
            nxt[last_use[req.blocks[k - 1]]] = gp[i]
        for h in req.blocks:
            last_use[h] = i
    g = nxt[first & ~np.isnan(nxt)]
    logg = np.log(np.maximum(g, 0.5))
    pair = first & has_parent & ~np.isnan(nxt)
    report.update(odds_by_turn=turns, odds_by_prompt_len=lengths, next_gap_s={
        "p10": float(np.percentile(g, 10)), "p50": float(np.median(g)),
        "p90": float(np.percentile(g, 90)), "lognormal_sigma": float(logg.std()),
        "log_corr_with_previous_gap": float(np.corrcoef(np.log(gp[pair] + 1),
                                                        np.log(nxt[pair] + 1))[0, 1])})
    print("next gap:", report["next_gap_s"])

    aucs = {}
    for name in ("turn", "resent_blocks", "gap_prev", "prompt_len", "output_len", "new_tokens"):
        a = auc(y, np.nan_to_num(f[name][first], nan=-1))
        aucs[name] = max(a, 1 - a)  # either direction
    x = design(f)
    idx = np.where(first)[0]
    fit, test = idx[: int(0.6 * len(idx))], idx[int(0.6 * len(idx)):]
    w = logistic(x[fit], labels[fit])
    aucs["logistic_test"] = auc(labels[test], x[test] @ w)
    aucs["logistic_heldout"] = auc(labels[~first], x[~first] @ w)
    report["auc"] = aucs
    print("AUC:", {k: round(v, 3) for k, v in aucs.items()})

    if not args.no_replay:
        _register()
        uniq = unique_tokens(trace)
        part = trace[:n_first]
        p_model = 1 / (1 + np.exp(-x[:n_first] @ w))
        top = (p_model > np.quantile(p_model, 1 - y.mean())).astype(float)
        told = {f"noisy_auc_{a}": noisy_q(y, a) for a in (0.75, 0.85, 0.95)}
        told.update(logistic=p_model, logistic_top=top, truth=y)
        rows = []
        for frac in (float(v) for v in args.fractions.split(",")):
            cap = max(int(uniq * frac), 1024)
            for name, q in told.items():
                res = replay(part, "sae-conv-ends", cap, told_q=q.tolist())
                rate = res.hit_tokens / max(res.prompt_tokens, 1)
                rows.append({"fraction": frac, "told": name, "token_hit_rate": rate})
                print(f"{frac:>5.0%} sae-conv-ends told {name:<16} {rate:.4f}", flush=True)
        report["replays_first_part"] = rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
