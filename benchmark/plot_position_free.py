"""Plot position-free KV results: kernel time ratios and end-to-end ratios vs vanilla SGLang.

    python -m benchmark.plot_position_free [--shifted FILE] [--figures DIR]

History, the earlier layout (keys stored un-rotated, rotated on read at their index; its kernels
are gone): reads ``benchmark/results/rotating_attention_kernels_h200.json`` and
``benchmark/results/position_free_h200_tuned.json`` (+ ``_untuned`` for the 32K cases) and writes
``position_free_kernels.png`` and ``position_free_e2e.png``.

The shifted layout: with ``--shifted`` (a ``rotating_attention_kernels_shifted.json`` written by
``benchmark/kernels/bench_rotating_attention.py``), or when
``benchmark/results/rotating_attention_kernels_shifted_h200.json`` exists, also
``position_free_kernels_shifted.png``: each side's time over SGLang's Triton kernel, decode and
extend, with no key moved and with a span moved. Figures go to ``docs/figures`` unless
``--figures`` names another folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmark import description

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmark" / "results"
FIGURES = REPO / "docs" / "figures"
SHIFTED = RESULTS / "rotating_attention_kernels_shifted_h200.json"


def _bars(ax, labels, series: dict[str, list[float]], title: str) -> None:
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.bar(xs, vals, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.03, color="red", lw=0.8, ls="--", label="+3 % target")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("time, sglang-pic / vanilla")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def plot_kernels() -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads((RESULTS / "rotating_attention_kernels_h200.json").read_text())
    rows = report["rows"]
    dec = [r for r in rows if r["kind"] == "decode"]
    ext = [r for r in rows if r["kind"] == "extend"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [9, 5]})
    _bars(a1, [f"b{r['batch']} ctx{r['context'] // 1024}K" for r in dec],
          {m: [r[f"pic_{m}_us"] / r["vanilla_us"] for r in dec] for m in ("step", "cache")},
          "decode (RoPE source: step = default, cache = table row per key)")
    _bars(a2, [f"prefix {r['prefix'] // 1024}K + {r['new']}" for r in ext],
          {k: [r[f"pic_{k}_us"] / r["vanilla_us"] for r in ext]
           for k in ("pre_rotated_cache", "in_kernel_cache")},
          "extend (new keys pre-rotated = default)")
    env = report["environment"]
    return _save(fig, f"Rotating attention kernels vs SGLang {env.get('sglang')} Triton kernels, "
                 f"Llama-3-8B shapes, bf16, {env.get('gpu')}", "position_free_kernels.png")



def _save(fig, title: str, name: str) -> Path:
    """Title the kernel figure and write it to ``FIGURES/name``."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    out = FIGURES / name
    fig.savefig(out, dpi=120)
    return out

def plot_e2e() -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tuned = json.loads((RESULTS / "position_free_h200_tuned.json").read_text())
    untuned = json.loads((RESULTS / "position_free_h200_untuned.json").read_text())
    ratios = {r["metric"]: r["ratio"] for r in tuned["ratios"] if r["metric"] != "engine_start_s"}
    for r in untuned["ratios"]:  # the 32K cases ran only before decode tuning
        if "32768" in r["metric"] and r["metric"] not in ratios and r["metric"].startswith("prefill"):
            ratios[r["metric"] + " (before tuning)"] = r["ratio"]
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [m.replace("_ms", "").replace("tpot_", "decode ") for m in ratios]
    _bars(ax, labels, {"sglang-pic": list(ratios.values())},
          "End to end on the H200: Llama-3.1-8B shape, dummy weights, triton vs pic_triton")
    fig.tight_layout()
    out = FIGURES / "position_free_e2e.png"
    fig.savefig(out, dpi=120)
    return out


def plot_shifted_kernels(src: Path) -> Path:
    """Shifted-layout kernels: SGLang Triton = 1, FlashInfer and ours, per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(src.read_text())
    sides = [s for s in report["config"]["sides"] if s != "triton"]
    names = {"flashinfer": "FlashInfer", "pic": "ours (shifted)"}
    rows = report["rows"]
    dec = [r for r in rows if r["kind"] == "decode"]
    ext = [r for r in rows if r["kind"] == "extend"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [3, 1]})

    def label(r):
        keys = r["context"] if r["kind"] == "decode" else max(r["prefix"], 1)
        moved = f"{round(100 * r['moved'] / keys)} % moved"
        if r["kind"] == "decode":
            ctx = f"{r['context'] // 1024}K" if r["context"] >= 1024 else str(r["context"])
            return f"b{r['batch']} {ctx}, {moved}"
        return f"{r['prefix']} + {r['new']}, {moved}"

    for ax, part, title in ((axes[0], dec, "decode (CUDA graphs)"), (axes[1], ext, "extend")):
        if part:
            _bars(ax, [label(r) for r in part],
                  {names.get(s, s): [r[f"{s}_us"] / r["triton_us"] for r in part] for s in sides},
                  title)
        ax.set_ylabel("time / SGLang Triton kernel")
    env = report["environment"]
    return _save(fig, f"Shifted-layout kernels vs SGLang {env.get('sglang')} Triton kernels and "
                 f"FlashInfer {env.get('flashinfer')}, Llama-3-8B shapes, "
                 f"{report['config'].get('dtype')}, {env.get('gpu')}",
                 "position_free_kernels_shifted.png")


def main() -> None:
    import argparse

    global FIGURES
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--shifted", type=Path, default=None,
                    help=f"shifted-layout kernel results (default {SHIFTED.name} if present)")
    ap.add_argument("--figures", type=Path, default=FIGURES, help="where the figures go")
    args = ap.parse_args()
    FIGURES = args.figures
    print(plot_kernels())
    print(plot_e2e())
    shifted = args.shifted or (SHIFTED if SHIFTED.exists() else None)
    if shifted is not None:
        print(plot_shifted_kernels(shifted))


if __name__ == "__main__":
    main()
