"""Plot a prefix-reuse result (vanilla vs sglang-pic) as grouped bars.

    python -m benchmark.plot_prefix_reuse [benchmark/results/prefix_reuse_h200.json]

Writes docs/figures/<name>.png. Runs where matplotlib is installed (our CPU env), not on the device.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(path.read_text())
    res = report["results"]
    env = report["environment"]
    cases = [("cold", "cold"), ("reused", "same prefix"), ("other_system", "other system prompt")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.38
    for i, variant in enumerate(("vanilla", "sglang-pic")):
        vals = [res[variant][f"ttft_{c}_ms"] for c, _ in cases]
        xs = [j + (i - 0.5) * width for j in range(len(cases))]
        bars = ax1.bar(xs, vals, width, label=variant)
        ax1.bar_label(bars, fmt="%.0f", fontsize=8)
        bar = ax2.bar([i], [res[variant]["rag_requests_per_s"]], 0.6, label=variant)
        ax2.bar_label(bar, fmt="%.2f", fontsize=8)
    ax1.set_xticks(range(len(cases)), [label for _, label in cases])
    ax1.set_ylabel("TTFT (ms), median")
    p = report["params"]
    ax1.set_title(f"system({p['system_tokens']}) + document({p['doc_tokens']}) + question({p['question_tokens']})")
    ax1.legend()
    ax2.set_xticks([0, 1], ["vanilla", "sglang-pic"])
    ax2.set_ylabel("requests / s")
    ax2.set_title(f"RAG batch ({p['rag_requests']} req)")
    fig.suptitle(f"{env.get('gpu')} · sglang {env.get('sglang')} · torch {env.get('torch')} · "
                 "Llama-3-8B shape, dummy weights, triton backend", fontsize=9)
    fig.tight_layout()
    out = REPO / "docs" / "figures" / f"{path.stem}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "benchmark/results/prefix_reuse_h200.json"
    print(plot(src))
