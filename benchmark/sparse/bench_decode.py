"""ParisKV decode attention vs SGLang's dense Triton decode kernel, per layer, on one GPU.

Llama-3-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16). For each context
length and batch: SGLang 0.5.17's ``decode_attention_fwd`` over the whole KV in GPU memory (the
dense baseline, SGLang's default kv-split choice), and ParisKV (``sglang_pic.sparse.kv_layout``):
sink + local window on the GPU, the rest in pinned host memory with only 4-bit codes, centroid
ids and calibration weights on the GPU; a step = query tables, votes, histogram pruning,
rerank, top-k, attention over window + selected rows read from host memory, LSE merge. Both
are timed as CUDA graphs (as SGLang runs decode).

Keys are synthetic, with the structure that makes sparse attention meaningful: Gaussian keys
plus, per KV head, 100 "heavy hitter" tokens aligned with the query at graded strengths (the
exact top-100 then holds most of them plus the strongest random keys). Recall@k is measured
against the exact top-k of ``max over the group's query heads of q.k``; the attention output is
compared with dense attention over every token.

    python3 -m benchmark.sparse.bench_decode [--contexts 32768 131072 524288 1048576]
        [--batches 1 8] [--candidates 2048 16384] [--quick]
    python3 -m benchmark.sparse.bench_decode --case 1 131072 --candidates 4096 --strides 16 \
        --profile --server     # one case: per-kernel times, and the server's path (below)

``--server`` also times the layer as the server runs it (``SparseDecodeState`` and
``KernelIndexOps`` over a KV pool laid out as SGLang's, the window's attention on a side stream
beside the selection) and the activation that encodes each region, cold and reused.

Writes ``benchmark/results/sparse_decode_<gpu>.json`` and prints a table. Memory per token and
layer (8 KV heads): dense 4 KiB of GPU memory; ParisKV 1.125 KiB on the GPU (per KV head 64 B
of codes, 16 B of packed centroid ids, 64 B of weights) + 4 KiB of pinned host memory.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from benchmark import description

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
HEAVY = 100
SINK, LOCAL, UPDATE, TOPK = 16, 512, 128, 100


def _keys(n: int, gen, q_dir):
    """[n, KV_HEADS, D] keys (bf16, GPU) with HEAVY planted heavy hitters per KV head."""
    import torch

    k = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", generator=gen)
    strength = torch.linspace(3.0, 9.0, HEAVY, device="cuda")
    for h in range(KV_HEADS):
        rows = torch.randint(SINK, n - LOCAL, (HEAVY,), device="cuda", generator=gen)
        k[rows, h] += strength[:, None] * q_dir[h][None, :]
    return k.to(torch.bfloat16)


def _dense(batch: int, ctx: int, q, ks, vs):
    """SGLang's decode kernel over a contiguous pool holding every sequence's KV."""
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    from benchmark.kernels.bench_rotating_attention import MAX_KV_SPLITS, num_kv_splits

    k = torch.cat(ks)
    v = torch.cat(vs)
    indptr = torch.arange(0, (batch + 1) * ctx, ctx, dtype=torch.int32, device="cuda")
    indices = torch.arange(batch * ctx, dtype=torch.int64, device="cuda")
    splits = num_kv_splits(torch.full((batch,), ctx, dtype=torch.int32, device="cuda"))
    logits = torch.empty(batch, Q_HEADS, MAX_KV_SPLITS, HEAD_DIM, device="cuda")
    lse = torch.empty(batch, Q_HEADS, MAX_KV_SPLITS, device="cuda")
    out = torch.empty_like(q)

    def step():
        decode_attention_fwd(q, k, v, out, indptr, indices, logits, lse, splits, MAX_KV_SPLITS,
                             HEAD_DIM**-0.5, 1.0, 1.0)

    return step, out


def _selection_step(layer, q, **selector_kw):
    """``(selector, step)``: a ``Selector`` of ``layer``'s shape built with ``selector_kw``, and
    one selection over ``layer``'s keys by it (a callable for ``do_bench_cudagraph``), called
    once (compiles)."""
    from sglang_pic_kernel.pariskv import Selector

    sel = Selector(layer.batch, layer.q_heads, layer.kv_heads, layer.d, layer.capacity,
                   layer.selector.C, layer.selector.k, device=layer.device, **selector_kw)

    def step():
        return sel(q, layer.rt, layer.levels, layer.centroid, layer.codes, layer.weights,
                   layer.n_ret, layer.bit_counts)

    step()
    return sel, step


def _sweep(layer, q) -> list[dict]:
    """Selection time of other vote-kernel tilings (keys per block, keys per program: fewer
    keys per program means more programs, for a batch of one too few to fill the GPU), on the
    same keys."""
    import itertools

    import torch
    import triton

    out = []
    for block_n, span in itertools.product((128, 256, 512), (None, 512, 1024, 2048)):
        if span is not None and span < block_n:
            continue
        sel, step = _selection_step(layer, q, block_n=block_n, span=span,
                                    sample_stride=layer.selector.stride)
        us = 1000 * triton.testing.do_bench_cudagraph(step, rep=50)
        same = (torch.sort(step(), -1).values == torch.sort(layer.select(q), -1).values)
        out.append({"block_n": block_n, "span": sel.span, "nbins": sel.nbins, "select_us": us,
                    "same_selection": same.float().mean().item()})
        print(f"  sweep block_n={block_n:>4} span={sel.span:>6}: select {us:7.1f} us "
              f"(same picks {out[-1]['same_selection']:.3f})", flush=True)
    return out


def _gather_alternatives(layer, q, rounds: int = 5) -> dict:
    """Selection with the candidates' merge as its own launch before the rerank against the
    rerank's programs placing the kept keys themselves (``Selector(gather_in_rerank=)``), as
    CUDA graphs on the same keys, ``rounds`` rounds alternating which goes first; both must
    select the same keys."""
    import torch
    import triton

    steps = {name: _selection_step(layer, q, sample_stride=layer.selector.stride,
                                   gather_in_rerank=gather)[1]
             for name, gather in (("merge_then_rerank", False), ("gather_in_rerank", True))}
    a, b = (torch.sort(steps[n](), -1).values for n in steps)
    out = {"same_selection": (a == b).float().mean().item(), **{f"{n}_us": [] for n in steps}}
    for i in range(rounds):
        for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            out[f"{name}_us"].append(1000 * triton.testing.do_bench_cudagraph(steps[name],
                                                                             rep=50))
    med = {n: sorted(out[f"{n}_us"])[rounds // 2] for n in steps}
    print(f"  select: merge then rerank {med['merge_then_rerank']:7.1f} us, gather in rerank "
          f"{med['gather_in_rerank']:7.1f} us (medians of {rounds} alternating rounds; same "
          f"picks {out['same_selection']:.3f})", flush=True)
    return out


def _pool_state(cfg, batch: int, capacity: int, req_to_token, pool_k, pool_v):
    """A one-layer ``SparseDecodeState`` with ``KernelIndexOps`` over the pool ``pool_k/v``
    (``[slots, kv_heads, D]``), warmed up."""
    import torch
    from sglang_pic.sparse.decode_state import SparseDecodeState
    from sglang_pic.sparse.index_ops import KernelIndexOps

    ops = KernelIndexOps(1, batch, Q_HEADS, KV_HEADS, HEAD_DIM, capacity, TOPK, cfg.candidates,
                         cfg.attended, "cuda", rerank_between=cfg.vote_interval > 1)
    state = SparseDecodeState(cfg, ops, layer_ids=[0], q_heads=Q_HEADS, kv_heads=KV_HEADS,
                              head_dim=HEAD_DIM, capacity=capacity, max_batch=batch,
                              req_to_token=req_to_token, device="cuda", dtype=torch.bfloat16)
    state.key_buffer = lambda layer: pool_k
    state.value_buffer = lambda layer: pool_v
    state.warm_up()
    return state


def _server_layer(batch: int, ctx: int, c: int, q, ks, vs, ref) -> dict:
    """The server's sparse path for one layer, as ``pariskv_flashinfer`` runs it: a
    ``SparseDecodeState`` over a KV pool laid out as SGLang's (``[slots, kv_heads, D]``, slot 0
    the padding slot, ``req_to_token`` rows), ``KernelIndexOps`` (selection; attention over
    window and selected pool slots, the window's part on a side stream beside the selection).
    Times the activation (encoding each region: cold, then again as a released slot's reuse)
    and one layer's ``attend`` as a CUDA graph."""
    import torch
    import triton
    from sglang_pic.sparse.config import SparseDecodeConfig

    pad_k = torch.zeros(1, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    pool_k, pool_v = torch.cat([pad_k, *ks]), torch.cat([pad_k, *vs])
    req_to_token = (torch.arange(batch * ctx, device="cuda").view(batch, ctx) + 1).int()
    cfg = SparseDecodeConfig(threshold=min(32768, ctx - 1), topk=TOPK, candidates=c, sink=SINK,
                             local=LOCAL, update=UPDATE, max_requests=batch)
    cfg.validate()
    capacity = ctx - SINK - LOCAL
    state = _pool_state(cfg, batch, capacity, req_to_token, pool_k, pool_v)
    rows, lens = list(range(batch)), [ctx] * batch
    lens_dev = torch.tensor(lens, device="cuda")
    activation_s = []
    for _ in range(2):  # cold, then the released slots' regions found again
        state.release_finished(set())  # every request finished: their regions kept
        torch.cuda.synchronize()
        t = time.perf_counter()
        state.prepare_decode(rows, lens, lens_dev)
        torch.cuda.synchronize()
        activation_s.append(time.perf_counter() - t)
    out = torch.zeros_like(q)

    def step():
        state.attend(0, q, out, HEAD_DIM**-0.5)

    step()
    us = 1000 * triton.testing.do_bench_cudagraph(step, rep=100)
    row = {"server_layer_us": us, "activation_cold_s_per_layer": activation_s[0],
           "activation_reused_s_per_layer": activation_s[1],
           "reused_tokens": state.stats["reused_tokens"]}
    if ref is not None:
        err = (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)
        row["server_rel_err_mean"] = err.mean().item()
    print(f"  server path: layer {us:7.1f} us (window beside the selection); activation "
          f"{activation_s[0] * 1e3:.1f} ms cold, {activation_s[1] * 1e3:.1f} ms reused, per "
          f"layer; rel.err {row.get('server_rel_err_mean', math.nan):.4f}", flush=True)
    row.update(_between_votes_layer(batch, ctx, cfg, capacity, q, pool_k, pool_v, req_to_token))
    return row


def _between_votes_layer(batch: int, ctx: int, cfg, capacity: int, q, pool_k, pool_v,
                         req_to_token) -> dict:
    """The same layer at a step between votes (``--sparse-vote-interval 4``): the requests
    vote at context ``ctx - 1``, and the step at ``ctx`` (the region unchanged) reranks the
    kept candidates moved on by a row; timed as a CUDA graph like ``_server_layer``."""
    import dataclasses

    import torch
    import triton

    state = _pool_state(dataclasses.replace(cfg, vote_interval=4), batch, capacity,
                        req_to_token, pool_k, pool_v)
    out = torch.zeros_like(q)
    rows = list(range(batch))
    for n in (ctx - 1, ctx):  # a vote, then a step between votes
        state.prepare_decode(rows, [n] * batch, torch.tensor([n] * batch, device="cuda"))
        state.attend(0, q, out, HEAD_DIM**-0.5)
    between = state.stats["selections"] == batch  # the second step did not vote
    us = 1000 * triton.testing.do_bench_cudagraph(
        lambda: state.attend(0, q, out, HEAD_DIM**-0.5), rep=100)
    print(f"  server path between votes (--sparse-vote-interval 4): layer {us:7.1f} us"
          + ("" if between else " (the second step voted: its region grew)"), flush=True)
    return {"server_layer_between_votes_us": us, "between_votes": between}


def case(batch: int, ctx: int, candidates: list[int], dense: bool,
         profile: bool = False, sweep: bool = False, strides: tuple[int, ...] = (1, 16),
         chunks: tuple[int, ...] = (), server: bool = False,
         sel_chunks: tuple[int, ...] = (), gather: bool = False) -> list[dict]:
    import torch
    import triton
    from sglang_pic.sparse.kv_layout import ParisKVLayer
    from sglang_pic_kernel.pariskv import Selector, SparseAttention

    gen = torch.Generator(device="cuda").manual_seed(ctx + batch)
    q_dir = torch.nn.functional.normalize(torch.randn(KV_HEADS, HEAD_DIM, device="cuda",
                                                      generator=gen), dim=-1)
    # the group's query heads point near their KV head's heavy-hitter direction
    q = (q_dir.repeat_interleave(Q_HEADS // KV_HEADS, 0)[None]
         + 0.3 * torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", generator=gen) / 11.3)
    q = (24.0 * torch.nn.functional.normalize(q, dim=-1)).to(torch.bfloat16)
    ks, vs = [], []
    rows = []
    t0 = time.perf_counter()
    for _ in range(batch):
        ks.append(_keys(ctx, gen, q_dir))
        vs.append(torch.randn(ctx, KV_HEADS, HEAD_DIM, device="cuda", generator=gen,
                              dtype=torch.bfloat16))
    dense_us = None
    ref = None
    if dense:
        step, ref = _dense(batch, ctx, q, ks, vs)
        step()
        dense_us = 1000 * triton.testing.do_bench_cudagraph(step, rep=100)
    for c in candidates:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        layer = ParisKVLayer(batch, Q_HEADS, KV_HEADS, HEAD_DIM, ctx, k=TOPK, candidates=c,
                             sink=SINK, local=LOCAL, update=UPDATE, dtype=torch.bfloat16)
        for b in range(batch):
            layer.prefill(b, ks[b], vs[b])
        torch.cuda.synchronize()
        gpu_bytes = torch.cuda.memory_allocated() - base_mem
        exact_picks = None
        for stride in strides:
            # the same encoded keys, pruned exactly (1) or with a sampled threshold (> 1)
            old = layer.selector
            layer.selector = Selector(batch, Q_HEADS, KV_HEADS, HEAD_DIM, layer.capacity, old.C,
                                      old.k, device=layer.device, sample_stride=stride)
            del old
            out = torch.empty_like(q)
            layer.attend(q, out)
            bench = triton.testing.do_bench_cudagraph
            sparse_us = 1000 * bench(partial(layer.attend, q, out), rep=100)
            select_us = 1000 * bench(partial(layer.select, q), rep=100)
            if profile:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as torch_profile

                with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        layer.attend(q, out)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
            by_chunk = {}
            # the attention's rows per program: window chunks (default 256), selected-row
            # chunks (default one 32-row tile)
            for kind, chunk in [("window", c) for c in chunks] + [("selected", c)
                                                                   for c in sel_chunks]:
                default = layer.attention
                size = {"chunk": chunk} if kind == "window" else {"sel_chunk": chunk}
                layer.attention = SparseAttention(batch, Q_HEADS, KV_HEADS, HEAD_DIM,
                                                  SINK + LOCAL + UPDATE, layer.selector.k,
                                                  device=layer.device, **size)
                layer.attend(q, out)
                by_chunk[f"{kind}_{chunk}"] = 1000 * bench(partial(layer.attend, q, out),
                                                           rep=100)
                print(f"  attention {kind} chunk {chunk:>4}: layer "
                      f"{by_chunk[f'{kind}_{chunk}']:7.1f} us", flush=True)
                layer.attention = default
            sweep_rows = _sweep(layer, q) if sweep else None
            # (exact pruning, stride 1, always merges by compaction: nothing to compare)
            gather_rows = (_gather_alternatives(layer, q)
                           if gather and layer.selector.stride > 1 else None)
            # recall@k of the host-region selection vs the exact top-k (max over the group)
            sel = layer.select(q)
            recall = []
            for b in range(batch):
                host_k = ks[b][SINK:ctx - LOCAL].float()
                for h in range(KV_HEADS):
                    g = Q_HEADS // KV_HEADS
                    scores = (host_k[:, h] @ q[b, h * g:(h + 1) * g].float().T).max(1).values
                    exact = set(scores.topk(TOPK).indices.tolist())
                    recall.append(len(exact & set(sel[b, h].tolist())) / TOPK)
            row = {"batch": batch, "context": ctx, "candidates": c, "topk": TOPK, "sink": SINK,
                   "local": LOCAL, "dense_us": dense_us, "sparse_us": sparse_us,
                   "select_us": select_us, "recall_at_k": sum(recall) / len(recall),
                   "recall_min": min(recall), "gpu_bytes_sparse": gpu_bytes,
                   "host_bytes_sparse": 2 * layer.k_host.numel() * 2,
                   "gpu_bytes_dense": 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2,
                   "setup_s": time.perf_counter() - t0,
                   "vote_block_n": layer.selector.block_n, "nbins": layer.selector.nbins,
                   "sample_stride": stride}
            picks = torch.sort(sel, -1).values
            if exact_picks is None:
                exact_picks = picks
            row["same_picks_as_first"] = (picks == exact_picks).float().mean().item()
            if sweep_rows:
                row["sweep"] = sweep_rows
            if gather_rows:
                row["gather_alternatives"] = gather_rows
            if by_chunk:
                row["sparse_us_by_attention_chunk"] = by_chunk
            if ref is not None:
                err = (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)
                row["rel_err_mean"] = err.mean().item()
                row["speedup"] = dense_us / sparse_us
            if server and stride == strides[-1]:  # the server's default sampling
                try:  # its own failure must not cost the case's other numbers
                    row.update(_server_layer(batch, ctx, c, q, ks, vs, ref))
                except Exception as e:  # recorded in the row, printed
                    row["server_error"] = f"{type(e).__name__}: {e}"
                    print(f"  server path failed: {row['server_error']}", flush=True)
            rows.append(row)
            print(f"b={batch} ctx={ctx:>8} C={c:>6} s={stride:>2}: "
                  f"dense {dense_us or float('nan'):9.1f} us  "
                  f"pariskv {sparse_us:7.1f} us (select {select_us:6.1f})  "
                  f"x{(dense_us or math.nan) / sparse_us:6.2f}  recall@{TOPK} {row['recall_at_k']:.3f}"
                  f" (min {row['recall_min']:.2f})  rel.err {row.get('rel_err_mean', math.nan):.4f}",
                  flush=True)
        del layer
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    from benchmark.harness import smoke_dir

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--contexts", type=int, nargs="+",
                    default=[32768, 131072, 524288, 1048576])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--candidates", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--max-host-gib", type=float, default=40.0,
                    help="skip cases needing more pinned host memory than this")
    ap.add_argument("--strides", type=int, nargs="+", default=[1, 16],
                    help="pruning modes per case: 1 = exact histogram, s > 1 = threshold from "
                         "every s-th key (Selector's sample_stride); the first is the reference "
                         "of same_picks_as_first")
    ap.add_argument("--attention-chunks", type=int, nargs="*", default=[],
                    help="also time the layer with the attention split into chunks of this many "
                         "keys per program (with --case)")
    ap.add_argument("--selected-chunks", type=int, nargs="*", default=[],
                    help="also time the layer with the selected rows split into chunks of this "
                         "many rows per program (with --case; default one 32-row tile)")
    ap.add_argument("--gather-in-rerank", action="store_true",
                    help="also time the selection with the rerank placing the kept keys itself "
                         "against the merge launch before it (with --case; alternating rounds)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU times (with --case)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time other vote tilings / histogram sizes (with --case)")
    ap.add_argument("--server", action="store_true",
                    help="also time the server's path for one layer: KV in a pool as SGLang's, "
                         "the window's attention beside the selection, and the activation "
                         "(with --case)")
    ap.add_argument("--case", type=int, nargs=2, metavar=("BATCH", "CONTEXT"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None,
                    help="results folder (default benchmark/results; with --quick a temp folder)")
    args = ap.parse_args()
    args.out = args.out or (smoke_dir() if args.quick else str(REPO / "benchmark" / "results"))
    if args.quick:
        args.contexts, args.batches, args.candidates = [32768], [1], [2048]

    rows = []
    if args.case:  # one case in this process (spawned below): rows as JSON on the last line
        batch, ctx = args.case
        rows = case(batch, ctx, args.candidates, dense=True, profile=args.profile,
                    sweep=args.sweep, strides=tuple(args.strides),
                    chunks=tuple(args.attention_chunks), server=args.server,
                    sel_chunks=tuple(args.selected_chunks), gather=args.gather_in_rerank)
        print("ROWS " + json.dumps(rows), flush=True)
        return
    for batch in args.batches:
        for ctx in args.contexts:
            host_gib = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2 / 2**30
            if host_gib > args.max_host_gib:
                print(f"skip b={batch} ctx={ctx}: {host_gib:.0f} GiB of pinned host KV", flush=True)
                continue
            # each case in a fresh process: a CUDA error or OOM cannot poison the next one
            cmd = [sys.executable, "-m", "benchmark.sparse.bench_decode", "--case", str(batch),
                   str(ctx), "--candidates", *map(str, args.candidates), "--strides",
                   *map(str, args.strides)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            lines = proc.stdout.splitlines()
            for line in lines:
                if not line.startswith("ROWS "):
                    print(line, flush=True)
            got = [json.loads(x[5:]) for x in lines if x.startswith("ROWS ")]
            if got:
                rows += got[0]
            else:
                err = (proc.stderr.strip().splitlines() or ["?"])[-1]
                oom = "out of memory" in proc.stderr.lower()
                print(f"b={batch} ctx={ctx}: failed ({err})", flush=True)
                rows.append({"batch": batch, "context": ctx, "oom": oom, "error": err})
            _write(args.out, rows)  # after every case: a run cut short keeps what it measured


def _write(out_dir: str, rows: list[dict]) -> None:
    import torch

    from benchmark.harness import environment, gpu_tag

    props = torch.cuda.get_device_properties(0)
    report = {"benchmark": "sparse_decode", "environment": environment(),
              "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                        "dtype": "bfloat16", "heavy_hitters": HEAVY},
              "gpu_memory_bytes": props.total_memory, "rows": rows}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = f"sparse_decode_{gpu_tag()}.json"
    (out / name).write_text(json.dumps(report, indent=2))
    print(f"wrote {out / name}", flush=True)

if __name__ == "__main__":
    main()
