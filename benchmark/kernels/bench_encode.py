"""The ParisKV encode of a request's retrieval region (its activation), two ways, on one GPU.

A request's first sparse decode step encodes every key of its retrieval region, per layer:
128K tokens x 8 KV heads x head dim 128 for Llama-3-8B at 128K. ``encode_keys`` rotates the keys
either inside the kernel (Triton's fp32 FMA product; what every key took before, 12 ms a layer
at 128K on the H200) or, from ``PREROTATE_FROM`` keys on, with a chunked cuBLAS fp32 matmul
before the kernel (``sglang_pic_kernel.pariskv.encode``). This times both on the same keys,
alternating which runs first, and checks they agree: centroid words and bit counts equal, codes
equal but for coordinates within rounding of a level edge.

    python3 -m benchmark.kernels.bench_encode [--tokens 131072] [--samples 5] [--out DIR]
    .venv/bin/python -m benchmark.kernels.bench_encode --smoke   # CPU, interpreter, tiny

Prints a table; writes ``pariskv_encode_<gpu>.json`` (machine, versions, config, raw samples in
ms per layer) into ``--out`` (default ``benchmark/results``; the smoke's temp folder with
``--smoke``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmark import description

WAYS = ("in kernel", "cuBLAS first")


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--tokens", type=int, default=131072, help="keys per KV head (a region)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--samples", type=int, default=5, help="timed encodes per way (>= 3)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the script: 300 keys, 2 heads, head dim 64, interpreter")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.tokens, args.kv_heads, args.head_dim, args.samples = 300, 2, 64, 3
    if args.samples < 3 or args.tokens < 1 or args.kv_heads < 1:
        ap.error("--samples must be >= 3, --tokens and --kv-heads >= 1")
    if args.head_dim < 64 or args.head_dim & (args.head_dim - 1):
        ap.error("--head-dim must be a power of two >= 64")

    import torch
    from sglang_pic.sparse.retrieval import SRHT, lloyd_max_levels
    from sglang_pic_kernel.pariskv import encode_keys

    from benchmark.harness import _write_report, environment, gpu_tag, smoke_dir

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_encode: needs a CUDA GPU (or --smoke on a CPU)")
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    n, hk, d = args.tokens, args.kv_heads, args.head_dim
    rt = SRHT(d, 0)(torch.eye(d)).contiguous().to(dev)
    levels = torch.tensor(lloyd_max_levels(d), dtype=torch.float32, device=dev)
    edges = ((levels[1:] + levels[:-1]) / 2).contiguous()
    torch.manual_seed(0)
    keys = torch.randn(n, hk, d, device=dev).to(torch.bfloat16)
    outs = {way: (torch.empty(hk, n, d // 32, dtype=torch.int32, device=dev),
                  torch.empty(hk, n, d // 2, dtype=torch.uint8, device=dev),
                  torch.empty(hk, n, d // 4, dtype=torch.float16, device=dev),
                  torch.empty(hk, d, dtype=torch.int32, device=dev)) for way in WAYS}

    def run(way: str) -> float:
        cent, codes, w, counts = outs[way]
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        encode_keys(keys, rt, edges, levels, cent, codes, w, bit_counts=counts,
                    prerotate_from=n + 1 if way == "in kernel" else 1)
        sync()
        return (time.perf_counter() - t) * 1e3

    for way in WAYS:  # compiles and the cuBLAS handle, untimed
        run(way)
    samples: dict[str, list[float]] = {way: [] for way in WAYS}
    for i in range(args.samples):
        for way in (WAYS if i % 2 == 0 else WAYS[::-1]):
            samples[way].append(round(run(way), 3))
            print(f"[encode] sample {i + 1}/{args.samples} {way}: {samples[way][-1]:.2f} ms",
                  flush=True)

    a, b = outs[WAYS[0]], outs[WAYS[1]]
    codes_a = torch.stack([a[1] & 15, a[1] >> 4], -1)
    codes_b = torch.stack([b[1] & 15, b[1] >> 4], -1)
    agree = {"centroid_words_equal": bool(torch.equal(a[0], b[0])),
             "bit_counts_equal": bool(torch.equal(a[3], b[3])),
             "codes_differing_share": float((codes_a != codes_b).float().mean()),
             "weights_max_abs_diff": float((a[2].float() - b[2].float()).abs().max())}
    rows = [{"way": way, "ms_per_layer": statistics.median(s), "min": min(s), "max": max(s),
             "samples": s} for way, s in samples.items()]
    base = rows[0]["ms_per_layer"]
    print(f"\n{'way':>14} {'ms/layer':>9} {'min':>8} {'max':>8} {'speed-up':>9}")
    for r in rows:
        print(f"{r['way']:>14} {r['ms_per_layer']:9.3f} {r['min']:8.3f} {r['max']:8.3f} "
              f"{base / r['ms_per_layer']:8.2f}x")
    print("agreement:", json.dumps(agree))
    path = _write_report(f"pariskv_encode_{gpu_tag(dev)}",
                         args.out or (smoke_dir() if args.smoke else None), {
        "benchmark": "pariskv_encode", "environment": environment(),
        "config": {"tokens": n, "kv_heads": hk, "head_dim": d, "samples": args.samples,
                   "keys": "randn, bf16", "order": "alternating, in kernel first on even samples",
                   "smoke": args.smoke},
        "results": rows, "agreement": agree})
    print(f"[encode] wrote {path}")


if __name__ == "__main__":
    main()
