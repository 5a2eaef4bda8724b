"""One decode step's attention over RAG requests that share documents, four ways, on one GPU.

A burst of RAG requests over a few popular documents holds each document once in the pool
(the span cache) and reads it at other offsets than it was computed at. Per layer, a decode
step's attention is:

* ``vanilla``: FlashInfer's batch decode over each request's whole key list, the call vanilla
  SGLang makes (its pool holds a copy of each document per prompt it was prefilled in; the
  keys read are the same count);
* ``per-run``: segmented attention with one query row per run of keys moved by one distance,
  each run read on its own (FlashInfer's batch decode), merged by log-sum-exp;
* ``grouped``: segmented attention as it runs by default, runs of several requests that read
  the same slots attended together as one request of FlashInfer's paged prefill, so a shared
  document is read once per step;
* ``graph``: ``grouped`` as ``--position-free-span-graphs`` replays it: the padded layout of a
  captured step (``segmented_graphs``, ``--span-graph-runs`` 12), one layer captured in a CUDA
  graph and replayed (on the CPU: the padded plan, run eagerly).

The requests: ``--requests`` prompts of a system prompt, ``--per-request`` of ``--docs``
documents (Zipf ``--zipf``, ``--doc-tokens`` each, in random order, each computed after the
system prompt where it was first seen) and ``--tail`` tokens of their own. The step's metadata
(planning, the query turns' tables) is timed apart from a layer's attention call; rounds
alternate the variants' order. Each variant's output is checked against ``vanilla``'s with keys
turned where they are read.

    python3 -m benchmark.kernels.bench_segmented_decode [--requests 128] [--out DIR]
    python3 -m benchmark.kernels.bench_segmented_decode --cell varlen_k6_p256_z07_t4 --requests 64
    .venv/bin/python -m benchmark.kernels.bench_segmented_decode --smoke   # CPU, torch, tiny

Prints a table; writes ``segmented_decode_<gpu>[_<cell>].json`` (machine, versions, config, raw samples
in ms) and a figure into ``--out`` (default ``benchmark/results``; a temp folder with
``--smoke``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmark import description

VARIANTS = ("vanilla", "per-run", "grouped", "graph")


def _cos_sin(positions: int, dim: int, device: str) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv)
    return torch.cat((freqs.cos(), freqs.sin()), -1).float().to(device)


def build(args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict:
    """The pool (keys rotated where computed), each request's slots, runs and length."""
    from sglang_pic.position_free.key_runs import runs_from_shifts
    from sglang_pic.position_free.moved_copies import turn_keys

    rng = np.random.default_rng(args.seed)
    hkv, d = args.kv_heads, args.head_dim
    doc_len, system_len = _lengths(args, rng)
    weights = 1.0 / np.arange(1, args.docs + 1) ** args.zipf
    picks = [rng.choice(args.docs, args.per_request, replace=False, p=weights / weights.sum())
             for _ in range(args.requests)]
    tenant_of = rng.integers(len(system_len), size=args.requests)
    sys_at = np.concatenate(([0], np.cumsum(system_len)))
    doc_at = sys_at[-1] + np.concatenate(([0], np.cumsum(doc_len)))
    tail_at = int(doc_at[-1])
    slots = tail_at + args.requests * args.tail
    stored = torch.zeros(slots, dtype=torch.long)
    systems = [torch.arange(int(sys_at[t]), int(sys_at[t + 1])) for t in range(len(system_len))]
    for system in systems:
        stored[system] = torch.arange(len(system))
    docs = [torch.arange(int(doc_at[i]), int(doc_at[i + 1])) for i in range(args.docs)]
    for doc in docs:  # computed right after the first system prompt
        stored[doc] = torch.arange(system_len[0], system_len[0] + len(doc))
    rows, runs, lengths = [], [], []
    for r, pick in enumerate(picks):
        prefix = torch.cat([systems[tenant_of[r]]] + [docs[i] for i in pick])
        own = torch.arange(tail_at + r * args.tail, tail_at + (r + 1) * args.tail)
        stored[own] = torch.arange(len(prefix), len(prefix) + args.tail)
        rows.append(torch.cat((prefix, own)))
        runs.append(runs_from_shifts(torch.arange(len(prefix)) - stored[prefix], prefix))
        lengths.append(len(prefix) + args.tail)
    cos_sin = _cos_sin(max(lengths) + 1, d, device)
    g = torch.Generator().manual_seed(args.seed)
    raw = torch.randn(slots, hkv, d, generator=g).to(device)
    k = turn_keys(raw, stored.to(device), cos_sin).to(dtype)
    v = torch.randn(slots, hkv, d, generator=g).to(device, dtype)
    req_to_token = torch.zeros(args.requests, max(lengths), dtype=torch.int64)
    for i, row in enumerate(rows):
        req_to_token[i, : len(row)] = row
    # vanilla's pool: the keys rotated where each request reads them (its own copy)
    turned = torch.cat([turn_keys(raw[row.to(device)], torch.arange(len(row), device=device),
                                  cos_sin) for row in rows]).to(dtype)
    vanilla_v = torch.cat([v[row.to(device)] for row in rows])
    return dict(k=k, v=v, rows=rows, runs=runs, lengths=lengths, cos_sin=cos_sin,
                req_to_token=req_to_token.to(device), turned=turned, vanilla_v=vanilla_v,
                distinct_keys=sum(system_len[t] for t in set(tenant_of.tolist()))
                + sum(doc_len[i] for i in {int(i) for p in picks for i in p})
                + args.requests * args.tail)


def _lengths(args: argparse.Namespace, rng) -> tuple[list[int], list[int]]:
    """Each document's tokens and each tenant's system prompt tokens: ``--doc-tokens`` and one
    ``--system`` prompt, or a grid cell's (``--cell``: its length law and tenants, the grid's
    system prompt lengths)."""
    if args.cell is None:
        return [args.doc_tokens] * args.docs, [args.system]
    from benchmark.bench_rag_grid import CELLS, PARAMS, doc_lengths

    kind, _, _, _, tenants = CELLS[args.cell]
    systems = [int(rng.integers(PARAMS["system_min"], PARAMS["system_max"] + 1))
               for _ in range(tenants)]
    return doc_lengths(rng, kind, args.docs, PARAMS), systems


class _Pool:
    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v


def make_kernels(args, device: str, dtype: torch.dtype, workspace):
    from sglang_pic.position_free.run_kernels import FlashInferRunKernels, TorchRunKernels

    scale = args.head_dim ** -0.5
    if device == "cpu":
        return TorchRunKernels(scale)
    return FlashInferRunKernels(workspace, args.heads, args.kv_heads, args.head_dim, dtype,
                                dtype, scale, use_tensor_cores=True)


def variant_step(name: str, args, case: dict, device: str, dtype, workspace
                 ) -> tuple[Callable[[], None], Callable[[torch.Tensor], torch.Tensor]]:
    """``(plan, attend)``: the step's metadata, and one layer's attention of queries ``q``."""
    from sglang_pic.position_free import shifted_batches
    from sglang_pic.position_free.key_runs import request_runs
    from sglang_pic.position_free.segmented_backend import SegmentedAttention

    kernels = make_kernels(args, device, dtype, workspace)
    n = args.requests
    if name == "vanilla":
        indptr = torch.zeros(n + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(case["lengths"]), 0)
        indices = torch.arange(int(indptr[-1]), dtype=torch.int32, device=device)
        kv = (case["turned"], case["vanilla_v"])
        return (lambda: kernels.plan_decode(indptr, indices),
                lambda q: kernels.decode(q, kv)[0])
    seg = SegmentedAttention.over_pool(kernels, case["req_to_token"],
                                       _Pool(case["k"], case["v"]), case["cos_sin"], device)
    layer = types.SimpleNamespace(scaling=args.head_dim ** -0.5, logit_cap=0.0,
                                  tp_q_head_num=args.heads, head_dim=args.head_dim, layer_id=0)
    batch = types.SimpleNamespace(req_pool_indices=torch.arange(n, device=device),
                                  forward_mode=types.SimpleNamespace(is_decode_or_idle=lambda: True),
                                  out_cache_loc=None)
    per_request = [request_runs(r, ln) for r, ln in zip(case["runs"], case["lengths"],
                                                           strict=True)]

    seg.group_shared_runs = name != "per-run"
    if name == "graph":
        return _graph_step(seg, layer, per_request, n, args, device, dtype)

    def plan() -> None:
        shifted_batches._runs = per_request
        seg.init_forward_metadata(batch)

    return plan, lambda q: seg.forward_decode(q, None, None, layer, batch, save_kv_cache=False)


def _graph_step(seg, layer, per_request, n: int, args, device: str, dtype
                ) -> tuple[Callable[[], None], Callable[[torch.Tensor], torch.Tensor]]:
    """``(plan, attend)`` of the captured step of batch size ``n``: the replay's plan, and the
    query copied into the graph's input then one replay (eager on the CPU)."""
    from sglang_pic.position_free import shifted_batches

    mode = types.SimpleNamespace(is_decode_or_idle=lambda: True)
    batch = types.SimpleNamespace(batch_size=n, req_pool_indices=torch.arange(n, device=device),
                                  forward_mode=mode, out_cache_loc=None)
    seg.init_cuda_graph_state(n, n)
    seg.init_forward_metadata_out_graph(batch, in_capture=True)
    q_in = torch.zeros(n, args.heads, args.head_dim, dtype=dtype, device=device)

    def run() -> torch.Tensor:
        return seg.forward_decode(q_in, None, None, layer, batch, save_kv_cache=False)

    def plan() -> None:
        shifted_batches._runs = per_request
        seg.init_forward_metadata_out_graph(batch)

    if device != "cuda":
        return plan, lambda q: (q_in.copy_(q), run())[1]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()

    def attend(q: torch.Tensor) -> torch.Tensor:
        q_in.copy_(q)
        graph.replay()
        return out

    return plan, attend


def timed(fn: Callable[[], object], device: str, repeat: int) -> float:
    """Milliseconds per call of ``fn``, over ``repeat`` calls after one warm-up."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeat
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) * 1e3 / repeat


def plot(report: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmark.harness import save_figure

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    names = list(report["results"])
    ax.bar(names, [report["results"][v]["attend_ms"] for v in names], color="#4c72b0")
    ax.set_ylabel("one layer's decode attention (ms)")
    c = report["config"]
    lengths = (f"cell {c['cell']}" if c.get("cell") else f"{c['doc_tokens']} tokens each")
    ax.set_title(f"{c['requests']} requests x {c['per_request']} of {c['docs']} documents "
                 f"({lengths}), {report['environment'].get('gpu') or 'CPU'}", fontsize=8)
    return save_figure(fig, out)


def main() -> None:
    from benchmark.harness import environment, gpu_tag

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--per-request", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--system", type=int, default=512, help="system prompt tokens")
    ap.add_argument("--tail", type=int, default=128, help="each request's own tokens")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--cell", default=None, help="a cell of bench_rag_grid (e.g. "
                    "varlen_k6_p256_z07_t4): its document count, lengths, documents per request, "
                    "popularity and tenants instead of the flags above")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=20, help="calls per timed sample")
    ap.add_argument("--rounds", type=int, default=3, help="samples per variant (>= 3), order "
                    "alternating")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="CPU, torch kernels, tiny shapes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.cell is not None:
        from benchmark.bench_rag_grid import CELLS

        if args.cell not in CELLS:
            ap.error(f"--cell: one of {', '.join(CELLS)}")
        _, args.per_request, args.docs, args.zipf, _ = CELLS[args.cell]
    if args.smoke:
        args.requests, args.doc_tokens, args.system, args.tail = 6, 48, 16, 8
        if args.cell is None:
            args.docs, args.per_request = 4, 2
        args.heads, args.kv_heads, args.head_dim = 4, 2, 64
        args.repeat = 2
        args.out = args.out or tempfile.mkdtemp(prefix="sglang-pic-bench-")
    if args.rounds < 3 or min(args.requests, args.docs, args.doc_tokens, args.tail) < 1 \
            or not 0 < args.per_request <= args.docs:
        ap.error("--rounds >= 3; positive sizes; 0 < --per-request <= --docs")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    case = build(args, device, dtype)
    workspace = (torch.empty(256 << 20, dtype=torch.uint8, device=device)
                 if device == "cuda" else None)
    steps = {v: variant_step(v, args, case, device, dtype, workspace) for v in VARIANTS}
    g = torch.Generator().manual_seed(args.seed + 1)
    q = torch.randn(args.requests, args.heads, args.head_dim, generator=g).to(device, dtype)
    outputs = {}
    for v, (plan, attend) in steps.items():
        plan()
        outputs[v] = attend(q).float().view(args.requests, -1)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for v in VARIANTS[1:]:
        err = (outputs[v] - outputs["vanilla"]).abs().max().item()
        if err > tol:
            raise SystemExit(f"{v}: output differs from vanilla's by {err:.3g} (> {tol})")
    samples = {v: {"plan_ms": [], "attend_ms": []} for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            plan, attend = steps[v]
            samples[v]["plan_ms"].append(timed(plan, device, args.repeat))
            plan()
            samples[v]["attend_ms"].append(timed(lambda a=attend: a(q), device, args.repeat))
        print(f"[bench] round {r + 1}/{args.rounds}: " + ", ".join(
            f"{v} {samples[v]['attend_ms'][-1]:.3f} ms" for v in VARIANTS), flush=True)
    kernels = "flashinfer" if device == "cuda" else "torch"
    results = {v: {"attention_backend": kernels, "plan_ms": statistics.median(s["plan_ms"]),
                   "attend_ms": statistics.median(s["attend_ms"]),
                   "plan_ms_all": s["plan_ms"], "attend_ms_all": s["attend_ms"]}
               for v, s in samples.items()}
    keys_read = sum(case["lengths"])
    print(f"\n{args.requests} requests, {keys_read} keys in their sequences, "
          f"{case['distinct_keys']} distinct")
    print(f"{'variant':<10}{'attention ms':>14}{'x vanilla':>11}{'plan ms':>10}")
    for v, res in results.items():
        print(f"{v:<10}{res['attend_ms']:>14.3f}"
              f"{results['vanilla']['attend_ms'] / res['attend_ms']:>11.2f}"
              f"{res['plan_ms']:>10.3f}")
    env = environment()
    report = {"benchmark": "bench_segmented_decode", "environment": env,
              "config": {k: getattr(args, k) for k in ("cell", "requests", "docs", "per_request",
                                                        "doc_tokens", "system", "tail", "zipf",
                                                        "heads", "kv_heads", "head_dim",
                                                        "repeat", "rounds", "seed", "smoke")}
              | {"device": device, "keys_read": keys_read,
                 "distinct_keys": case["distinct_keys"]},
              "results": results}
    out = Path(args.out or Path(__file__).resolve().parents[1] / "results")
    out.mkdir(parents=True, exist_ok=True)
    tag = "cpu_smoke" if args.smoke else gpu_tag()
    path = out / f"segmented_decode_{tag}{'_' + args.cell if args.cell else ''}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"[bench] wrote {path} and {plot(report, path.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
