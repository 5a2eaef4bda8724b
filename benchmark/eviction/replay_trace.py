"""Replay a real block trace (Mooncake FAST'25 conversation trace) through SGLang's RadixCache
with every eviction policy, at cache sizes relative to the trace and at deployment sizes.

    .venv/bin/python -m benchmark.eviction.replay_trace [--trace FILE] [--workers 2]
    .venv/bin/python -m benchmark.eviction.replay_trace --tune-tlru      # on the first 60 % only

Sizes: 5 / 10 / 20 / 40 % of the trace's unique tokens (``--fractions``) and absolute token
budgets (``--tokens``; default 0.5M, an H200's KV pool for an 8B model after weights, and
4.5M, that pool plus a ~4M-token HiCache host tier replayed as *one* tier: the simulator has a
single ``RadixCache`` and does not model HiCache's two tiers, its write-through or load-back
cost, so 4.5M is an upper bound for that deployment; ``two_tier.py`` replays the two tiers
through SGLang's ``HiRadixCache``).

Held-out: nothing is tuned on the last ``--heldout`` (40 %) of the trace *by time*. Every
replay runs the whole trace; hits are counted for the whole trace, for requests before the
split (``first_hit_rate``, what tuning may look at) and at or after it (``heldout_hit_rate``).
``--tune-tlru`` replays only the requests before the split, for a grid of T-LRU settings.

Replays run in ``--workers`` processes (one policy x size each). Writes
``benchmark/results/eviction_replay_mooncake.json`` (machine, versions, config, one row per
policy and size) unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import time
from pathlib import Path

from benchmark import description
from benchmark.eviction.bench_eviction import SGLANG_POLICIES, check_policies

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")
OUT = REPO / "benchmark" / "results" / "eviction_replay_mooncake.json"
FRACTIONS = (0.05, 0.1, 0.2, 0.4)
DEPLOYMENT_TOKENS = (500_000, 4_500_000)
POLICIES = SGLANG_POLICIES + ("gdsf", "s3fifo", "tlru", "sae", "auto")
# T-LRU's tuning grid: only xi - Q_hat matters (budget = max(L + Q_hat - xi, 0)); Q_hat is one
# 512-token block of next prompt and xi = Q_hat + this many tokens of uncached prefill allowed
TLRU_GRID_SLACK = (256, 512, 1024, 2048, 4096, 8192)
TLRU_Q_HAT = 512

_trace: list = []  # the trace, set in the parent before the workers fork


def _register() -> None:
    """Our policies in SGLang's table and the hooks on RadixCache, as the plugin does in a
    server; done once in the parent, which the workers fork from."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_pic.plugin import register_feature

    register_feature("eviction")
    HookRegistry.apply_hooks()


def _run(job: tuple[str, str, int, float | None, int]) -> dict:
    from sglang_pic.eviction.replay.simulator import replay

    policy, size, cap, split_t, n = job
    res = replay(_trace[:n], policy, cap, split_t=split_t).summary()
    res.update(size=size, trace_requests=n)
    return res


def _sizes(args, uniq: int) -> list[tuple[str, int]]:
    out = [(f"{int(round(f * 100))}pct", max(int(uniq * f), 1024)) for f in args.fractions]
    out += [(f"{t / 1e6:g}M_tokens", t) for t in args.tokens]
    return out


def environment() -> dict:
    import sglang
    import torch

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], text=True,
                                capture_output=True).stdout.strip()
    except OSError:
        commit = None
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "sglang": sglang.__version__,
            "torch": torch.__version__, "git_commit": commit,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated; tlru:<xi>:<q_hat> is T-LRU at those settings "
                         "(tokens; tlru alone: the replay's, baselines.TLRU_TUNED)")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                    help="cache sizes as fractions of the trace's unique tokens")
    ap.add_argument("--tokens", default=",".join(map(str, DEPLOYMENT_TOKENS)),
                    help="absolute cache sizes in tokens ('' for none)")
    ap.add_argument("--heldout", type=float, default=0.4,
                    help="the last this share of the trace's time span is held out")
    ap.add_argument("--limit", type=int, default=None, help="replay the first N requests only")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--tune-tlru", action="store_true",
                    help="replay the part before the held-out split with a grid of T-LRU "
                         "settings (tlru:xi:q_hat) and print the best")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    policies = check_policies(args.policies)
    args.fractions = [float(x) for x in args.fractions.split(",") if x]
    args.tokens = [int(float(x)) for x in args.tokens.split(",") if x]

    from sglang_pic.eviction.baselines import TLRU_TUNED
    from sglang_pic.eviction.replay.traces import load_mooncake, unique_tokens

    global _trace
    _register()
    t0 = time.perf_counter()
    trace = load_mooncake(args.trace)
    if args.limit:
        trace = trace[: args.limit]
    _trace = trace
    load_s = time.perf_counter() - t0
    uniq = unique_tokens(trace)
    start, end = trace[0].t, trace[-1].t
    split_t = start + (1.0 - args.heldout) * (end - start)
    n_first = sum(r.t < split_t for r in trace)
    prompt_tokens = sum(len(r.prompt) for r in trace)
    print(f"{len(trace)} requests, {prompt_tokens} prompt tokens, {uniq} unique tokens, "
          f"held out from t={split_t:.0f}s: {len(trace) - n_first} requests; loaded in "
          f"{load_s:.1f}s", flush=True)
    sizes = _sizes(args, uniq)
    if args.tune_tlru:
        policies = [f"tlru:{TLRU_Q_HAT + d}:{TLRU_Q_HAT}" for d in TLRU_GRID_SLACK] + ["lru"]
        jobs = [(p, size, cap, None, n_first) for size, cap in sizes for p in policies]
    else:
        jobs = [(p, size, cap, split_t, len(trace)) for size, cap in sizes for p in policies]
    # longest first (sae is the slowest), so the two workers finish together
    jobs.sort(key=lambda j: (j[0] != "sae", -j[2]))
    rows = []
    t_start = time.perf_counter()
    ctx = mp.get_context("fork")  # the workers share the loaded trace copy-on-write
    # a fresh fork per replay: each starts from the parent's state (no tree left by the last)
    with ctx.Pool(args.workers, maxtasksperchild=1) as pool:
        for res in pool.imap_unordered(_run, jobs):
            rows.append(res)
            extra = (f" first {res['first_hit_rate']:.4f} heldout {res['heldout_hit_rate']:.4f}"
                     if "heldout_hit_rate" in res else "")
            print(f"[{time.perf_counter() - t_start:6.0f}s] {res['size']:>11} "
                  f"{res['policy']:<16} hit {res['token_hit_rate']:.4f}{extra} "
                  f"({res['wall_s']:.0f}s)", flush=True)
    total_s = time.perf_counter() - t_start
    for r in rows:
        r.pop("phase_hit_rates", None)
    # tuning replays only the part before the split: its token hit rate is that part's
    _print_table(rows, sizes, policies, "token_hit_rate" if args.tune_tlru else None)
    report = {
        "benchmark": "eviction_replay_tlru_tuning" if args.tune_tlru else "eviction_replay",
        "environment": environment(),
        "config": {"trace": args.trace, "requests": len(trace), "prompt_tokens": prompt_tokens,
                   "unique_tokens": uniq, "heldout_fraction_of_time": args.heldout,
                   "split_t": split_t, "requests_before_split": n_first,
                   "sizes": dict(sizes), "policies": policies, "workers": args.workers,
                   "simulator": "SGLang 0.5.17 RadixCache, page_size 1, one tier, trace clock",
                   "tlru_replay": TLRU_TUNED,
                   "load_s": load_s, "replay_wall_s": total_s},
        "rows": sorted(rows, key=lambda r: (r["capacity"], r["policy"])),
    }
    out = Path(args.out) if args.out else (
        Path(os.environ.get("TMPDIR", "/tmp")) / "eviction_tlru_tuning.json" if args.tune_tlru
        else OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"replays took {total_s:.0f}s on {args.workers} workers; wrote {out}")


ONLINE_BASELINES = ("lru", "gdsf", "s3fifo", "tlru", "slru", "lfu", "fifo", "priority")
"""What ``auto`` and ``sae`` are compared with: policies a server can run (never the offline
``belady`` nor the ``sae-*`` oracles and ablations)."""


def distance_to_best(by: dict, sizes, policies, policy: str, key: str) -> list[float]:
    """``policy``'s ``key`` minus the best online baseline's, in points, per size (NaN where a
    replay is missing)."""
    out = []
    for s, _ in sizes:
        base = [by[s, p][key] for p in policies if p in ONLINE_BASELINES and (s, p) in by]
        out.append(100 * (by[s, policy][key] - max(base)) if base and (s, policy) in by
                   else float("nan"))
    return out


def _print_table(rows: list[dict], sizes, policies, metric: str | None) -> None:
    """Token hit rate per policy and size (whole / held-out, or ``metric``); ``auto``'s and
    ``sae``'s distance to the best online baseline (``ONLINE_BASELINES``), and its worst cell."""
    by = {(r["size"], r["policy"]): r for r in rows}
    for key in ([metric] if metric else ["token_hit_rate", "heldout_hit_rate"]):
        print(f"\n{key}")
        print(f"{'policy':<18}" + "".join(f"{s:>12}" for s, _ in sizes))
        for p in policies:
            print(f"{p:<18}" + "".join(
                f"{by[s, p][key]:>12.4f}" if (s, p) in by else f"{'-':>12}" for s, _ in sizes))
        for policy in [p for p in policies if p.startswith(("auto", "sae"))]:
            if policy in policies:
                gains = distance_to_best(by, sizes, policies, policy, key)
                print(f"{policy + ' - best (pp)':<18}" + "".join(f"{g:>+12.2f}" for g in gains)
                      + f"   worst {min(gains):+.2f}")


if __name__ == "__main__":
    main()
