"""Kernel-level cost of position-free KV: our rotating kernels vs SGLang's Triton kernels.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16, llama3 RoPE), one
layer. The vanilla kernels read a pool of keys rotated once at write time; ours read the same
keys un-rotated and rotate them on read. Both get identical metadata (token-level kv_indices
scattered over 16-token pages, SGLang's own kv-split heuristic) and their outputs are compared.

- decode: batch {1, 32, 256} x context {1K, 8K, 32K}, timed inside a CUDA graph as in serving;
  ours with cos/sin stepped from one table row per tile (``step``, the default), read per key
  from the table (``cache``) and computed in-kernel (``compute``);
- extend: prefill {1K, 8K, 32K} with no prefix; a chunked-prefill chunk (8K after 24K cached);
  a prefix hit (64 new tokens after 8K cached); ours with new keys pre-rotated or rotated in the
  kernel, each with both RoPE sources.

    python3 benchmark/kernels/bench_rotating_attention.py [--out benchmark/results] [--quick]
    python3 benchmark/kernels/bench_rotating_attention.py --tune-decode [--best-config-out F]

``--tune-decode`` sweeps the decode kernel's (BLOCK_N, num_warps, num_stages) and RoPE source
over representative cases and reports the config with the lowest geometric-mean time ratio.

Needs a CUDA GPU and SGLang; writes ``rotating_attention_kernels.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "sgl-kernel" / "python"), str(REPO / "benchmark")]

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
MAX_KV_SPLITS = 8  # SGLang's default --triton-attention-num-kv-splits


def llama3_table(max_pos: int, mode: str):
    import torch
    from sglang_pic_kernel.rotating_attention import RotaryTable

    inv = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float) / HEAD_DIM)
    wavelen = 2 * torch.pi / inv
    factor, low, high, orig = 8.0, 1.0, 4.0, 8192
    smooth = (orig / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    mid = (wavelen <= orig / low) & (wavelen >= orig / high)
    inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return RotaryTable.from_inv_freq(inv, max_pos, mode).to("cuda")


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
    return indptr, torch.cat(out).to(torch.int64), total_pages * PAGE


def num_kv_splits(seq_lens):
    import torch
    import triton
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    out = torch.empty(seq_lens.numel(), dtype=torch.int32, device=seq_lens.device)
    cores = torch.cuda.get_device_properties(0).multi_processor_count
    n = seq_lens.numel()
    get_num_kv_splits_triton[(1,)](out, seq_lens, n, 1, Q_HEADS, KV_HEADS, MAX_KV_SPLITS, cores,
                                   MAX_NUM_SEQ=max(256, triton.next_power_of_2(n)))
    return out


def decode_inputs(batch: int, ctx: int, modes):
    """One decode case: a pool of un-rotated keys (ours) and the same keys rotated at their
    positions (vanilla's pool), scattered 16-token pages, SGLang's kv-split choice."""
    from types import SimpleNamespace

    import torch
    from sglang_pic_kernel.rotating_attention import rotate_neox

    dev, dt = "cuda", torch.bfloat16
    lens = [ctx] * batch
    indptr, indices, slots = scattered_indices(lens, dev)
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    tables = {m: llama3_table(ctx + 1, m) for m in modes}
    pos = torch.empty(slots, dtype=torch.int64, device=dev)
    for b in range(batch):
        pos[indices[indptr[b] : indptr[b + 1]]] = torch.arange(ctx, device=dev)
    return SimpleNamespace(
        k=k, v=torch.randn_like(k), k_rot=rotate_neox(k, pos, next(iter(tables.values()))),
        tables=tables, indptr=indptr, indices=indices, scale=HEAD_DIM**-0.5,
        q=torch.randn(batch, Q_HEADS, HEAD_DIM, device=dev, dtype=dt),
        splits=num_kv_splits(torch.tensor(lens, device=dev, dtype=torch.int32)),
        logits=torch.empty(batch, Q_HEADS, MAX_KV_SPLITS, HEAD_DIM, device=dev),
        lse=torch.empty(batch, Q_HEADS, MAX_KV_SPLITS, device=dev),
    )


def bench_graph(fn) -> float:
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=50)


def bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=50)


def decode_case(batch: int, ctx: int) -> dict:
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang_pic_kernel.rotating_attention import rotating_decode_attention_fwd

    d = decode_inputs(batch, ctx, ("step", "cache", "compute"))
    outs = {name: torch.empty_like(d.q) for name in ("vanilla", "step", "cache", "compute")}
    meta = (d.indptr, d.indices, d.logits, d.lse, d.splits, MAX_KV_SPLITS, d.scale)

    def vanilla():
        decode_attention_fwd(d.q, d.k_rot, d.v, outs["vanilla"], *meta, 1.0, 1.0)

    def ours(mode):
        return lambda: rotating_decode_attention_fwd(d.q, d.k, d.v, outs[mode], *meta,
                                                     rope=d.tables[mode])

    row = {"kind": "decode", "batch": batch, "context": ctx}
    row["vanilla_us"] = 1000 * bench_graph(vanilla)
    for mode in ("step", "cache", "compute"):
        row[f"pic_{mode}_us"] = 1000 * bench_graph(ours(mode))
        row[f"pic_{mode}_max_abs_diff"] = (outs[mode].float() - outs["vanilla"].float()).abs().max().item()
    return row


def tune_decode(cases, out: Path, best_config_out: str | None) -> None:
    """Sweep stage-1 launch configs x RoPE source; pick the lowest geometric-mean ratio."""
    import itertools
    import math
    from functools import partial

    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang_pic_kernel.rotating_attention import rotating_decode_attention_fwd

    configs = [c for c in itertools.product((16, 32, 64), (2, 4, 8), (1, 2, 3))]
    modes = ("cache", "step")
    ratios: dict[str, list[float]] = {}
    rows = []
    for batch, ctx in cases:
        d = decode_inputs(batch, ctx, modes)
        args = (torch.empty_like(d.q), d.indptr, d.indices, d.logits, d.lse, d.splits,
                MAX_KV_SPLITS, d.scale)
        base = 1000 * bench_graph(partial(decode_attention_fwd, d.q, d.k_rot, d.v, *args,
                                          1.0, 1.0))
        for mode, cfg in itertools.product(modes, configs):
            fn = partial(rotating_decode_attention_fwd, d.q, d.k, d.v, *args,
                         rope=d.tables[mode], config=cfg)
            try:
                fn()
                t = 1000 * bench_graph(fn)
            except Exception as e:  # e.g. out of shared memory for a large tile
                print(f"  skip {mode} {cfg}: {type(e).__name__}", flush=True)
                continue
            key = f"{mode}:{cfg[0]},{cfg[1]},{cfg[2]}"
            ratios.setdefault(key, []).append(t / base)
            rows.append({"batch": batch, "context": ctx, "config": key, "us": t,
                         "vanilla_us": base})
        print(f"tuned b={batch} ctx={ctx}: vanilla {base:.1f} us, best "
              f"{min((r for r in rows if r['batch'] == batch and r['context'] == ctx), key=lambda r: r['us'])}",
              flush=True)
    complete = {k: v for k, v in ratios.items() if len(v) == len(cases)}
    score = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in complete.items()}
    ranked = sorted(score.items(), key=lambda kv: kv[1])
    for key, g in ranked[:8]:
        print(f"  {key:<16} geomean ratio {g:.3f}  per case "
              f"{' '.join(f'{x:.3f}' for x in complete[key])}")
    best = ranked[0][0]
    (out / "rotating_decode_tuning.json").write_text(json.dumps(
        {"cases": cases, "rows": rows, "geomean_ratio": score, "best": best}, indent=1))
    if best_config_out:
        mode, cfg = best.split(":")
        Path(best_config_out).write_text(f"{mode} {cfg}\n")
    print(f"best decode config: {best} (geomean ratio {ranked[0][1]:.3f})")


def extend_case(prefix: int, new: int, batch: int = 1) -> dict:
    import torch
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang_pic_kernel.rotating_attention import rotate_neox, rotating_extend_attention_fwd

    dev, dt = "cuda", torch.bfloat16
    indptr, indices, slots = scattered_indices([prefix] * batch, dev)
    slots = max(slots, PAGE)
    k_buf = torch.randn(slots, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    v_buf = torch.randn_like(k_buf)
    tables = {m: llama3_table(prefix + new + 1, m) for m in ("cache", "compute")}
    pos = torch.zeros(slots, dtype=torch.int64, device=dev)
    for b in range(batch):
        pos[indices[indptr[b] : indptr[b + 1]]] = torch.arange(prefix, device=dev)
    k_buf_rot = rotate_neox(k_buf, pos, tables["cache"])
    n = new * batch
    q = torch.randn(n, Q_HEADS, HEAD_DIM, device=dev, dtype=dt)
    k_new = torch.randn(n, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    v_new = torch.randn_like(k_new)
    new_pos = (prefix + torch.arange(new, device=dev)).repeat(batch)
    k_new_rot = rotate_neox(k_new, new_pos, tables["cache"])
    qo_indptr = torch.arange(0, n + 1, new, device=dev, dtype=torch.int64)
    scale = HEAD_DIM**-0.5
    outs = {}

    def vanilla():
        outs.setdefault("vanilla", torch.empty_like(q))
        extend_attention_fwd(q, k_new_rot, v_new, outs["vanilla"], k_buf_rot, v_buf, qo_indptr,
                             indptr, indices, None, True, None, new, 1.0, 1.0, scale)

    def ours(mode, new_keys):
        key = f"{new_keys}_{mode}"
        outs.setdefault(key, torch.empty_like(q))
        return lambda: rotating_extend_attention_fwd(
            q, k_new, v_new, outs[key], k_buf, v_buf, qo_indptr, indptr, indices, None, True,
            None, new, 1.0, 1.0, scale, rope=tables[mode], new_keys=new_keys)

    row = {"kind": "extend", "batch": batch, "prefix": prefix, "new": new}
    vanilla()
    for new_keys in ("pre_rotated", "in_kernel"):
        for mode in ("cache", "compute"):
            ours(mode, new_keys)()  # compile outside the timed region
    torch.cuda.synchronize()
    row["vanilla_us"] = 1000 * bench(vanilla)
    for new_keys in ("pre_rotated", "in_kernel"):
        for mode in ("cache", "compute"):
            key = f"{new_keys}_{mode}"
            row[f"pic_{key}_us"] = 1000 * bench(ours(mode, new_keys))
            row[f"pic_{key}_max_abs_diff"] = (outs[key].float() - outs["vanilla"].float()).abs().max().item()
    return row


def main() -> None:
    import torch
    from harness import smoke_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="results folder (default benchmark/results; with --quick a temp folder)")
    ap.add_argument("--quick", action="store_true", help="a few small cases (smoke test)")
    ap.add_argument("--tune-decode", action="store_true")
    ap.add_argument("--best-config-out", default=None)
    args = ap.parse_args()
    args.out = args.out or (smoke_dir() if args.quick else str(REPO / "benchmark" / "results"))
    torch.manual_seed(0)
    if args.tune_decode:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tune_decode([(1, 32768), (32, 8192), (256, 1024), (256, 8192)], out,
                    args.best_config_out)
        return
    decode_grid = [(1, 1024), (32, 1024)] if args.quick else [
        (b, c) for b in (1, 32, 256) for c in (1024, 8192, 32768)]
    extend_grid = [(0, 1024), (1024, 64)] if args.quick else [
        (0, 1024), (0, 8192), (0, 32768), (24576, 8192), (8192, 64)]
    rows = []
    t0 = time.perf_counter()
    for b, c in decode_grid:
        rows.append(decode_case(b, c))
        r = rows[-1]
        print(f"[{time.perf_counter() - t0:5.0f}s] decode b={b:<4} ctx={c:<6} vanilla "
              f"{r['vanilla_us']:8.1f} us  step {r['pic_step_us']:8.1f} "
              f"({r['pic_step_us'] / r['vanilla_us']:.3f})  cache {r['pic_cache_us']:8.1f} "
              f"({r['pic_cache_us'] / r['vanilla_us']:.3f})  compute {r['pic_compute_us']:8.1f} "
              f"({r['pic_compute_us'] / r['vanilla_us']:.3f})  diff {r['pic_step_max_abs_diff']:.2e}",
              flush=True)
    for p, n in extend_grid:
        rows.append(extend_case(p, n))
        r = rows[-1]
        parts = "  ".join(
            f"{k[4:-3]} {r[k]:9.1f} ({r[k] / r['vanilla_us']:.3f})"
            for k in r if k.startswith("pic_") and k.endswith("_us"))
        print(f"[{time.perf_counter() - t0:5.0f}s] extend prefix={p:<6} new={n:<6} vanilla "
              f"{r['vanilla_us']:9.1f} us  {parts}  diff "
              f"{r['pic_pre_rotated_cache_max_abs_diff']:.2e}", flush=True)
    from harness import environment

    report = {"benchmark": "rotating_attention_kernels", "environment": environment(),
              "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                        "page_size": PAGE, "dtype": "bfloat16", "rope": "llama3"},
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rotating_attention_kernels.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'rotating_attention_kernels.json'}")


if __name__ == "__main__":
    main()
