"""The ParisKV top-k kernel's search settings, timed side by side on one GPU.

Each decode step's selection ends with ``_topk_kernel``: one program per KV head and slot finds
the ``K``-th best of ``C`` rerank estimates and writes the ids above it. At batch 1 it is a
chain of block-wide reductions, so its time is latency: 12.3 µs a call at 4096 candidates in
the server's step on the H200 (a 4-pass radix select with ``tl.histogram`` took 36 µs and was
reverted). The search counts ``T`` thresholds per reduction (``T = 1``: a bisection; ``T``
counts packed into one int64 sum narrow the interval ``T + 1``-fold per round) and runs at
``num_warps`` warps. This times every ``(T, warps)`` of ``--thresholds`` x ``--warps`` as a CUDA
graph of ``--launches`` launches (the server replays it in a graph too), rounds alternating
the order of the settings, checks each against ``torch.topk`` and prints which is fastest.
``Selector`` takes ``TOPK_THRESHOLDS`` and ``topk_warps`` (``sglang_pic_kernel.pariskv.select``):
set them from this table.

    python3 -m benchmark.kernels.bench_topk [--candidates 4096] [--rounds 5] [--out DIR]
    .venv/bin/python -m benchmark.kernels.bench_topk --smoke   # CPU, interpreter, tiny

Prints a table; writes ``pariskv_topk_<gpu>.json`` (machine, versions, config, raw samples in
µs per launch) into ``--out`` (default ``benchmark/results``; the smoke's temp folder with
``--smoke``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmark import description


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--candidates", type=int, default=4096, help="C: estimates per KV head")
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4,
                    help="sequences in the grid (the server's graph for one request: 4 slots)")
    ap.add_argument("--active", type=int, default=1, help="slots holding estimates (the rest "
                    "are idle, all -inf, as the server's are)")
    ap.add_argument("--thresholds", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--launches", type=int, default=50, help="launches per timed graph replay")
    ap.add_argument("--rounds", type=int, default=5, help="timed replays per setting (>= 3)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the script: 256 candidates, 2 heads, interpreter, "
                         "no timing")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.candidates, args.kv_heads, args.slots, args.topk = 256, 2, 2, 16
        args.warps, args.rounds = [4], 3
    if args.rounds < 3 or args.launches < 1:
        ap.error("--rounds must be >= 3 and --launches >= 1")
    if not 0 < args.active <= args.slots or not 0 < args.topk <= args.candidates:
        ap.error("need 0 < --active <= --slots and 0 < --topk <= --candidates")
    if any(t < 1 or t > 4 for t in args.thresholds) or any(w not in (1, 2, 4, 8, 16, 32)
                                                           for w in args.warps):
        ap.error("--thresholds in 1..4 (16-bit counts packed in an int64), --warps a power "
                 "of two <= 32")

    import torch
    import triton
    from sglang_pic_kernel.pariskv.select import TOPK_PACKED_MAX_CP, _topk_kernel

    from benchmark.harness import _write_report, environment, gpu_tag, smoke_dir

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_topk: needs a CUDA GPU (or --smoke on a CPU)")
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    c, k, hk, slots = args.candidates, args.topk, args.kv_heads, args.slots
    cp = max(128, triton.next_power_of_2(c))
    if cp > TOPK_PACKED_MAX_CP and max(args.thresholds) > 1:
        ap.error(f"more than {TOPK_PACKED_MAX_CP} candidates: counts no longer fit 16 bits, "
                 "use --thresholds 1")
    torch.manual_seed(0)
    est = torch.full((slots, hk, c), float("-inf"), device=dev)
    est[: args.active] = torch.randn(args.active, hk, c, device=dev) * 2  # rerank-like spread
    cand = torch.randperm(16 * c, device=dev)[:c].int().expand(slots, hk, c).contiguous()
    settings = [(t, w) for t in args.thresholds for w in args.warps]
    sel = {s: torch.empty(slots, hk, k, dtype=torch.int32, device=dev) for s in settings}
    # every slot searches (the idle ones over no valid candidate), as in the results on record:
    # the kernel's key count (n_ret) 1 for all; the server's idle slots (0) only write -1
    n_sel = torch.ones(slots, dtype=torch.int32, device=dev)

    def launch(s: tuple[int, int]) -> None:
        t, w = s
        _topk_kernel[(1, hk, slots)](est, cand, sel[s], n_sel, n_sel, n_sel, n_sel, c, k,
                                     CP=cp,
                                     KP=triton.next_power_of_2(k), T=t, num_warps=w)

    kth = est[: args.active].topk(k, dim=-1).values[..., -1:]
    checks = {}
    for s in settings:  # compiles, then the check against torch.topk
        launch(s)
        got = sel[s][: args.active].long()
        picked = torch.gather(est[: args.active], -1, _positions(cand[: args.active], got))
        checks[f"T{s[0]}_w{s[1]}"] = bool((picked >= kth).all()) and bool(
            (sel[s][args.active:] == -1).all())
    if not all(checks.values()):
        sys.exit(f"bench_topk: a setting selected wrong candidates: {checks}")
    print(f"[topk] all {len(settings)} settings select the top {k} of {c} (torch.topk agrees)",
          flush=True)

    samples: dict[tuple[int, int], list[float]] = {s: [] for s in settings}
    if not args.smoke:
        graphs = {}
        for s in settings:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(args.launches):
                    launch(s)
            graphs[s] = g
        for r in range(args.rounds):
            for s in (settings if r % 2 == 0 else settings[::-1]):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graphs[s].replay()
                torch.cuda.synchronize()
                samples[s].append(round((time.perf_counter() - t0) * 1e6 / args.launches, 2))
            print(f"[topk] round {r + 1}/{args.rounds} done", flush=True)
    rows = [{"thresholds": t, "warps": w, "us_per_launch": statistics.median(v) if v else None,
             "min": min(v) if v else None, "max": max(v) if v else None, "samples": v,
             "correct": checks[f"T{t}_w{w}"]} for (t, w), v in samples.items()]
    print(f"\n{'T':>3} {'warps':>6} {'us/launch':>10} {'min':>8} {'max':>8}")
    for r in rows:
        med = "-" if r["us_per_launch"] is None else f"{r['us_per_launch']:.2f}"
        lo = "-" if r["min"] is None else f"{r['min']:.2f}"
        hi = "-" if r["max"] is None else f"{r['max']:.2f}"
        print(f"{r['thresholds']:>3} {r['warps']:>6} {med:>10} {lo:>8} {hi:>8}")
    timed = [r for r in rows if r["us_per_launch"] is not None]
    if timed:
        best = min(timed, key=lambda r: r["us_per_launch"])
        print(f"fastest: T={best['thresholds']}, {best['warps']} warps")
    path = _write_report(f"pariskv_topk_{gpu_tag(dev)}",
                         args.out or (smoke_dir() if args.smoke else None), {
        "benchmark": "pariskv_topk", "environment": environment(),
        "config": {"candidates": c, "topk": k, "kv_heads": hk, "slots": slots,
                   "active": args.active, "launches_per_graph": args.launches,
                   "rounds": args.rounds, "estimates": "randn * 2, fp32; idle slots -inf",
                   "order": "settings alternate direction each round", "smoke": args.smoke},
        "results": rows})
    print(f"[topk] wrote {path}")


def _positions(cand, got):
    """Positions in ``cand`` ``[..., C]`` of the ids ``got`` ``[..., k]`` (each present once)."""
    import torch

    order = torch.argsort(cand, dim=-1)
    where = torch.searchsorted(torch.gather(cand, -1, order).long(), got)
    return torch.gather(order, -1, where)


if __name__ == "__main__":
    main()
