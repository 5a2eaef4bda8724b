"""Recall of the GPU selector (the Triton kernels) against the torch reference, on the same real
keys: does the fast path retrieve what the specification retrieves?

SmolLM2-135M-Instruct (real weights, float32 HF model) reads one needle case per length
(``quality/sparse_needle.py``'s cases); every chosen layer's post-RoPE query at the last prompt
position and its keys are captured once, then both index implementations of
``sglang_pic.sparse.index_ops`` encode the retrieval region ``[sink, n - local)`` and select
``topk`` keys per KV head, and recall@topk is measured against the exact top-``topk`` of ``max
over the group of q.k`` (``sparse_needle.selection_recall``):

- ``torch-reference``: ``TorchIndexOps`` (votes and rerank in float, exact top-C pruning);
- ``kernels``: ``KernelIndexOps`` (what ``pariskv_triton`` runs: 8-bit query planes, popcount
  votes, histogram pruning). On CPU they run under ``TRITON_INTERPRET=1`` (slow: ~10 s per
  layer at 2K, ~30 s at 8K), on a GPU natively.

The kernels lose recall only by quantisation and by which keys of the threshold bin they keep;
a ratio near 1 is the check: a vote histogram that does not cover real keys' votes shows here
as a ratio well below 1.

    python3 -m benchmark.sparse.bench_selector_recall [--lengths 2k 8k] [--layers 0,5,12,20,29]

Writes ``selector_recall_<cpu|gpu>.json`` into ``--out`` (default ``benchmark/results``): per
variant ``recall_<length>_all`` (one value per layer, mean over KV heads) and the layers.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmark import description


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None, help="default benchmark/results")
    ap.add_argument("--lengths", nargs="+", default=["2k", "8k"], choices=["2k", "4k", "8k"])
    ap.add_argument("--layers", default="0,5,12,20,29",
                    help="comma-separated layer numbers (SmolLM2 has 30), or 'all'")
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--candidates", type=int, default=800)
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--local", type=int, default=128)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = ap.parse_args()
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    from sglang_pic.launcher.default_model import ensure_default_model
    from sglang_pic.sparse.index_ops import KernelIndexOps, TorchIndexOps
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmark.harness import RESULTS, environment
    from benchmark.quality.sparse_needle import TASKS, build_cases, capture_qk, selection_recall

    model_dir = str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    layers = (list(range(cfg.num_hidden_layers)) if args.layers == "all"
              else [int(x) for x in args.layers.split(",")])
    if not layers or not all(0 <= x < cfg.num_hidden_layers for x in layers):
        ap.error(f"--layers: numbers in [0, {cfg.num_hidden_layers}), got {args.layers}")
    knobs = {"sink": args.sink, "local": args.local, "topk": args.topk}
    variants = {"torch-reference": TorchIndexOps, "kernels": KernelIndexOps}
    # not an attention backend comparison: both sides select from the same index ("n/a")
    results: dict = {v: {"index_ops": cls.__name__, "attention_backend": "n/a"}
                     for v, cls in variants.items()}
    cases = {}
    for length in args.lengths:
        case = build_cases(tok, [length], TASKS, 1, 12)[0]
        t0 = time.perf_counter()
        captured = capture_qk(model, case["input_ids"], device)
        per_layer = [captured[i] for i in layers]
        n = len(case["input_ids"])
        cases[length] = {"task": case["task"], "tokens": n}
        print(f"[selector-recall] {length}: {n} tokens captured in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        for name, cls in variants.items():
            ops = cls(len(layers), 1, hq, hkv, d, n - args.sink - args.local, args.topk,
                      args.candidates, args.sink + args.topk + args.local, device)
            t0 = time.perf_counter()
            recall = selection_recall(ops, per_layer, knobs, device)
            results[name][f"recall_{length}_all"] = recall
            results[name][f"recall_{length}_s"] = time.perf_counter() - t0
            print(f"[selector-recall] {length} {name:>15}: recall@{args.topk} "
                  f"{sum(recall) / len(recall):.3f} (layers {layers}: "
                  f"{', '.join(f'{r:.2f}' for r in recall)}) in {time.perf_counter() - t0:.1f} s",
                  flush=True)
    report = {"benchmark": f"selector_recall_{'gpu' if device == 'cuda' else 'cpu'}",
              "environment": environment(),
              "params": {**knobs, "candidates": args.candidates, "layers": layers,
                         "model": "SmolLM2-135M-Instruct", "device": device, "cases": cases},
              "results": results}
    folder = Path(args.out) if args.out else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{report['benchmark']}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"\n length  {'torch-reference':>16}  {'kernels':>8}  kernels/reference")
    for length in args.lengths:
        ref, ker = (sum(results[v][f"recall_{length}_all"]) / len(layers) for v in variants)
        print(f" {length:>6}  {ref:>16.3f}  {ker:>8.3f}  {ker / ref if ref else float('nan'):.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
