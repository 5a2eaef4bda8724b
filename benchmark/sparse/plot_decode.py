"""Plot `benchmark/results/sparse_decode_h200.json` into `docs/figures/sparse_decode_h200.png`:
decode attention time per layer (dense SGLang vs ParisKV) and recall@100 against context length.

    python -m benchmark.sparse.plot_decode [RESULTS.json] [OUT.png]
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from benchmark.harness import save_figure

REPO = Path(__file__).resolve().parent.parent.parent


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "benchmark/results/sparse_decode_h200.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else REPO / "docs/figures/sparse_decode_h200.png"
    rows = [r for r in json.loads(src.read_text())["rows"] if "sparse_us" in r]
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(12, 4.2))
    styles = {1: "-", 8: "--"}
    for batch in sorted({r["batch"] for r in rows}):
        mine = [r for r in rows if r["batch"] == batch]
        ctxs = sorted({r["context"] for r in mine})
        dense = [next(r["dense_us"] for r in mine if r["context"] == c) for c in ctxs]
        ax_t.plot(ctxs, [d / 1000 for d in dense], styles[batch], color="#888888", marker="o",
                  label=f"dense SGLang triton, batch {batch}")
        strides = sorted({r.get("sample_stride", 1) for r in mine})
        for (cand, color), stride in itertools.product(((2048, "#1f77b4"), (16384, "#ff7f0e")),
                                                       strides):
            pts = [(r["context"], r["sparse_us"], r["recall_at_k"]) for r in mine
                   if r["candidates"] == cand and r.get("sample_stride", 1) == stride]
            if not pts:
                continue
            how = "" if len(strides) == 1 else (
                ", exact pruning" if stride == 1 else f", threshold from 1/{stride}")
            marker = "o" if stride == 1 else "s"
            alpha = 0.45 if stride == 1 and len(strides) > 1 else 1.0
            ax_t.plot([p[0] for p in pts], [p[1] / 1000 for p in pts], styles[batch],
                      marker=marker, color=color, alpha=alpha,
                      label=f"ParisKV C={cand}, batch {batch}{how}")
            ax_r.plot([p[0] for p in pts], [p[2] for p in pts], styles[batch], marker=marker,
                      color=color, alpha=alpha, label=f"C={cand}, batch {batch}{how}")
    for ax in (ax_t, ax_r):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("decode attention per layer (ms)")
    ax_t.legend(fontsize=7)
    ax_r.axhline(0.9, color="black", lw=0.8, ls=":")
    ax_r.set_ylabel("recall@100 vs exact top-100")
    ax_r.set_ylim(0.8, 1.0)
    ax_r.legend(fontsize=7)
    fig.suptitle("ParisKV decode on the H200 (Llama-3-8B attention shape, bf16, CUDA graphs; "
                 "synthetic keys with heavy hitters)", fontsize=10)
    save_figure(fig, out)


if __name__ == "__main__":
    main()
