"""Kernel-level cost of position-free KV: our shifted-layout kernels vs SGLang's Triton kernels
and FlashInfer, on one pool of pre-rotated keys.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, llama3 RoPE), one
layer, token-level ``kv_indices`` scattered over 16-token pages. Every side reads the same pool:
keys rotated at the position they were computed at, as the model writes them, plus (ours only)
``stored_positions``. Two layouts of a request's keys:

- nothing moved (``moved`` 0): every key was computed where it is read; the pool vanilla SGLang
  holds, and what ``pic_flashinfer`` runs on FlashInfer. Our kernels read no RoPE table row here;
  all three outputs must agree.
- a long span moved: the request's last ``moved`` keys are a span computed alone at
  ``0..moved-1`` and reused after ``offset`` other keys, so each is turned by ``offset`` when read
  (what ``pic_flashinfer`` sends to our kernels). SGLang's kernels and FlashInfer read these keys
  as they are - the cost of attention over the same bytes, not a correct answer; ours is checked
  against SGLang's Triton kernel over a private copy of the keys rotated at their index.

Cases:

- decode: batch {1, 32, 256} x context {1K, 8K, 32K} x {0 %, 90 %} moved, each side timed
  inside a CUDA graph as in serving (SGLang's Triton ``decode_attention_fwd`` with SGLang's own
  kv-split heuristic; FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` planned as SGLang's
  flashinfer backend plans it: page size 1, the fa2 backend, tensor cores for GQA groups >= 4,
  CUDA-graph buffers; ours, ``rotating_decode_attention_fwd``);
- extend, eager: prefill of 8K new tokens with no prefix; 64 new tokens after an 8K prefix with
  nothing moved and after 256 + 8K of which the 8K moved (the cached-span TTFT); a chunked-prefill
  chunk of 8K after 24K with nothing moved and with 22K moved. SGLang's Triton
  ``extend_attention_fwd``; FlashInfer as SGLang's backend runs an extend: the new tokens through
  ``BatchPrefillWithRaggedKVCacheWrapper`` (causal), the prefix through
  ``BatchPrefillWithPagedKVCacheWrapper`` (page size 1), merged by log-sum-exp; ours,
  ``rotating_extend_attention_fwd``. FlashInfer's ``plan`` is outside the timed region (SGLang
  plans once per batch for all layers).

    python3 -m benchmark.kernels.bench_rotating_attention [--out DIR] [--quick] [--no-flashinfer]
    python3 -m benchmark.kernels.bench_rotating_attention --tune-decode [--best-config-out F]
    .venv/bin/python -m benchmark.kernels.bench_rotating_attention --smoke   # CPU, interpreter

``--tune-decode`` sweeps the decode kernel's stage-1 (BLOCK_N, num_warps, num_stages) over
representative cases (with and without moved keys) and reports the config with the lowest
geometric-mean time ratio to SGLang's Triton kernel; ``--best-config-out`` writes it as
``BLOCK_N,WARPS,STAGES`` (the form of ``--position-free-decode-config``).

``--smoke`` checks the script on a CPU: tiny cases, SGLang's Triton kernels and ours under
``TRITON_INTERPRET=1``, no FlashInfer, no meaningful times; it writes to the temp smoke folder.
Otherwise it needs a CUDA GPU, SGLang and FlashInfer; it prints a table and writes
``rotating_attention_kernels_shifted.json`` (machine, versions, config, per-case raw samples in
microseconds). The earlier layout's results (``rotating_attention_kernels_h200*.json``) are
history: ``benchmark/plot_position_free.py`` plots them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmark import description

REPO = Path(__file__).resolve().parents[2]

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
MAX_KV_SPLITS = 8  # SGLang's default --triton-attention-num-kv-splits
WORKSPACE_BYTES = 384 * 1024 * 1024  # SGLang's SGLANG_FLASHINFER_WORKSPACE_SIZE default
SIDES = ("triton", "flashinfer", "pic")
DEVICE = "cuda"  # "cpu" with --smoke

DECODE_GRID = [(b, c, f) for b in (1, 32, 256) for c in (1024, 8192, 32768) for f in (0.0, 0.9)]
DECODE_QUICK = [(1, 1024, 0.0), (1, 1024, 0.9), (32, 1024, 0.9)]
# (offset, moved, new): the prefix is offset + moved keys, of which the last `moved` moved
EXTEND_GRID = [(0, 0, 8192), (8192, 0, 64), (256, 8192, 64), (24576, 0, 8192),
               (2048, 22528, 8192)]
EXTEND_QUICK = [(0, 0, 1024), (1024, 0, 64), (64, 1024, 64)]
DECODE_SMOKE = [(2, 64, 0.0), (2, 64, 0.75)]
EXTEND_SMOKE = [(0, 0, 32), (32, 0, 16), (16, 32, 16)]
TUNE_CASES = [(1, 32768, 0.9), (32, 8192, 0.0), (32, 8192, 0.9), (256, 1024, 0.0),
              (256, 8192, 0.9)]


def llama3_table(max_pos: int):
    import torch
    from sglang_pic_kernel.rotating_attention import RotaryTable

    inv = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float) / HEAD_DIM)
    wavelen = 2 * torch.pi / inv
    factor, low, high, orig = 8.0, 1.0, 4.0, 8192
    smooth = (orig / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    mid = (wavelen <= orig / low) & (wavelen >= orig / high)
    inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return RotaryTable.from_inv_freq(inv, max_pos).to(DEVICE)


def scattered_indices(lens, device):
    import torch

    total_pages = sum(-(-n // PAGE) for n in lens)
    pages = torch.randperm(total_pages, device=device)
    out, used = [], 0
    for n in lens:
        need = -(-n // PAGE)
        p = pages[used : used + need]
        used += need
        out.append((p[:, None] * PAGE + torch.arange(PAGE, device=device)[None, :]).flatten()[:n])
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.tensor(lens, device=device).cumsum(0)
    return indptr, torch.cat(out).to(torch.int64), max(total_pages * PAGE, PAGE)


def num_kv_splits(seq_lens):
    import torch
    import triton
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    if not seq_lens.is_cuda:  # --smoke: any split count will do
        return torch.full_like(seq_lens, 2, dtype=torch.int32)
    out = torch.empty(seq_lens.numel(), dtype=torch.int32, device=seq_lens.device)
    cores = torch.cuda.get_device_properties(0).multi_processor_count
    n = seq_lens.numel()
    get_num_kv_splits_triton[(1,)](out, seq_lens, n, 1, Q_HEADS, KV_HEADS, MAX_KV_SPLITS, cores,
                                   MAX_NUM_SEQ=max(256, triton.next_power_of_2(n)))
    return out


def rotate_at(k, pos, table, chunk: int = 1 << 20):
    """``k`` rotated at ``pos`` per row, in chunks (a 256 x 32K pool is 8M rows)."""
    import torch
    from sglang_pic_kernel.rotating_attention import rotate_neox

    out = torch.empty_like(k)
    for s in range(0, k.shape[0], chunk):
        out[s : s + chunk] = rotate_neox(k[s : s + chunk], pos[s : s + chunk], table)
    return out


def shifted_pool(slots, indptr, indices, offset: int, moved: int, table):
    """Un-rotated keys made into the shifted layout: ``(k_stored, k_at_index, stored, v)``.

    Every request's key ``n`` was computed at ``n``, except its keys ``offset..offset+moved-1``:
    a span computed at ``0..moved-1``. ``k_at_index`` (keys rotated at their index: a private
    copy, what the reference reads) is ``k_stored`` itself when nothing moved.
    """
    import torch

    dev = indices.device
    k0 = torch.randn(slots, KV_HEADS, HEAD_DIM, device=dev,
                     dtype=torch.bfloat16 if indices.is_cuda else torch.float32)
    v = torch.randn_like(k0)
    index = torch.zeros(slots, dtype=torch.int64, device=dev)
    for b in range(indptr.numel() - 1):
        req = indices[indptr[b] : indptr[b + 1]]
        index[req] = torch.arange(req.numel(), device=dev)
    stored = index.clone()
    if moved:
        for b in range(indptr.numel() - 1):
            req = indices[indptr[b] : indptr[b + 1]]
            stored[req[offset : offset + moved]] -= offset
    k_stored = rotate_at(k0, stored, table)
    k_at_index = rotate_at(k0, index, table) if moved else k_stored
    del k0
    return k_stored, k_at_index, stored.to(torch.int32), v


def _samples_us(times_ms) -> list[float]:
    return [1000.0 * t for t in (times_ms if isinstance(times_ms, list) else [times_ms])]


def _cpu_times(fn, reps: int = 2) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(1e6 * (time.perf_counter() - t))
    return out


def bench_graph(fn) -> list[float]:
    import triton

    if DEVICE == "cpu":
        return _cpu_times(fn)
    return _samples_us(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="all"))


def bench(fn) -> list[float]:
    import triton

    if DEVICE == "cpu":
        return _cpu_times(fn)
    return _samples_us(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="all"))


def flashinfer_tensor_cores(dtype) -> bool:
    """SGLang's choice for its decode wrapper (``flashinfer_backend.should_use_tensor_core``)."""
    try:
        from sglang.srt.layers.attention.flashinfer_backend import should_use_tensor_core

        return should_use_tensor_core(kv_cache_dtype=dtype, num_attention_heads=Q_HEADS,
                                      num_kv_heads=KV_HEADS)
    except Exception:  # SGLang's rule: GQA groups of 4 or more on tensor cores
        return Q_HEADS // KV_HEADS >= 4


def flashinfer_decode(q, k, v, indptr, indices, scale):
    """FlashInfer's decode as SGLang's backend runs it in a CUDA graph: a function returning
    the output (allocated per call, as in SGLang)."""
    import torch
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    batch = q.shape[0]
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    fi_indptr = indptr.to(torch.int32)
    fi_indices = indices.to(torch.int32)
    last_page_len = torch.ones(batch, dtype=torch.int32, device=q.device)
    # the CUDA-graph buffers plan() fills, as SGLang's capture-time wrappers hold them
    wrapper = BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", backend="fa2", use_cuda_graph=True,
        use_tensor_cores=flashinfer_tensor_cores(k.dtype),
        paged_kv_indptr_buffer=torch.empty_like(fi_indptr),
        paged_kv_indices_buffer=torch.empty_like(fi_indices),
        paged_kv_last_page_len_buffer=torch.ones_like(last_page_len))
    wrapper.begin_forward(fi_indptr, fi_indices, last_page_len, Q_HEADS, KV_HEADS, HEAD_DIM, 1,
                          data_type=k.dtype, q_data_type=q.dtype, non_blocking=True)
    return lambda: wrapper.forward(q, (k, v), sm_scale=scale)


def decode_case(batch: int, ctx: int, moved_frac: float, sides=SIDES) -> dict:
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang_pic_kernel.rotating_attention import rotating_decode_attention_fwd

    dev = DEVICE
    moved = int(ctx * moved_frac) // PAGE * PAGE
    offset = ctx - moved
    lens = [ctx] * batch
    indptr, indices, slots = scattered_indices(lens, dev)
    table = llama3_table(ctx + 1)
    k, k_at_index, stored, v = shifted_pool(slots, indptr, indices, offset, moved, table)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=dev, dtype=k.dtype)
    scale = HEAD_DIM**-0.5
    splits = num_kv_splits(torch.tensor(lens, device=dev, dtype=torch.int32))
    logits = torch.empty(batch, Q_HEADS, MAX_KV_SPLITS, HEAD_DIM, device=dev)
    lse = torch.empty(batch, Q_HEADS, MAX_KV_SPLITS, device=dev)
    meta = (indptr, indices, logits, lse, splits, MAX_KV_SPLITS, scale)
    outs = {s: torch.empty_like(q) for s in (*SIDES, "reference")}

    fns = {
        "triton": lambda: decode_attention_fwd(q, k, v, outs["triton"], *meta, 1.0, 1.0),
        "pic": lambda: rotating_decode_attention_fwd(q, k, v, outs["pic"], *meta, rope=table,
                                                     stored_positions=stored),
    }
    if "flashinfer" in sides:
        fns["flashinfer"] = flashinfer_decode(q, k, v, indptr, indices, scale)
        outs["flashinfer"] = fns["flashinfer"]()
    decode_attention_fwd(q, k_at_index, v, outs["reference"], *meta, 1.0, 1.0)
    row = {"kind": "decode", "batch": batch, "context": ctx, "offset": offset, "moved": moved}
    for side, fn in fns.items():
        row[f"{side}_samples_us"] = bench_graph(fn)
        row[f"{side}_us"] = statistics.median(row[f"{side}_samples_us"])
    _diffs(row, outs, fns, moved)
    return row


def _diffs(row: dict, outs: dict, fns: dict, moved: int) -> None:
    """Ours against SGLang's Triton kernel over keys rotated at their index; with nothing
    moved, FlashInfer against the same; with keys moved, SGLang's Triton kernel over the keys as
    stored against the same (how wrong reading them unturned is)."""
    ref = outs["reference"].float()
    row["pic_max_abs_diff"] = (outs["pic"].float() - ref).abs().max().item()
    if "flashinfer" in fns and not moved:
        row["flashinfer_max_abs_diff"] = (outs["flashinfer"].float() - ref).abs().max().item()
    if moved:  # what reading the moved keys unturned gets wrong
        row["triton_unturned_max_abs_diff"] = (outs["triton"].float() - ref).abs().max().item()


def flashinfer_extend(q, k_new, v_new, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, prefix,
                      scale):
    """FlashInfer's extend as SGLang's backend runs it (ragged new tokens + paged prefix): a
    function returning the output."""
    import torch
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
    from flashinfer.cascade import merge_state

    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    qo = qo_indptr.to(torch.int32)
    ragged = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="auto")
    ragged.begin_forward(qo, qo, Q_HEADS, KV_HEADS, HEAD_DIM, q_data_type=q.dtype)
    if not prefix:
        return lambda: ragged.forward(q, k_new, v_new, causal=True, sm_scale=scale)
    paged = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    last_page_len = torch.ones(qo.numel() - 1, dtype=torch.int32, device=q.device)
    paged.begin_forward(qo, kv_indptr.to(torch.int32), kv_indices.to(torch.int32), last_page_len,
                        Q_HEADS, KV_HEADS, HEAD_DIM, 1, q_data_type=q.dtype,
                        kv_data_type=k_buf.dtype, non_blocking=True)

    def run():
        o1, s1 = ragged.forward_return_lse(q, k_new, v_new, causal=True, sm_scale=scale)
        o2, s2 = paged.forward_return_lse(q, (k_buf, v_buf), causal=False, sm_scale=scale)
        return merge_state(o1, s1, o2, s2)[0]

    return run


def extend_case(offset: int, moved: int, new: int, batch: int = 1, sides=SIDES) -> dict:
    import torch
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang_pic_kernel.rotating_attention import rotating_extend_attention_fwd

    dev, dt = DEVICE, torch.bfloat16 if DEVICE == "cuda" else torch.float32
    prefix = offset + moved
    indptr, indices, slots = scattered_indices([prefix] * batch, dev)
    table = llama3_table(prefix + new + 1)
    k_buf, k_buf_at_index, stored, v_buf = shifted_pool(slots, indptr, indices, offset, moved,
                                                        table)
    n = new * batch
    q = torch.randn(n, Q_HEADS, HEAD_DIM, device=dev, dtype=dt)
    new_pos = (prefix + torch.arange(new, device=dev)).repeat(batch)
    k_new = rotate_at(torch.randn(n, KV_HEADS, HEAD_DIM, device=dev, dtype=dt), new_pos, table)
    v_new = torch.randn_like(k_new)
    qo_indptr = torch.arange(0, n + 1, new, device=dev, dtype=torch.int64)
    scale = HEAD_DIM**-0.5
    outs = {s: torch.empty_like(q) for s in (*SIDES, "reference")}

    def triton_side(k_pool, out):
        return lambda: extend_attention_fwd(q, k_new, v_new, out, k_pool, v_buf, qo_indptr,
                                            indptr, indices, None, True, None, new, 1.0, 1.0,
                                            scale)

    fns = {
        "triton": triton_side(k_buf, outs["triton"]),
        "pic": lambda: rotating_extend_attention_fwd(
            q, k_new, v_new, outs["pic"], k_buf, v_buf, qo_indptr, indptr, indices, None, True,
            None, new, 1.0, 1.0, scale, rope=table, stored_positions=stored),
    }
    if "flashinfer" in sides:
        fns["flashinfer"] = flashinfer_extend(q, k_new, v_new, k_buf, v_buf, qo_indptr, indptr,
                                              indices, prefix, scale)
    triton_side(k_buf_at_index, outs["reference"])()
    for side, fn in fns.items():
        res = fn()  # compile outside the timed region
        if side == "flashinfer":
            outs[side] = res
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    row = {"kind": "extend", "batch": batch, "prefix": prefix, "offset": offset,
           "moved": moved, "new": new}
    for side, fn in fns.items():
        row[f"{side}_samples_us"] = bench(fn)
        row[f"{side}_us"] = statistics.median(row[f"{side}_samples_us"])
    _diffs(row, outs, fns, moved)
    return row


def tune_decode(cases, out: Path, best_config_out: str | None) -> None:
    """Sweep stage-1 launch configs; pick the lowest geometric-mean ratio to SGLang's Triton."""
    import itertools
    import math
    from functools import partial

    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang_pic_kernel.rotating_attention import rotating_decode_attention_fwd

    configs = list(itertools.product((16, 32, 64), (2, 4, 8), (1, 2, 3)))
    ratios: dict[str, list[float]] = {}
    rows = []
    for batch, ctx, frac in cases:
        moved = int(ctx * frac) // PAGE * PAGE
        indptr, indices, slots = scattered_indices([ctx] * batch, "cuda")
        table = llama3_table(ctx + 1)
        k, _, stored, v = shifted_pool(slots, indptr, indices, ctx - moved, moved, table)
        q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        splits = num_kv_splits(torch.full((batch,), ctx, device="cuda", dtype=torch.int32))
        args = (torch.empty_like(q), indptr, indices,
                torch.empty(batch, Q_HEADS, MAX_KV_SPLITS, HEAD_DIM, device="cuda"),
                torch.empty(batch, Q_HEADS, MAX_KV_SPLITS, device="cuda"), splits,
                MAX_KV_SPLITS, HEAD_DIM**-0.5)
        base = statistics.median(bench_graph(partial(decode_attention_fwd, q, k, v, *args,
                                                     1.0, 1.0)))
        for cfg in configs:
            fn = partial(rotating_decode_attention_fwd, q, k, v, *args, rope=table,
                         stored_positions=stored, config=cfg)
            try:
                fn()
                t = statistics.median(bench_graph(fn))
            except Exception as e:  # e.g. out of shared memory for a large tile
                print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                continue
            key = ",".join(map(str, cfg))
            ratios.setdefault(key, []).append(t / base)
            rows.append({"batch": batch, "context": ctx, "moved": moved, "config": key,
                         "us": t, "triton_us": base})
        mine = [r for r in rows if (r["batch"], r["context"], r["moved"]) == (batch, ctx, moved)]
        print(f"tuned b={batch} ctx={ctx} moved={moved}: triton {base:.1f} us, best "
              f"{min(mine, key=lambda r: r['us'])}", flush=True)
    complete = {k: v for k, v in ratios.items() if len(v) == len(cases)}
    score = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in complete.items()}
    ranked = sorted(score.items(), key=lambda kv: kv[1])
    for key, g in ranked[:8]:
        print(f"  {key:<10} geomean ratio {g:.3f}  per case "
              f"{' '.join(f'{x:.3f}' for x in complete[key])}")
    best = ranked[0][0]
    from benchmark.harness import environment

    (out / "rotating_decode_tuning_shifted.json").write_text(json.dumps(
        {"benchmark": "rotating_decode_tuning_shifted", "environment": environment(),
         "cases": cases, "rows": rows, "geomean_ratio": score, "best": best}, indent=1))
    if best_config_out:
        Path(best_config_out).write_text(f"{best}\n")
    print(f"best decode config (BLOCK_N,WARPS,STAGES): {best} "
          f"(geomean ratio {ranked[0][1]:.3f})")


def print_row(r: dict, t0: float) -> None:
    base = r["triton_us"]
    shape = (f"decode b={r['batch']:<4} ctx={r['context']:<6}" if r["kind"] == "decode"
             else f"extend prefix={r['prefix']:<6} new={r['new']:<5}")
    parts = "  ".join(f"{s} {r[f'{s}_us']:9.1f} ({r[f'{s}_us'] / base:.3f})"
                      for s in SIDES if f"{s}_us" in r)
    diff = f"pic diff {r['pic_max_abs_diff']:.1e}"
    if "flashinfer_max_abs_diff" in r:
        diff += f"  flashinfer diff {r['flashinfer_max_abs_diff']:.1e}"
    print(f"[{time.perf_counter() - t0:5.0f}s] {shape} moved={r['moved']:<6} us (x triton): "
          f"{parts}  {diff}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None,
                    help="results folder (default benchmark/results; with --quick a temp folder)")
    ap.add_argument("--quick", action="store_true", help="a few small cases (GPU smoke test)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the script: tiny cases under TRITON_INTERPRET=1, no "
                         "FlashInfer")
    ap.add_argument("--no-flashinfer", action="store_true",
                    help="leave FlashInfer out (SGLang Triton vs ours only)")
    ap.add_argument("--tune-decode", action="store_true",
                    help="sweep the decode kernel's BLOCK_N / num_warps / num_stages")
    ap.add_argument("--best-config-out", default=None,
                    help="with --tune-decode: write the best BLOCK_N,WARPS,STAGES here")
    args = ap.parse_args()
    global DEVICE
    if args.smoke:
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton
        DEVICE = "cpu"

    import torch

    from benchmark.harness import environment, smoke_dir

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_rotating_attention needs a CUDA GPU (the CPU check is the kernel tests: "
                 "TRITON_INTERPRET=1 pytest test/kernels/test_rotating_attention.py)")
    args.out = args.out or (smoke_dir() if args.quick or args.smoke
                            else str(REPO / "benchmark" / "results"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if args.tune_decode:
        if args.smoke:
            sys.exit("--tune-decode needs a GPU")
        tune_decode(TUNE_CASES[:2] if args.quick else TUNE_CASES, out, args.best_config_out)
        return
    no_flashinfer = args.no_flashinfer or args.smoke
    sides = tuple(s for s in SIDES if not (no_flashinfer and s == "flashinfer"))
    decode_grid, extend_grid = ((DECODE_SMOKE, EXTEND_SMOKE) if args.smoke
                                else (DECODE_QUICK, EXTEND_QUICK) if args.quick
                                else (DECODE_GRID, EXTEND_GRID))
    rows = []
    t0 = time.perf_counter()
    for b, c, f in decode_grid:
        rows.append(decode_case(b, c, f, sides))
        print_row(rows[-1], t0)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for o, m, n in extend_grid:
        rows.append(extend_case(o, m, n, sides=sides))
        print_row(rows[-1], t0)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    print("\nmedian us, and time / SGLang Triton (moved keys: SGLang's and FlashInfer's kernels "
          "read the same bytes unturned)")
    print(f"{'case':<34}{'moved':>7}" + "".join(f"{s:>20}" for s in sides))
    for r in rows:
        case = (f"decode b{r['batch']} ctx {r['context']}" if r["kind"] == "decode"
                else f"extend {r['prefix']} + {r['new']} new")
        cells = "".join(f"{r[f'{s}_us']:>11.1f} ({r[f'{s}_us'] / r['triton_us']:.3f})"
                        for s in sides)
        print(f"{case:<34}{r['moved']:>7}{cells}")

    report = {"benchmark": "rotating_attention_kernels_shifted", "environment": environment(),
              "config": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                         "page_size": PAGE, "dtype": "float32" if args.smoke else "bfloat16",
                         "rope": "llama3",
                         "max_kv_splits": MAX_KV_SPLITS, "sides": list(sides),
                         "flashinfer_tensor_cores": flashinfer_tensor_cores(torch.bfloat16),
                         "quick": args.quick, "smoke": args.smoke},
              "rows": rows}
    try:
        import flashinfer

        report["environment"]["flashinfer"] = flashinfer.__version__
    except ImportError:
        report["environment"]["flashinfer"] = None
    path = out / "rotating_attention_kernels_shifted.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
