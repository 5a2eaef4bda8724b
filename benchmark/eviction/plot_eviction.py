"""Token hit rate vs cache size per workload, one line per policy (from eviction_sim.json); the
offline ``belady`` bound, when present, dashed."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def mean_rates(rows: list[dict]) -> dict[tuple[str, float, str], float]:
    """(workload, fraction, policy) -> token hit rate averaged over the seeds."""
    acc: dict[tuple[str, float, str], list[float]] = {}
    for r in rows:
        acc.setdefault((r["workload"], r["fraction"], r["policy"]), []).append(
            r["token_hit_rate"])
    return {k: sum(v) / len(v) for k, v in acc.items()}


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(path).read_text())
    rows = report["rows"]
    rates = mean_rates(rows)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    cols = min(3, len(workloads))
    nrows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, w in zip(axes.flat, workloads, strict=False):
        for pol in report["policies"]:
            pts = sorted((f, rate) for (wl, f, p), rate in rates.items()
                         if wl == w and p == pol)
            style = ({"lw": 2.5, "color": "black"} if pol == "sae" else
                     {"lw": 1.5, "color": "grey", "ls": "--"} if pol == "belady" else
                     {"lw": 1, "color": "black", "ls": ":"} if pol.startswith("sae-") else
                     {"lw": 1, "alpha": 0.8})
            ax.plot([100 * x for x, _ in pts], [100 * y for _, y in pts], marker="o", ms=3,
                    label=pol, **style)
        ax.set_title(w)
        ax.set_xlabel("cache size (% of unique tokens)")
        ax.set_ylabel("token hit rate (%)")
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, ncol=2)
    seeds = report.get("seeds", 1)
    fig.suptitle("Prefix-cache token hit rate, SGLang RadixCache replay "
                 f"(sglang {report['environment']['sglang']}"
                 f"{f', mean of {seeds} seeds' if seeds > 1 else ''})", fontsize=10)
    fig.tight_layout()
    out = REPO / "docs" / "figures" / "eviction_hit_rate.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
