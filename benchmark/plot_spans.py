"""Plot `benchmark/results/spans_rag_h200_prefill_graphs.json` (the run the `spans.*` headline rows
read) into `docs/figures/spans_rag_h200.png`.

    python -m benchmark.plot_spans [RESULTS.json] [OUT.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmark.harness import save_figure

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "benchmark/results/spans_rag_h200_prefill_graphs.json"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else REPO / "docs/figures/spans_rag_h200.png"
    res = {k: v for k, v in json.loads(src.read_text())["results"].items() if "rag_requests_per_s" in v}
    names = list(res)
    colors = ["#888888", "#1f77b4", "#ff7f0e"][: len(names)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))

    ax = axes[0]
    vals = [res[n]["rag_requests_per_s"] for n in names]
    ax.bar(names, vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.1f}\n({v / vals[0]:.1f}x)", ha="center", va="bottom", fontsize=8)
    ax.set_title("RAG batch throughput (requests/s)")
    ax.set_ylim(0, max(vals) * 1.3)

    ax = axes[1]
    width = 0.38
    for j, (key, label) in enumerate((("rag_ttft_p50_ms", "p50"), ("rag_ttft_p99_ms", "p99"))):
        ax.bar([i + (j - 0.5) * width for i in range(len(names))], [res[n][key] / 1000 for n in names],
               width, label=label, color=colors, alpha=1.0 if j == 0 else 0.55)
    ax.set_xticks(range(len(names)), names)
    ax.set_title("RAG batch TTFT (s; solid p50, light p99)")

    ax = axes[2]
    cases = [("ttft_cold_ms", "cold"), ("ttft_cached_prefix_ms", "doc cached,\nprefix cached"),
             ("ttft_new_prefix_ms", "doc cached,\nnew prefix")]
    for i, n in enumerate(names):
        ax.bar([c + (i - 1) * 0.27 for c in range(len(cases))], [res[n][k] for k, _ in cases], 0.27,
               label=n, color=colors[i])
    ax.set_xticks(range(len(cases)), [c for _, c in cases])
    ax.set_yscale("log")
    ax.set_title("TTFT of an 8K document (ms, log scale)")
    ax.legend(fontsize=8, loc="lower left")
    report = json.loads(src.read_text())
    backend = report.get("engine_kwargs", {}).get("attention_backend", "?")
    graphs = "off" if report.get("engine_kwargs", {}).get("disable_prefill_cuda_graph") else "on"
    fig.suptitle(f"Span caching on the H200: Llama-3-8B shape, dummy weights, {backend} "
                 f"(prefill CUDA graphs {graphs}); vanilla SGLang 0.5.17 in the same run",
                 fontsize=10)
    save_figure(fig, out)


if __name__ == "__main__":
    main()
