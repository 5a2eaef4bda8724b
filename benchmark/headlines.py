"""Every number the README and docs quote, read from the raw result JSONs in one place.

Each *claim* names a raw file in ``benchmark/results/``, a metric, the baseline and our variant;
this script reads them, takes the median of each side's samples (a claim may name another
centre, e.g. the mean of 0/1 shares; ``<metric>_all`` where the run kept every sample, else the
one value), and writes ``benchmark/results/headlines.json`` - one row
per claim - and prints the same table. The ratio is oriented so that > 1 means ours is better.

Row fields: ``claim, raw_file, metric, baseline_variant, baseline_backend, ours_variant, baseline,
ours, ratio, spread`` (min-max of each side's samples), ``target, target_kind`` (``ratio``: met
when the ratio is at least ``target``; ``points``: met when ours is at most ``target`` below the
baseline, in the metric's own units, e.g. points of a 0-100 score), ``samples`` (per side, the
smaller), ``same_run`` (both sides from one run: one device call, or consecutive calls of one
machine where a side takes a whole call; a row joining sessions or machines is not), ``meets_target``, ``path`` (what the number
measured, e.g. the store's TCP vs same-node path) and ``note``. A claim whose raw file is missing
is listed with ``ours = null`` and the reason, never dropped silently.

Rules the rows are checked against (``problems`` lists every row that breaks one): the baseline
is vanilla SGLang on FlashInfer (a ``triton`` baseline is a legacy row to re-measure), ``samples``
>= 3 per side, and ``same_run`` true.

The README's results table (``README_ROWS``: the main current row of each capability) is
rendered from the same rows (``readme_table``) between its ``results:start`` / ``results:end``
lines.

    python -m benchmark.headlines            # writes headlines.json and README.md's table
    python -m benchmark.headlines --check    # exit 1 if either is stale
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmark import description

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "headlines.json"
FLASHINFER = "flashinfer"
MIN_SAMPLES = 3


@dataclass(frozen=True)
class Claim:
    """One quoted number: ``ours`` against ``baseline`` in ``raw_file``.

    ``higher_is_better`` orients the ratio (ours / baseline when higher is better, else
    baseline / ours). ``target_kind`` says how ``target`` is met: ``ratio`` >= target, or
    (``points``) ours no more than ``target`` worse than the baseline in the metric's units (a
    score that must stay within 1 point of another: a ratio would allow 0.5 points at 50 and 1
    at 100). ``extract`` overrides the side-by-side reader for files of another layout (the
    eviction replay)."""

    claim: str
    raw_file: str
    metric: str
    baseline_variant: str = "vanilla"
    ours_variant: str = "sglang-pic"
    higher_is_better: bool = False
    target: float | None = None
    target_kind: str = "ratio"  # or "points"
    path: str | None = None
    note: str | None = None
    same_run: bool | None = None  # overrides what the raw file says (a claim joining two files)
    void: str | None = None  # why the raw file's numbers must not be quoted (kept as a record)
    superseded: bool = False  # measured before a fix of what it measures: quoted, flagged
    reruns: tuple[str, ...] = ()  # files re-measuring this row, first preferred (``_source``)
    center: Callable[[list[float]], float] = statistics.median  # of each side's samples
    # (baseline samples, ours, a note[, the baseline variant it chose])
    extract: Callable[[dict], tuple] | None = field(
        default=None, compare=False)


def _samples(result: dict, metric: str) -> list[float]:
    for key in (f"{metric}_all", f"{metric}_samples"):
        if isinstance(result.get(key), list) and result[key]:
            return [float(x) for x in result[key]]
    value = result.get(metric)
    return [float(value)] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def _backend(report: dict, variant: str) -> str | None:
    res = report.get("results", {}).get(variant, {})
    if res.get("attention_backend"):
        return res["attention_backend"]
    kwargs = {**report.get("engine_kwargs", {}),
              **report.get("variant_kwargs", {}).get(variant, {})}
    return kwargs.get("attention_backend")


def _replay(workload: str, fraction: float | None, metric: str = "token_hit_rate",
            baseline: str | None = None, baselines: tuple[str, ...] = (
        "lru", "lfu", "fifo", "mru", "filo", "priority", "slru", "gdsf", "s3fifo")):
    """Eviction replay of generated workloads (``bench_eviction.py``, one cache size per
    ``fraction``; ``two_tier.py --workloads``, one sizing per file: ``fraction`` None): ``sae``'s
    ``metric`` per seed against ``baseline``'s, or the best baseline's, chosen by its mean hit
    rate over seeds."""

    def extract(report: dict) -> tuple[list[float], list[float], str | None]:
        rows = [r for r in report["rows"] if r["workload"] == workload
                and (fraction is None or abs(r["fraction"] - fraction) < 1e-9)]
        by_policy: dict[str, dict[int, dict]] = {}
        for r in rows:
            by_policy.setdefault(r["policy"], {})[r["seed"]] = r
        other = baseline or max((p for p in baselines if p in by_policy), key=lambda p:
                                statistics.mean(r["token_hit_rate"]
                                                for r in by_policy[p].values()))
        seeds = sorted(by_policy["sae"])
        return ([by_policy[other][s][metric] for s in seeds],
                [by_policy["sae"][s][metric] for s in seeds],
                f"best baseline: {other}" if baseline is None else f"against {other}")

    return extract


def _trace_replay(size: str, metric: str = "token_hit_rate", baselines: tuple[str, ...] = (
        "lru", "lfu", "fifo", "mru", "filo", "priority", "slru", "gdsf", "s3fifo", "tlru")):
    """Real-trace replay (``replay_trace.py``): the best baseline's and ``sae``'s ``metric`` at
    one cache size (``token_hit_rate``: the whole trace; ``heldout_hit_rate``: requests in the
    held-out last 40 % by time); one deterministic replay of the one trace per side."""

    def extract(report: dict) -> tuple[list[float], list[float], str | None]:
        by_policy = {r["policy"]: r[metric] for r in report["rows"] if r["size"] == size}
        present = [p for p in baselines if p in by_policy]
        best = max(present, key=lambda p: by_policy[p])
        return [by_policy[best]], [by_policy["sae"]], f"best baseline: {best}"

    return extract


ONLINE_BASELINES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru", "gdsf", "s3fifo",
                    "tlru")
"""Eviction policies a server can run, that ``auto`` and ``sae`` are compared with."""


def _worst_cell(policy: str, metric: str = "token_hit_rate"):
    """Real-trace replay (``replay_trace.py``): ``policy`` against the best online baseline in
    the cache size where ``policy`` is furthest behind it (or least ahead): the claim a user
    can rely on across cache sizes."""

    def extract(report: dict) -> tuple[list[float], list[float], str | None]:
        cells = {}
        for r in report["rows"]:
            cells.setdefault(r["size"], {})[r["policy"]] = r[metric]
        worst = None
        for size, by_policy in cells.items():
            if policy not in by_policy:
                continue
            best = max((p for p in ONLINE_BASELINES if p in by_policy), key=by_policy.get)
            gap = by_policy[policy] - by_policy[best]
            if worst is None or gap < worst[0]:
                worst = (gap, size, best, by_policy[best], by_policy[policy])
        _, size, best, base, ours = worst
        return [base], [ours], f"worst cache size: {size}, best baseline there: {best}"

    return extract


def _generated_worst_cell(policy: str):
    """Generated traffic (``bench_eviction.py``): ``policy`` against the best online baseline in
    the workload and cache size where it is furthest behind, each cell's hit rates averaged over
    the report's seeds."""

    def extract(report: dict) -> tuple[list[float], list[float], str | None]:
        cells: dict[tuple, dict[str, list[float]]] = {}
        for r in report["rows"]:
            cell = cells.setdefault((r["workload"], r["fraction"]), {})
            cell.setdefault(r["policy"], []).append(r["token_hit_rate"])
        worst = None
        for (workload, fraction), by_policy in cells.items():
            mean = {p: statistics.mean(v) for p, v in by_policy.items()}
            best = max((p for p in ONLINE_BASELINES if p in mean), key=mean.get)
            gap = mean[policy] - mean[best]
            if worst is None or gap < worst[0]:
                worst = (gap, workload, fraction, best, mean[best], mean[policy])
        _, workload, fraction, best, base, ours = worst
        return [base], [ours], (f"worst cell: {workload} at {fraction:.0%}, best baseline "
                                f"there: {best}")

    return extract


def _replay_ms_per_request(baseline: str, ours: str):
    """Real-trace replay: each policy's wall time per request, in ms, one sample per cache
    size."""
    def extract(report: dict) -> tuple[list[float], list[float], str | None]:
        def per_request(policy: str) -> list[float]:
            return [1000 * r["wall_s"] / r["requests"] for r in report["rows"]
                    if r["policy"] == policy]
        return per_request(baseline), per_request(ours), None
    return extract


def _e2e_samples(result: dict, metric: str) -> list[float]:
    """A ``bench_e2e.py`` variant's per-run values of ``metric``; ``ttft_mean_ms`` per run from
    every request's TTFT (``request_ttft_ms_all``), which the report keeps for each run."""
    if metric == "ttft_mean_ms" and result.get("request_ttft_ms_all"):
        return [statistics.mean(run) for run in result["request_ttft_ms_all"]]
    return _samples(result, metric)


def _better_vanilla(metric: str, higher_is_better: bool = False):
    """End-to-end eviction (``eviction/bench_e2e.py --rounds N``): the per-run values of the
    vanilla policy with the better mean of this row's metric, and of ``sae``. Each row takes
    its own better vanilla (the higher hit rate, the lower TTFT): a vanilla policy whose runs
    were slowed by something else than its evictions (a fresh machine's compiles) cannot make
    the TTFT row look better than the best vanilla run."""

    def extract(report: dict) -> tuple[list[float], list[float], str | None, str]:
        res = report["results"]
        vanillas = [v for v in res if v.startswith("vanilla") and "error" not in res[v]]
        sign = 1 if higher_is_better else -1
        best = max(vanillas, key=lambda v: sign * statistics.mean(_e2e_samples(res[v], metric)))
        policy = res[best].get("policy", best)
        return (_e2e_samples(res[best], metric), _e2e_samples(res["sglang-pic"], metric),
                f"baseline: vanilla {policy}, the better of {len(vanillas)} vanilla policies by "
                f"mean {metric}; {report.get('rounds', 1)} alternating run(s) per variant", best)

    return extract


def _metric_pair(baseline_metric: str, ours_metric: str, note: str, *,
                 baseline: str = "vanilla", ours: str = "sglang-pic", vanilla_side: bool = True):
    """One run, each side its own variant and metric (the side-by-side reader takes one metric
    for both): e.g. vanilla's recompute against a store reader's cold miss, or vanilla's
    one-pass floor against our cached span. ``vanilla_side`` False: a design comparison inside
    our own code, no backend to name."""

    def extract(report: dict) -> tuple:
        res = report["results"]
        out = (_samples(res[baseline], baseline_metric), _samples(res[ours], ours_metric), note)
        return (*out, baseline) if vanilla_side else out

    return extract


GRID = "spans_rag_grid_h100.json"
GRID_CELLS = ("aligned", "varlen_k6_p256_z07_t4")
GRID_K10 = "spans_rag_grid_k10_h100.json"  # the 10-of-1024 cell, not in GRID's run
GRID_K10_NOTE = ("bench_rag_grid.py cell varlen_k10_p1024_z11_t4 in bursts of 64, 64 output "
                 "tokens; H100. A separate run, with the query turns and merges in torch (the "
                 "Triton kernels the grid above ran took its aligned cell from 28.4 to 36.4 "
                 "req/s)")
GRID_GRAPHS = "sglang-pic-span-graphs"  # the span server with --position-free-span-graphs
# both sides with SGLang's default prefill CUDA graphs (bench_rag_grid --prefill-graphs): span
# extends replay them too; the span server with --position-free-span-graphs only
GRID_PREFILL_GRAPHS = "spans_rag_grid_prefill_graphs_h100.json"
GRID_PREFILL_CELLS = (*GRID_CELLS, "varlen_k10_p1024_z11_t4")
# --span-schedule isps (the default) and ready-first side by side, prefill graphs on both sides
GRID_SCHEDULE = "spans_rag_grid_schedule_h100.json"
GRID_READY_FIRST = "sglang-pic-span-graphs-ready-first"
# the variable-length 6-of-32 cell (Zipf 1.1, 4 tenants), prefill graphs on both sides, alone
GRID_K6_P32 = "spans_rag_grid_k6_p32_h100.json"
GRID_K6_P32_CELL = "varlen_k6_p32_z11_t4"
GRID_IDEAL_MIN = 3.0  # cells with less reuse than this cannot reach the 2.5x target
GRID_K6 = "varlen_k6_p256_z07_t4"
# the k6 cell's runs with prefill graphs on both sides (file, our variant): the first of
# GRID_PREFILL_GRAPHS, the isps side of GRID_SCHEDULE, and a later run of the cell alone
GRID_K6_RUNS = ((GRID_PREFILL_GRAPHS, GRID_GRAPHS), (GRID_SCHEDULE, GRID_GRAPHS),
                ("spans_rag_grid_k6_rerun_h100.json", GRID_GRAPHS))


FLEET = "fleet_rag_gpu.json"  # bench_fleet_rag.py on one GPU, two instances a side
FLEET_ALIGNED = "fleet_rag_aligned_h100.json"  # the same, --cells aligned
ROUTING_SIM = "fleet_routing_sim.json"
SEGMENTED_DECODE = "segmented_decode_h100.json"  # kernels/bench_segmented_decode.py
SEGMENTED_DECODE_K6 = "segmented_decode_h100_varlen_k6_p256_z07_t4.json"  # with --cell
SEGMENTED_DECODE_K6_PATH = ("kernels alone: 64 requests of the grid cell varlen_k6_p256_z07_t4 "
                            "(6 of 256 documents of log-normal lengths, Zipf 0.7, 4 tenants), "
                            "Llama-3-8B heads, bf16, H100; vanilla FlashInfer batch decode over "
                            "each request's keys against segmented attention")
SEGMENTED_DECODE_PATH = ("kernels alone: 128 requests x 4 of 32 shared 2K documents after a "
                         "512-token system prompt, Llama-3-8B heads, bf16, H100; vanilla "
                         "FlashInfer batch decode over each request's keys against segmented "
                         "attention reading runs of the same slots once")
SPAN_STORE_TIER = "span_store_tier.json"  # store/bench_span_store_tier.py
SPAN_STORE_TIER_GPU = "span_store_tier_h100.json"  # the same with --device cuda
SPAN_STORE_TIER_PATH = ("the span store tier alone (a KV pool in a radix tree, one store server "
                        "in its own process)")


def _span_store_tier_worst(metric: str):
    """The span store tier's cell (model shape x span length) where 4 MiB blocks gain least
    over a store entry per pool page on ``metric`` (lower is better), that cell's samples."""

    def extract(report: dict) -> tuple:
        cells = [(shape, n, by_v["token pages"][n], by_v["4 MiB blocks"][n])
                 for shape, by_v in report["cells"].items() for n in by_v["4 MiB blocks"]]
        shape, n, base, ours = min(cells, key=lambda c: c[2][metric] / max(c[3][metric], 1e-9))
        return (_samples(base, metric), _samples(ours, metric),
                f"design comparison, no vanilla side: worst of {len(cells)} cells, {shape} KV and "
                f"a {n}-token span; a store entry per pool page (page size 1) against 4 MiB "
                f"blocks, {report['config']['device']}")

    return extract


def _fleet_store_share(report: dict) -> tuple:
    """The share of each burst's prompt tokens the sglang-pic fleet loaded from the store (a
    document computed through the other instance, or evicted here), over every cell."""
    shares = []
    for c in report["results"]["sglang-pic"]["cells"].values():
        for cached, prompt in zip(c["cached_tokens"], c["prompt_tokens"], strict=True):
            shares.append(cached.get("storage", 0) / prompt)
    return [], shares, None


def _fleet_store_gain(report: dict) -> tuple:
    """Our fleet with its stores against the same fleet without (``sglang-pic-nostore``): each
    burst's requests/s in the report's one cell."""
    (cell,) = report["results"]["sglang-pic"]["cells"]
    return (*_grid_sides(report, cell, "requests_per_s", base="sglang-pic-nostore"),
            f"design comparison, no vanilla side: cell {cell}; the sides ran on two H100 "
            f"machines ({report['resumed_environment']['time_utc']} with the stores, "
            f"{report['environment']['time_utc']} without)")


def _routing_sim(policy: str, metric: str, worst: str = "min", baseline: str = "cache_aware"):
    """``sim_fleet_routing.py``: ``policy`` against ``baseline`` in the cell, fleet size and
    cache where ``metric`` is worst for ``policy`` (``min``: lowest difference to the baseline,
    ``max``: highest value of ours), each side's value per seed."""
    def extract(report: dict) -> tuple:
        groups: dict[tuple, dict[str, list[float]]] = {}
        for r in report["rows"]:
            key = (r["cell"], r["instances"], r["cache"])
            groups.setdefault(key, {}).setdefault(r["policy"], []).append(r[metric])
        def score(k):
            g = groups[k]
            if worst == "max":
                return -statistics.mean(g[policy])
            return statistics.mean(g[policy]) - statistics.mean(g[baseline])
        key = min(groups, key=score)
        cell, n, cache = key
        return (groups[key][baseline], groups[key][policy],
                f"worst case: {cell}, {n} instances, caches of {cache:.0%} of the pool")
    return extract


def _grid_sides(report: dict, cell: str, metric: str, ours: str = "sglang-pic",
                base: str = "vanilla"):
    """A grid cell's samples of ``metric`` on the ``base`` side and ``ours``: per burst for the
    burst metrics, per request for the stream's TTFT (its median is the p50)."""
    res = report["results"]

    def samples(variant: str) -> list[float]:
        c = res[variant]["cells"][cell]
        return [float(x) for x in (c["stream_ttft_ms_all"] if metric == "stream_ttft_ms"
                                   else c[metric])]
    return samples(base), samples(ours)


def _grid_ratio(report: dict, cell: str, metric: str, higher_is_better: bool,
                ours: str = "sglang-pic") -> float:
    base, ours = _grid_sides(report, cell, metric, ours)
    b, o = statistics.median(base), statistics.median(ours)
    return o / b if higher_is_better else b / o


def _grid_ideal(report: dict, cell: str) -> float:
    """The cell's ideal, as the span side recorded it (the same draws for every span variant)."""
    side = next(v for v in report["results"] if v != "vanilla")
    return statistics.median(report["results"][side]["cells"][cell]["ideal"])


def _grid_cell(cell: str, metric: str = "requests_per_s", ours: str = "sglang-pic"):
    """One cell of ``bench_rag_grid.py``: vanilla against the span server (``ours``: its
    variant)."""
    def extract(report: dict) -> tuple:
        base, ours_samples = _grid_sides(report, cell, metric, ours)
        burst = report["results"][ours]["cells"][cell]["burst"]
        return (base, ours_samples,
                f"ideal {_grid_ideal(report, cell):.2f}; bursts of {burst} requests", "vanilla")
    return extract


def _grid_worst(metric: str, higher_is_better: bool, ideal_min: float = 0.0,
                ours: str = "sglang-pic"):
    """The cell (of those whose ideal is at least ``ideal_min``) where the span server's ratio
    to vanilla on ``metric`` is lowest (``ours``: its variant)."""
    def extract(report: dict) -> tuple:
        cells = [c for c in report["results"][ours]["cells"]
                 if _grid_ideal(report, c) >= ideal_min]
        worst = min(cells, key=lambda c: _grid_ratio(report, c, metric, higher_is_better, ours))
        base, ours_samples = _grid_sides(report, worst, metric, ours)
        return (base, ours_samples, f"worst of {len(cells)} cells: {worst} (ideal "
                f"{_grid_ideal(report, worst):.2f})", "vanilla")
    return extract


def _grid_worst_pooled(metric: str, runs: dict[str, tuple[tuple[str, str], ...]],
                       ours: str = "sglang-pic"):
    """``_grid_worst`` where a cell measured in several runs (``runs``: cell -> (file, our
    variant) per run) counts with every run's samples pooled: a cell whose runs spread widely
    is quoted at their pooled median, not at its best or worst run."""
    def extract(report: dict) -> tuple:
        sides, notes = {}, []
        for cell in report["results"][ours]["cells"]:
            if cell not in runs:
                sides[cell] = _grid_sides(report, cell, metric, ours)
                continue
            base, mine, each = [], [], []
            for name, variant in runs[cell]:
                b, o = _grid_sides(json.loads((RESULTS / name).read_text()), cell, metric,
                                   variant)
                base, mine = base + b, mine + o
                each.append(statistics.median(b) / statistics.median(o))
            sides[cell] = (base, mine)
            notes.append(f"{cell} pooled over {len(each)} runs (each run "
                         + ", ".join(f"{r:.2f}x" for r in each) + ")")
        worst = min(sides, key=lambda c: statistics.median(sides[c][0])
                    / statistics.median(sides[c][1]))
        return (*sides[worst], f"worst of {len(sides)} cells: {worst}; " + "; ".join(notes),
                "vanilla")
    return extract


def _grid_fraction_of_bound(ours: str = "sglang-pic"):
    """Per cell, the throughput ratio over its bound min(ideal, the aligned cell's ratio); the
    worst cell's samples scaled so that the row's ratio is that fraction."""
    def extract(report: dict) -> tuple:
        aligned = _grid_ratio(report, "aligned", "requests_per_s", True, ours)
        bounds = {c: min(_grid_ideal(report, c), aligned) for c in report["results"][ours]["cells"]}
        fractions = {c: _grid_ratio(report, c, "requests_per_s", True, ours) / bound
                     for c, bound in bounds.items()}
        worst = min(fractions, key=fractions.get)
        base, ours_samples = _grid_sides(report, worst, "requests_per_s", ours)
        bound = bounds[worst]
        return ([b * bound for b in base], ours_samples,
                f"worst cell {worst}: ratio {fractions[worst] * bound:.2f}x against its bound "
                f"{bound:.2f}x (min of its ideal and the aligned cell's ratio); fractions "
                + ", ".join(f"{c} {f:.2f}" for c, f in fractions.items()), "vanilla")
    return extract


REAL_WEIGHTS_CONTROL = "real_weights_h200_control.json"  # the baseline side of the agreement row
COLD_NOTE = "lookup, miss, then the whole prefill; ratio >= 0.952 is at most 5 % over recompute"


def _agreement(report: dict) -> tuple[list[float], list[float], str | None]:
    """Real weights: per prompt, 1 if the span server's greedy tokens equal vanilla-FlashInfer's
    (ours), against the same for vanilla-triton (baseline: how often two of SGLang's own kernels
    agree at bf16), from the control run beside it."""
    control = json.loads((RESULTS / REAL_WEIGHTS_CONTROL).read_text())

    def per_prompt(c: dict) -> list[float]:
        bad = {d["prompt"] for d in c["diverged"]}
        return [0.0 if i in bad else 1.0 for i in range(c["prompts"])]

    ours = report["comparison"]["nonspan_vs_vanilla"]
    base = control["comparison"]["vanilla_triton_vs_vanilla"]
    gaps = [d["ref_top2_gap"] for d in ours["diverged"] if d["ref_top2_gap"] is not None]
    if not ours["diverged"]:
        ties = "no divergence"
    elif len(gaps) == len(ours["diverged"]):
        ties = (f"every divergence is at a bf16 near-tie (vanilla's top-2 logprob gap <= "
                f"{max(gaps):.3g})")
    else:
        ties = f"{len(ours['diverged'])} divergences, not all with a known gap"
    return (per_prompt(base), per_prompt(ours),
            f"means are the share of prompts with identical tokens; {ties}; baseline: "
            f"vanilla-triton against vanilla-FlashInfer, from a second call on the same machine "
            f"({REAL_WEIGHTS_CONTROL})")


def _span_reference_agreement(report: dict) -> tuple[list[float], list[float], str | None]:
    """Real weights, span prompts: per prompt, 1 if the span server's greedy tokens equal the
    float32 HF block-attention reference's over the whole run (no baseline: vanilla cannot serve
    span prompts), with where the first divergences fall and how close a call they were."""
    c = report["comparison"]["spans_vs_reference"]
    bad = {d["prompt"] for d in c["diverged"]}
    gaps = [d.get("ours_top2_gap") for d in c["diverged"]]
    steps = sorted(d["step"] for d in c["diverged"])
    if not gaps:
        where = "no divergence"
    elif None in gaps:
        where = f"first divergences at steps {steps}"
    else:
        where = (f"first divergences at steps {steps[0]}-{steps[-1]} of "
                 f"{report['params']['new_tokens']}; our top-2 logprob gap there <= "
                 f"{max(gaps):.3g} (0: an exact bf16 tie the float32 reference breaks the "
                 f"other way)")
    return [], [0.0 if i in bad else 1.0 for i in range(c["prompts"])], where


SPANS = "spans_rag_h200_prefill_graphs.json"  # both sides with SGLang's default prefill graphs
SPANS_EAGER = "spans_rag_h200.json"  # both sides with --disable-prefill-cuda-graph
SPANS_SHARED = "spans_rag_h200_with_shared_pages.json"  # the run before the one-launch copy
NONSPAN = "nonspan_overhead_h200.json"
NONSPAN_SPAN_GRAPHS = "nonspan_overhead_span_graphs_h100.json"  # --variants vanilla,...-graphs
NONSPAN_RERUN = "nonspan_overhead_rerun_h200.json"  # bench_nonspan_overhead.py --name ... subset
# --variants vanilla,sglang-pic-spans-graphs --decode-cases 256x1024 --rounds 2, a later H100
NONSPAN_SPAN_GRAPHS_RERUN = "nonspan_overhead_span_graphs_rerun_h100.json"
# the same pair at 1 x 4K and 32 x 4K and an 8K prefill, one round each, in both orders; then
# at 1 x 4K and 32 x 4K alone in two rounds of one call (alternating which goes first), with
# each call's fixed part kept (fixed_b*_ctx*_ms)
NONSPAN_SPAN_GRAPHS_4K = {"": ("nonspan_overhead_span_graphs_small_h100.json", "vanilla first"),
                          ".rerun": ("nonspan_overhead_span_graphs_small_r2_h100.json",
                                     "ours first"),
                          ".two_rounds": ("nonspan_overhead_span_graphs_4k_two_rounds_h100.json",
                                          "two rounds, vanilla first in the first; vanilla's "
                                          "first sample holds the first compile of the "
                                          "prefix-hit extend (8.3 s at 32 x 4K: the spread's "
                                          "outliers), which the benchmark runs untimed since")}
# decode cases where the KV fits the benchmark's 700K-token budget (b x (context + 40) tokens)
NONSPAN_CASES = {
    "ttft_1k": "prefill_1024_ms", "ttft_8k": "prefill_8192_ms", "ttft_32k": "prefill_32768_ms",
    "ttft_128k": "prefill_131000_ms",
    **{f"tpot_b{b}_{c // 1024}k": f"tpot_b{b}_ctx{c}_ms"
       for b in (1, 32, 256) for c in (1024, 8192, 32768) if b * (c + 40) <= 700_000},
}
SPARSE_QUALITY = "sparse_quality_h200.json"  # benchmark/quality/sparse_needle.py
SELECTOR_RECALL = "selector_recall_cpu.json"  # benchmark/sparse/bench_selector_recall.py
# sparse/bench_e2e_decode.py, one call per case (`--cases 1x131072`, `1x262144`, `4x131072`)
SPARSE_E2E = {"1x131072": "sparse_e2e_decode_flashinfer_h200_128k.json",
              "1x262144": "sparse_e2e_decode_flashinfer_h200_256k.json",
              "4x131072": "sparse_e2e_decode_flashinfer_h200_b4_128k.json"}
SPARSE_E2E_B4_FOURTH = "sparse_e2e_decode_flashinfer_h200_b4_128k_fourth_session.json"
B4_128K_PATH = ("4 requests of 128K decoding together, Llama-3-8B shape, dummy weights, decode "
                "CUDA graphs; pariskv_flashinfer (threshold 32K, top-k 100, 4096 candidates, 4 "
                "slots) vs vanilla dense FlashInfer decode; both sides at --mem-fraction 0.75 "
                "(64 GB of KV: it fits vanilla's pool)")
SPARSE_E2E_NOTE = ("TPOT samples per side (each from a 145- and a 17-token generation): 5 at "
                   "128K, 3 at 256K, each case its own call on one machine; vanilla ran "
                   "first; the sparse step with 6-bit vote planes, the sampled threshold read "
                   "by the votes, one-tile selected-row splits and idle slots skipped "
                   "(2026-12-03, seventh session)")
# the sixth session's step (8-bit planes, separate threshold launch, 256-row selected chunks):
# 128K alone, and 128K then 256K in one engine per side
SPARSE_E2E_PACKED_SUMS = {"1x131072": "sparse_e2e_decode_flashinfer_h200_128k_packed_sums.json",
                          "1x262144":
                              "sparse_e2e_decode_flashinfer_h200_128k_256k_packed_sums.json"}
# the seventh session's step with the opt-in gather-in-rerank on (slower in the server: off)
SPARSE_E2E_GATHER = "sparse_e2e_decode_flashinfer_h200_128k_256k_gather_in_rerank.json"
# the rows before the 2026-12-03 kernel changes (per-slot tables, `pariskv-all` graphs)
SPARSE_E2E_STEP_FIXES = {"1x131072": "sparse_e2e_decode_flashinfer_h200_128k_step_fixes.json",
                         "1x262144": "sparse_e2e_decode_flashinfer_h200_256k_step_fixes.json"}
SPARSE_LONG = "sparse_long_prompt_h200.json"
# 1 x 512K on the GPU pool: vanilla, the per-step server and the interval-4 server, one call
# each (bench_e2e_decode.py --cases 1x524288 --mem-fraction 0.75 --max-requests 1)
SPARSE_E2E_512K = "sparse_e2e_decode_flashinfer_h200_512k.json"
SPARSE_E2E_512K_SPLIT = "sparse_e2e_decode_flashinfer_h200_512k_split_sessions.json"  # earlier
SPARSE_512K_PATH = ("one request, Llama-3-8B shape, dummy weights, decode CUDA graphs, the whole "
                    "KV in the GPU pool on both sides (--mem-fraction 0.75); pariskv_flashinfer "
                    "(threshold 32K, top-k 100, 4096 candidates, 6-bit vote planes, "
                    "--sparse-max-requests 1)")
SPARSE_AGREEMENT = "sparse_agreement_cpu.json"  # benchmark/quality/sparse_agreement.py --cpu
# the same with --candidates 256 (the vote keeps a tenth of a passage's keys, as 4096 of 32K
# would; at 4096 it keeps every key of these 2400-token passages): per step, -v4, -r4
SPARSE_AGREEMENT_C256 = "sparse_agreement_cpu_c256.json"
SPARSE_AGREEMENT_PATH = ("SmolLM2-135M-Instruct, bf16, SGLang's CPU engine: 16 passages of this "
                         "repository's docs (2400 tokens each) and a request for a summary, 64 "
                         "greedy tokens; ParisKV (pariskv_torch_native) from 1024 tokens, the "
                         "needle suite's settings")
# 128K then 256K in one engine per side: vanilla and --sparse-reselect-interval 4 in one call,
# the per-step server (interval 1) in the next call of the same machine lease (2026-12-04)
SPARSE_E2E_RESELECT = "sparse_e2e_decode_flashinfer_h200_reselect.json"
SPARSE_RESELECT_PATH = ("one request, Llama-3-8B shape, dummy weights, decode CUDA graphs, 128K "
                        "then 256K in one engine per side; pariskv_flashinfer (threshold 32K, "
                        "top-k 100, 4096 candidates, 6-bit vote planes)")
# per-step selection and --sparse-vote-interval 4 against vanilla on an H100, 128K then 256K
SPARSE_E2E_VOTE_H100 = "sparse_e2e_decode_flashinfer_h100_vote.json"
SPARSE_E2E_VOTE_H100_PATH = (
    "one request, Llama-3-8B shape, dummy weights, decode CUDA graphs, 128K then 256K in one "
    "engine per side, H100 80GB (--mem-fraction 0.75: the H200 runs' 0.55 holds no dense "
    "256K pool on 80 GB); pariskv_flashinfer (threshold 32K, top-k 100, 4096 candidates, "
    "one sparse request)")
SPARSE_E2E_VOTE_H100_NOTE = (
    "6 TPOT samples per side (each from a 145- and a 17-token generation) in three consecutive "
    "calls of one machine: vanilla then the vote server; the per-step server; the vote server, "
    "the per-step server, then vanilla (2026-12-05)")
# the 1x131072 case again after the kernel changes of 2026-12-03 (radix top-k, reverted since)
SPARSE_E2E_RADIX_TOPK = "sparse_e2e_decode_flashinfer_h200_128k_radix_topk.json"


def _selection_recall(length: str):
    """Sparse needle run: recall@topk of the server's selection per layer (``recall.by_layer``),
    on its own side (dense has no selection to compare)."""

    def extract(report: dict) -> tuple[list[float], list[float], str | None]:
        by_layer = report.get("recall", {}).get("by_layer", {}).get(length, [])
        return [], list(by_layer), "samples are layers (mean over KV heads and prompts)"

    return extract
STORE_TCP = "store_ttft_tcp_h200.json"  # 8K / 32K / 128K, before the idle scheduler's nap
STORE_TCP_NAP = "store_ttft_tcp_h200_nap.json"  # 8K / 32K with it, and the same-node reader
STORE_COLD = "store_cold_miss_h200.json"  # cold misses beside vanilla and SGLang's HiCache alone
STORE_COLD_ROUNDS = "store_cold_miss_rounds_h200.json"  # the same in alternating rounds
# the same before the write-backs went over the data plane
STORE_COLD_ROUNDS_BEFORE = "store_cold_miss_rounds_h200_control_loop_writes.json"
STORE_TCP_COLD8K = "store_ttft_tcp_h200_cold8k.json"  # the 8K TCP row and cold misses, rerun
LOOKUPS = "store_lookup_beside_writes.json"  # store/bench_lookup_beside_writes.py (CPU)
LOOKUPS_SCHED = "store_lookup_beside_scheduler.json"  # store/bench_lookup_beside_scheduler.py
COLD_BOUND = 1 / 1.05  # a cold miss costs at most 5 % over recompute
E2E_MOONCAKE = "eviction_e2e_mooncake_h200.json"  # eviction/bench_e2e.py --trace mooncake
TWO_TIER = "eviction_replay_mooncake_two_tier.json"  # eviction/two_tier.py
TWO_TIER_GENERATED = "eviction_two_tier_generated.json"  # eviction/two_tier.py --workloads
TWO_TIER_BASELINES = ("lru", "lfu", "fifo", "slru", "gdsf", "s3fifo", "tlru")  # its runs' own
TWO_TIER_GENERATED_PATH = ("replay of generated traffic (scale 100, 10 seeds) through SGLang's "
                           "HiRadixCache (CPU): device tier 5 % and write-through host tier 20 % "
                           "of each trace's unique tokens")
E2E_MOONCAKE_PATH = ("open-loop replay on the H200 of one conversation in 40 of the Mooncake "
                     "conversation trace (241 requests, 1.84M prompt tokens), its hour compressed "
                     "60x, KV pool 10 % of the sample's unique tokens; FlashInfer, no CUDA graphs "
                     "on any side")
E2E_MOONCAKE_NOTE = ("3 runs per variant in three calls of one machine (2026-12-04, fourteenth "
                     "session; sae of 690ad09: application guessed from the match, reuse rates "
                     "per shared block a request branched off, size-aware eviction), runs 2 and "
                     "3 resumed from run 1's report, first variant alternating (lru, sae, lru); "
                     "each row's baseline is the better vanilla policy by that row's own metric")
E2E_MOONCAKE_BEFORE = "eviction_e2e_mooncake_h200_before_app_guess.json"  # the same, 2026-12-03/04
E2E_MOONCAKE_BEFORE_NOTE = ("3 runs per variant in three calls of one setting (run 1 on "
                            "2026-12-03, runs 2 and 3 resumed from its report on 2026-12-04), "
                            "first variant alternating (lru, sae, lru); vanilla lru's run 1 was "
                            "its first on a fresh machine and its TTFT holds first-use compiles "
                            "(6.0 s p50); sae before requests without hints got their "
                            "application from their match")
E2E_MOONCAKE_APP_GUESS = "eviction_e2e_mooncake_h200_app_guess.json"  # the same, 2026-12-04
E2E_MOONCAKE_APP_GUESS_NOTE = ("2 runs per variant (of the 3 a row needs) in two calls of one "
                               "machine, the second resumed from the first's report, first "
                               "variant alternating (lru, sae); sae of a81572d: requests without "
                               "hints get their application from their match, before the rates "
                               "per shared block they branched off (81c30df)")
LEGACY = "legacy row: measured against vanilla SGLang on triton; to re-measure on FlashInfer"
SPAN_SERVER = ("pic_flashinfer + pic_span with turned copies of moved spans (copy on reuse, the "
               "default when measured; now --span-copy-on-reuse on): FlashInfer for batches "
               "without moved keys (span requests reading their own copies included), our Triton "
               "kernels for batches still reading shared moved pages; not yet re-measured with "
               "the default of now, segmented attention (spans.rag_grid.copies_vs_shared)")
SPAN_SERVER_SEGMENTED = ("pic_flashinfer + pic_span: FlashInfer for batches without moved keys, "
                         "segmented attention on FlashInfer's batch kernels over the shared "
                         "pages for batches with span requests reading moved spans")
SPAN_SERVER_GRAPHS = (f"{SPAN_SERVER_SEGMENTED}, with --position-free-span-graphs: their decode "
                      "steps replayed from a second CUDA graph set (segmented attention padded "
                      "to 12 runs a request)")
GRID_STREAM_NOTE = ("64 requests after the last burst, over its documents and tenants with the "
                    "cache warm, as a Poisson stream at 70% of vanilla's burst throughput; "
                    "samples: the requests' TTFTs; H100")
SPAN_SERVER_PREFILL_GRAPHS = (f"{SPAN_SERVER_GRAPHS}; both sides with SGLang's default prefill "
                              "CUDA graphs (breakable: attention runs between the captured "
                              "pieces, so span extends replay them too)")
GRID_PREFILL_NOTE = ("bench_rag_grid.py --prefill-graphs, aligned in bursts of 128 and "
                     "varlen_k6_p256_z07_t4 in bursts of 48, back to back on one H100; "
                     "varlen_k10_p1024_z11_t4 in bursts of 48 in a later run on another H100 "
                     "(each cell's two sides in one run)")
GRID_SCHEDULE_NOTE = ("bench_rag_grid.py --prefill-graphs, cell varlen_k6_p256_z07_t4 in bursts "
                      "of 48, vanilla and both schedules in one run on one H100")
GRID_WORST_NOTE = ("over the cells of one run (aligned in bursts of 128, varlen_k6_p256_z07_t4 "
                   "in bursts of 48); varlen_k10_p1024_z11_t4 was not re-run with it; H100")
SPAN_SERVER_SHARED = ("pic_flashinfer + pic_span, --span-copy-on-reuse off: span requests read "
                      "the shared moved pages with our Triton kernels (eager), FlashInfer for the "
                      "rest")

WRITES_PATH = ("CPU (2 cores): one store server on loopback, a client storing 256 MB write-backs "
               "in a loop beside another asking for 128 pages every 20 ms")
SCHED_PATH = ("CPU (2 cores): three store servers on loopback; in one process a thread running "
              "SGLang's idle pass (1 ms of Python, storage I/O in flight) through "
              "idle_yield.around_on_idle beside 128-page lookups every 5 ms")


def _design_claim(claim: str, raw: str, metric: str, baseline: str, ours: str,
                  higher_is_better: bool, path: str, why: str) -> Claim:
    """A design comparison between two of our variants (no vanilla side) on ``metric``."""
    return Claim(claim, raw, metric, baseline_variant=baseline, ours_variant=ours,
                 higher_is_better=higher_is_better, path=path,
                 extract=_metric_pair(metric, metric, f"design comparison, no vanilla side: {why}",
                                      baseline=baseline, ours=ours, vanilla_side=False))


CLAIMS: list[Claim] = [
    Claim("spans.rag_throughput", SPANS, "rag_requests_per_s", higher_is_better=True,
          target=2.5, path=SPAN_SERVER,
          note="128 requests x 4 of 32 Zipf documents (2K each) at once, 3 batches over fresh "
          "pools; vanilla lists each request's documents in sorted order"),
    Claim("spans.rag_ttft_p50", SPANS, "rag_ttft_p50_ms", path=SPAN_SERVER),
    Claim("spans.cached_span_ttft", SPANS, "ttft_cached_prefix_ms", target=10.0,
          path=SPAN_SERVER,
          note="8K document cached after system prompt A, served after another system prompt: "
          "its pages are copied with turned keys (copy on reuse), then FlashInfer; both "
          "sides with SGLang's default prefill CUDA graphs"),
    Claim("spans.eager_prefill.cached_span_ttft", SPANS_EAGER, "ttft_cached_prefix_ms",
          path=SPAN_SERVER,
          note="the same with both sides' prefill CUDA graphs off (SGLang's "
          "--disable-prefill-cuda-graph): ~640 launches per extend, eager, on both sides"),
    Claim("spans.eager_prefill.rag_throughput", SPANS_EAGER, "rag_requests_per_s",
          higher_is_better=True, path=SPAN_SERVER,
          note="the same with both sides' prefill CUDA graphs off"),
    Claim("spans.cached_span_ttft_vs_floor", SPANS, "ttft_cached_prefix_ms",
          path=SPAN_SERVER, extract=_metric_pair(
              "ttft_same_prefix_ms", "ttft_cached_prefix_ms",
              "baseline: vanilla's one-pass floor, its own prompt again with a new question "
              "(system prompt and document cached as its prefix: only the question computed); "
              "ours: the document after another system prompt (system prompt and question "
              "computed)")),
    Claim("spans.new_prefix_ttft", SPANS, "ttft_new_prefix_ms", path=SPAN_SERVER,
          note="8K document cached, after a system prompt never seen (prefilled as a span)"),
    Claim("spans.cold_ttft", SPANS, "ttft_cold_ms", target=0.98, path=SPAN_SERVER,
          note="nothing cached: the span server's cost on a cold span prompt"),
    Claim("spans.shared_pages.rag_throughput", SPANS_SHARED, "rag_requests_per_s",
          ours_variant="sglang-pic-shared", higher_is_better=True, path=SPAN_SERVER_SHARED,
          note="design comparison: the same server with --span-copy-on-reuse off"),
    Claim("spans.shared_pages.cached_span_ttft", SPANS_SHARED, "ttft_cached_prefix_ms",
          ours_variant="sglang-pic-shared", path=SPAN_SERVER_SHARED,
          note="design comparison: the same server with --span-copy-on-reuse off"),
    *[Claim(f"spans.rag_grid.{cell}", GRID, "requests_per_s", higher_is_better=True,
            path=SPAN_SERVER_SEGMENTED, extract=_grid_cell(cell),
            note=f"bench_rag_grid.py cell {cell}: 3 bursts, 64 output tokens; H100")
      for cell in GRID_CELLS],
    *[Claim(f"spans.rag_grid.{cell}.stream_ttft_p50", GRID, "stream_ttft_ms",
            path=SPAN_SERVER_SEGMENTED, extract=_grid_cell(cell, "stream_ttft_ms"),
            note=GRID_STREAM_NOTE)
      for cell in GRID_CELLS],
    *[Claim(f"spans.rag_grid.{cell}.span_graphs", GRID, "requests_per_s", higher_is_better=True,
            ours_variant=GRID_GRAPHS, path=SPAN_SERVER_GRAPHS,
            extract=_grid_cell(cell, ours=GRID_GRAPHS),
            note=f"bench_rag_grid.py cell {cell}, the same run as spans.rag_grid.{cell}; H100")
      for cell in GRID_CELLS],
    *[Claim(f"spans.rag_grid.{cell}.span_graphs.stream_ttft_p50", GRID, "stream_ttft_ms",
            ours_variant=GRID_GRAPHS, path=SPAN_SERVER_GRAPHS,
            extract=_grid_cell(cell, "stream_ttft_ms", GRID_GRAPHS), note=GRID_STREAM_NOTE)
      for cell in GRID_CELLS],
    *[Claim(f"spans.rag_grid.prefill_graphs.{cell}", GRID_PREFILL_GRAPHS, "requests_per_s",
            higher_is_better=True, ours_variant=GRID_GRAPHS, path=SPAN_SERVER_PREFILL_GRAPHS,
            extract=_grid_cell(cell, ours=GRID_GRAPHS), note=f"{GRID_PREFILL_NOTE}: cell {cell}")
      for cell in GRID_PREFILL_CELLS],
    *[Claim(f"spans.rag_grid.prefill_graphs.{cell}.stream_ttft_p50", GRID_PREFILL_GRAPHS,
            "stream_ttft_ms", ours_variant=GRID_GRAPHS, path=SPAN_SERVER_PREFILL_GRAPHS,
            extract=_grid_cell(cell, "stream_ttft_ms", GRID_GRAPHS),
            note=f"{GRID_PREFILL_NOTE}: cell {cell}; {GRID_STREAM_NOTE}")
      for cell in GRID_PREFILL_CELLS],
    *[Claim(f"spans.rag_grid.schedule.{name}{suffix}", GRID_SCHEDULE, metric,
            higher_is_better=metric == "requests_per_s", ours_variant=variant,
            path=f"{SPAN_SERVER_PREFILL_GRAPHS}; --span-schedule {flag}",
            extract=_grid_cell("varlen_k6_p256_z07_t4", metric, variant),
            note=GRID_SCHEDULE_NOTE + ("" if metric == "requests_per_s"
                                       else f"; {GRID_STREAM_NOTE}"))
      for name, flag, variant in (("isps", "isps (the default)", GRID_GRAPHS),
                                  ("ready_first", "ready-first", GRID_READY_FIRST))
      for metric, suffix in (("requests_per_s", ""), ("stream_ttft_ms", ".stream_ttft_p50"))],
    Claim("spans.rag_grid.prefill_graphs.worst_stream_ttft_p50", GRID_PREFILL_GRAPHS,
          "stream_ttft_ms", target=4.0, ours_variant=GRID_GRAPHS,
          path=SPAN_SERVER_PREFILL_GRAPHS, extract=_grid_worst_pooled(
              "stream_ttft_ms", {GRID_K6: GRID_K6_RUNS}, ours=GRID_GRAPHS),
          note=f"the worst cell of all; {GRID_PREFILL_NOTE}; each run's two sides in one run"),
    *[Claim(f"spans.rag_grid.prefill_graphs.{GRID_K6_P32_CELL}{suffix}", GRID_K6_P32, metric,
            higher_is_better=metric == "requests_per_s", ours_variant=GRID_GRAPHS,
            path=SPAN_SERVER_PREFILL_GRAPHS,
            extract=_grid_cell(GRID_K6_P32_CELL, metric, GRID_GRAPHS),
            note=f"bench_rag_grid.py --prefill-graphs, cell {GRID_K6_P32_CELL} alone in bursts "
            "of 48, 64 output tokens; H100" + ("" if metric == "requests_per_s"
                                                 else f"; {GRID_STREAM_NOTE}"))
      for metric, suffix in (("requests_per_s", ""), ("ttft_p50_ms", ".ttft_p50"),
                             ("stream_ttft_ms", ".stream_ttft_p50"))],
    Claim(f"spans.rag_grid.prefill_graphs.{GRID_K6}.rerun.stream_ttft_p50", GRID_K6_RUNS[2][0],
          "stream_ttft_ms", ours_variant=GRID_GRAPHS, path=SPAN_SERVER_PREFILL_GRAPHS,
          extract=_grid_cell(GRID_K6, "stream_ttft_ms", GRID_GRAPHS),
          note=f"bench_rag_grid.py --prefill-graphs, cell {GRID_K6} alone, a later run on "
          f"another H100; {GRID_STREAM_NOTE}"),
    Claim("spans.rag_grid.varlen_k10_p1024_z11_t4", GRID_K10, "requests_per_s",
          higher_is_better=True, path=SPAN_SERVER_SEGMENTED,
          extract=_grid_cell("varlen_k10_p1024_z11_t4"), note=GRID_K10_NOTE),
    Claim("spans.rag_grid.varlen_k10_p1024_z11_t4.stream_ttft_p50", GRID_K10, "stream_ttft_ms",
          path=SPAN_SERVER_SEGMENTED, extract=_grid_cell("varlen_k10_p1024_z11_t4",
                                                         "stream_ttft_ms"),
          note=GRID_K10_NOTE),
    Claim("spans.rag_grid.peak_kv_tokens", GRID, "peak_used_tokens",
          path=SPAN_SERVER_SEGMENTED, extract=_grid_cell("varlen_k6_p256_z07_t4",
                                                         "peak_used_tokens"),
          note="most KV pool tokens in use during a burst, variable-length corner (6 of 256 "
          "documents, 4 tenants); H100"),
    Claim("spans.rag_grid.worst_throughput", GRID, "requests_per_s", higher_is_better=True,
          target=2.5, path=SPAN_SERVER_SEGMENTED,
          extract=_grid_worst("requests_per_s", True, GRID_IDEAL_MIN),
          note=f"the worst cell of those whose ideal is >= 3; {GRID_WORST_NOTE}"),
    Claim("spans.rag_grid.worst_stream_ttft_p50", GRID, "stream_ttft_ms", target=4.0,
          path=SPAN_SERVER_SEGMENTED, extract=_grid_worst("stream_ttft_ms", False),
          note=f"the worst cell of all; {GRID_WORST_NOTE}"),
    Claim("spans.rag_grid.worst_fraction_of_bound", GRID, "requests_per_s",
          higher_is_better=True, target=0.8, path=SPAN_SERVER_SEGMENTED,
          extract=_grid_fraction_of_bound(),
          note=f"ratio over min(ideal, aligned ratio), the worst cell; {GRID_WORST_NOTE}"),
    Claim("spans.rag_grid.span_graphs.worst_stream_ttft_p50", GRID, "stream_ttft_ms",
          target=4.0, ours_variant=GRID_GRAPHS, path=SPAN_SERVER_GRAPHS,
          extract=_grid_worst("stream_ttft_ms", False, ours=GRID_GRAPHS),
          note=f"the worst cell of all; {GRID_WORST_NOTE}"),
    Claim("spans.rag_grid.span_graphs.worst_fraction_of_bound", GRID, "requests_per_s",
          higher_is_better=True, target=0.8, ours_variant=GRID_GRAPHS, path=SPAN_SERVER_GRAPHS,
          extract=_grid_fraction_of_bound(GRID_GRAPHS),
          note=f"ratio over min(ideal, aligned ratio), the worst cell; {GRID_WORST_NOTE}"),
    Claim("spans.rag_grid.max_concurrent_requests", GRID, "peak_decoding",
          higher_is_better=True, path=SPAN_SERVER_SEGMENTED,
          extract=_grid_cell("aligned", "peak_decoding"),
          note="most client requests between their first token and their last at once in a "
          "burst of 128 (aligned cell), the same KV pool on both sides; a burst can show at "
          "most 128; H100"),
    *[Claim(f"spans.segmented_decode.{prefix}{metric}", SEGMENTED_DECODE, metric,
            ours_variant=variant, path=SEGMENTED_DECODE_PATH, note=f"{what}: {note}")
      for prefix, variant, what in (
          ("", "grouped", "the eager step"),
          ("graph_", "graph", "the step as a CUDA graph replays it (--position-free-span-graphs: "
           "padded to 12 runs a request; the time includes copying the query in)"))
      for metric, note in (
          ("attend_ms", "one layer's attention of a decode step"),
          ("plan_ms", "a decode step's planning on the host (once per step, all layers)"))],
    *[Claim(f"spans.segmented_decode.varlen_k6.{name}", SEGMENTED_DECODE_K6, "attend_ms",
            ours_variant=variant, path=SEGMENTED_DECODE_K6_PATH,
            note=f"one layer's attention of a decode step, {what}")
      for name, variant, what in (
          ("attend_ms", "grouped", "runs of the same slots read once (the default)"),
          ("per_run_attend_ms", "per-run", "each run read on its own "
           "(--span-group-shared-runs off)"))],
    Claim("fleet.rag_throughput_2x1gpu", FLEET, "requests_per_s", higher_is_better=True,
          target=2.5, extract=_grid_worst("requests_per_s", True),
          path="two instances sharing one GPU behind SGLang's router, a side each; vanilla: "
          "cache-aware routing, FlashInfer; ours: spans and two PTStore servers",
          note="bench_fleet_rag.py on one H100, equal KV pools per instance; cell "
          "varlen_k6_p256_z07_t4 (the aligned cell not run on a GPU yet)"),
    Claim("fleet.rag_throughput_2x1gpu.aligned", FLEET_ALIGNED, "requests_per_s",
          higher_is_better=True, extract=_grid_worst("requests_per_s", True),
          path="two instances sharing one GPU behind SGLang's router, a side each; vanilla: "
          "cache-aware routing, FlashInfer; ours: spans and two PTStore servers",
          note="bench_fleet_rag.py --cells aligned on one H100, equal KV pools per instance; "
          "vanilla's side in the call before ours on the same machine (--resume-from)"),
    Claim("fleet.cross_instance_hit_rate", FLEET, "storage_share", baseline_variant=None,
          higher_is_better=True, extract=_fleet_store_share,
          note="prompt tokens the fleet loaded from PTStore per burst (computed through the "
          "other instance, or evicted here)"),
    Claim("fleet.store_gain", FLEET, "requests_per_s", baseline_variant="sglang-pic-nostore",
          higher_is_better=True, same_run=False, extract=_fleet_store_gain,
          path="two sglang-pic instances on one GPU behind the router, with two PTStore "
          "servers against none"),
    Claim("fleet.routing_sim.span_group_local_share", ROUTING_SIM, "local_share",
          baseline_variant="cache_aware", ours_variant="span_partition", higher_is_better=True,
          target=0.0, target_kind="points", extract=_routing_sim("span_partition", "local_share"),
          path="model (sim_fleet_routing.py), not a server",
          note="share of document and system-prompt tokens found in the instance's own cache; "
          "the case where span group keys gain least over the router's default; the model "
          "gives each group its own instance (the router does under concurrent load only)"),
    Claim("fleet.routing_sim.span_group_busiest", ROUTING_SIM, "busiest_over_mean",
          baseline_variant="round_robin", ours_variant="span_partition",
          extract=_routing_sim("span_partition", "busiest_over_mean", "max", "round_robin"),
          path="model (sim_fleet_routing.py), not a server",
          note="the busiest instance's requests over the mean: how unevenly span group keys "
          "spread the load, their worst case"),
    *[Claim(f"spans.store_tier.{metric}", SPAN_STORE_TIER, metric, baseline_variant="token pages",
            ours_variant="4 MiB blocks", path=SPAN_STORE_TIER_PATH,
            extract=_span_store_tier_worst(metric))
      for metric in ("load_ms", "stored_ms")],
    # the writer's GIL share (stolen_ms) is below the measuring loop's noise (negative medians
    # in some cells, on the CPU and on the GPU): no row
    *[Claim(f"spans.store_tier_h100.{metric}", SPAN_STORE_TIER_GPU, metric,
            baseline_variant="token pages", ours_variant="4 MiB blocks",
            path=SPAN_STORE_TIER_PATH + ", KV pool on the GPU",
            extract=_span_store_tier_worst(metric))
      for metric in ("save_ms", "load_ms", "stored_ms")],
    *[Claim(f"spans.nonspan.{case}", NONSPAN, metric, ours_variant="sglang-pic-spans",
            target=0.98, path=SPAN_SERVER, reruns=(NONSPAN_RERUN,),
            note="requests without spans on a --enable-span-cache server")
      for case, metric in NONSPAN_CASES.items()],
    *[Claim(f"spans.nonspan.span_graphs.{case}", NONSPAN_SPAN_GRAPHS, metric,
            ours_variant="sglang-pic-spans-graphs", target=0.98,
            path=f"{SPAN_SERVER}; --position-free-span-graphs",
            reruns=(NONSPAN_SPAN_GRAPHS_RERUN,) if case == "tpot_b256_1k" else (),
            note="requests without spans on a --enable-span-cache --position-free-span-graphs "
            "server; H100")
      for case, metric in NONSPAN_CASES.items()],
    *[Claim(f"spans.nonspan.span_graphs.{case}{suffix}", raw, metric,
            ours_variant="sglang-pic-spans-graphs", target=0.98,
            path=f"{SPAN_SERVER}; --position-free-span-graphs",
            note="requests without spans on a --enable-span-cache --position-free-span-graphs "
            f"server, 3 calls a side a round, {order}; decode_tpot_* is the decode steps "
            "alone, fixed_* a call's fixed part (admission, the prefix hit's one-token "
            "extend); H100")
      for suffix, (raw, order) in NONSPAN_SPAN_GRAPHS_4K.items()
      for case, metric in (("tpot_b1_4k", "tpot_b1_ctx4096_ms"),
                           ("tpot_b32_4k", "tpot_b32_ctx4096_ms"),
                           ("decode_tpot_b1_4k", "decode_tpot_b1_ctx4096_ms"),
                           ("decode_tpot_b32_4k", "decode_tpot_b32_ctx4096_ms"),
                           *((("fixed_b1_4k", "fixed_b1_ctx4096_ms"),
                              ("fixed_b32_4k", "fixed_b32_ctx4096_ms"))
                             if suffix == ".two_rounds" else ()))],
    Claim("quality.real_weights.nonspan_identical", "real_weights_h200.json", "identical_tokens",
          baseline_variant="vanilla-triton vs vanilla", ours_variant="sglang-pic-spans vs vanilla",
          higher_is_better=True, path="SmolLM2-135M-Instruct, bf16, 24 prompts x 64 greedy tokens",
          same_run=False, center=statistics.mean, extract=_agreement,
          note="the span-cache server on pic_flashinfer (its default backend on the GPU)"),
    Claim("quality.real_weights.spans_vs_reference", "real_weights_h200.json",
          "identical_tokens", baseline_variant=None,
          ours_variant="sglang-pic-spans vs HF block attention (float32)",
          higher_is_better=True, path="SmolLM2-135M-Instruct, bf16, 12 span prompts x 64 greedy "
          "tokens, each document at another offset after another system prompt",
          center=statistics.mean, extract=_span_reference_agreement),
    *[Claim(f"store.tcp_ttft_{n // 1024}k", STORE_TCP, f"ttft_{n}_ms",
            ours_variant="sglang-pic-ptstore-tcp", target=target,
            path="TCP: store servers in their own processes reached over TCP only (the data "
            "plane, no shared memory); prefix computed by another instance",
            note="vanilla-FlashInfer recomputes the prefix",
            reruns=(STORE_TCP_COLD8K, STORE_TCP_NAP) if n == 8192 else (STORE_TCP_NAP,))
      for n, target in ((8192, 1.5), (32768, 3.0), (131072, 5.0))],
    Claim("store.shm_ttft_8k", STORE_TCP, "ttft_8192_ms", ours_variant="sglang-pic-ptstore",
          path="same-node shared memory: store servers write into SGLang's host pool",
          note="vanilla-FlashInfer recomputes the prefix", reruns=(STORE_TCP_NAP,)),
    Claim("store.tcp_cold_miss_8k", STORE_COLD_ROUNDS, "ttft_8192_ms",
          ours_variant="sglang-pic-ptstore-tcp", target=COLD_BOUND,
          extract=_metric_pair("ttft_8192_ms", "ttft_cold_8192_ms", COLD_NOTE,
                               ours="sglang-pic-ptstore-tcp"),
          path="TCP reader, a prefix the store never saw; alternating rounds of 5 samples "
          "beside vanilla with HiCache alone: 3 rounds of vanilla and HiCache, 2 of ours (its "
          "third round cut off by the call limit)"),
    Claim("store.hicache_cold_miss_8k", STORE_COLD_ROUNDS, "ttft_8192_ms",
          ours_variant="vanilla-hicache", target=COLD_BOUND,
          extract=_metric_pair("ttft_8192_ms", "ttft_cold_8192_ms", COLD_NOTE,
                               ours="vanilla-hicache"),
          path="vanilla SGLang with HiCache's host tier alone (no storage tier), a new prompt: "
          "what SGLang's own HiCache costs a miss; same run as store.tcp_cold_miss_8k"),
    Claim("store.tcp_cold_miss_8k.vs_hicache", STORE_COLD_ROUNDS, "ttft_cold_8192_ms",
          baseline_variant="vanilla-hicache", ours_variant="sglang-pic-ptstore-tcp",
          target=COLD_BOUND,
          extract=_metric_pair("ttft_cold_8192_ms", "ttft_cold_8192_ms",
                               "what the storage tier adds to HiCache's own miss: the lookup "
                               "before the prefill", baseline="vanilla-hicache",
                               ours="sglang-pic-ptstore-tcp"),
          path="TCP reader's miss against vanilla HiCache's miss (both new prompts), same run"),
    *[Claim(f"store.tcp_cold_miss_8k.{tag}", raw, "ttft_8192_ms",
            ours_variant="sglang-pic-ptstore-tcp", target=COLD_BOUND,
            extract=_metric_pair("ttft_8192_ms", "ttft_cold_8192_ms", COLD_NOTE,
                                 ours="sglang-pic-ptstore-tcp"),
            path=f"TCP reader, a prefix the store never saw; {where}")
      for tag, raw, where in (
          ("one_round", STORE_COLD, "one round beside vanilla with HiCache alone"),
          ("control_loop_writes", STORE_COLD_ROUNDS_BEFORE, "2 alternating rounds before "
           "write-backs moved to the data plane (the store servers' control loops wrote the "
           "pages; vanilla's second round cut off: 5 samples)"),
          ("with_8k_row", STORE_TCP_COLD8K, "the run of the 8K TCP row's rerun"),
          ("with_tcp_rows", STORE_TCP_NAP, "the run of the 8K / 32K TCP rows"),
          ("before_nap", STORE_TCP, "the run of the 128K TCP row"))],
    *[_design_claim(f"store.{claim}", LOOKUPS, metric, base, ours, better, WRITES_PATH, why)
      for claim, metric, better, base, ours, why in (
          ("lookup_p99_beside_writes", "lookup_p99_ms", False, "one put per owner", "8 MiB puts",
           "a whole write-back in one put per owner against pipelined puts of at most 8 MiB"),
          ("put_rate_chunked", "put_gbps", True, "one put per owner", "8 MiB puts",
           "a whole write-back in one put per owner against pipelined puts of at most 8 MiB"),
          ("put_rate_data_plane", "put_gbps", True, "8 MiB puts", "data-plane puts",
           "pipelined CURVE puts of at most 8 MiB against puts whose pages go over the TCP "
           "data plane (4 streams)"),
          ("lookup_p99_beside_data_plane_puts", "lookup_p99_ms", False, "8 MiB puts",
           "data-plane puts", "pipelined CURVE puts of at most 8 MiB against puts whose pages "
           "go over the TCP data plane (4 streams)"))],
    *[_design_claim(f"store.{claim}", LOOKUPS_SCHED, "lookup_p50_ms", base, ours, False,
                    SCHED_PATH, why + "; each sample a round's median")
      for claim, base, ours, why in (
          ("lookup_p50_beside_idle_scheduler", "nap", "lookup watch",
           "the idle pass napping 100 us against also waiting for the lookup in flight"),
          ("lookup_p50_first_page_alone", "lookup watch", "first page alone",
           "a cold prompt's lookup (all misses) asking every page of its owners against asking "
           "its first page alone first (client.leading_found)"))],
    Claim("store.shm_ttft_8k_triton", "store_ttft_h200_prefault.json", "ttft_8192_ms",
          ours_variant="sglang-pic-ptstore", path="same node: store servers write into SGLang's "
          "host pool through shared memory", note=LEGACY),
    Claim("store.socket_ttft_8k", "store_ttft_h200_shm.json", "ttft_8192_ms",
          ours_variant="sglang-pic-ptstore-socket", target=1.5,
          path="socket (zmq over loopback TCP)", note=LEGACY),
    *[Claim(f"eviction.e2e_{metric}{suffix}", report, key, center=statistics.mean,
            higher_is_better=higher, superseded=bool(suffix),
            extract=_better_vanilla(key, higher_is_better=higher), path=E2E_MOONCAKE_PATH,
            note=note)
      for suffix, report, note in (("", E2E_MOONCAKE, E2E_MOONCAKE_NOTE),
                                   (".before_app_guess", E2E_MOONCAKE_BEFORE,
                                    E2E_MOONCAKE_BEFORE_NOTE))
      for metric, key, higher in (("hit_rate", "token_hit_rate", True),
                                  ("ttft_p50", "ttft_p50_ms", False),
                                  ("ttft_p99", "ttft_p99_ms", False))],
    Claim("eviction.e2e_ttft_mean", E2E_MOONCAKE, "ttft_mean_ms", center=statistics.mean,
          extract=_better_vanilla("ttft_mean_ms"), path=E2E_MOONCAKE_PATH,
          note=E2E_MOONCAKE_NOTE + "; each run's mean over its 241 requests' TTFTs"),
    *[Claim(f"eviction.e2e_{metric}.app_guess", E2E_MOONCAKE_APP_GUESS, key, center=statistics.mean,
            higher_is_better=higher, superseded=True,
            extract=_better_vanilla(key, higher_is_better=higher), path=E2E_MOONCAKE_PATH,
            note=E2E_MOONCAKE_APP_GUESS_NOTE)
      for metric, key, higher in (("hit_rate", "token_hit_rate", True),
                                  ("ttft_p50", "ttft_p50_ms", False),
                                  ("ttft_p99", "ttft_p99_ms", False))],
    Claim("eviction.e2e_hit_rate.seed0", "eviction_e2e_h200_vs_lru_fifo.json", "token_hit_rate",
          baseline_variant="vanilla-fifo", higher_is_better=True,
          note=LEGACY + "; one open-loop run per variant (vanilla lru 0.720, the better "
          "vanilla policy is fifo)"),
    Claim("eviction.e2e_hit_rate.seed1", "eviction_e2e_h200_seed1_vs_lru_fifo.json",
          "token_hit_rate", higher_is_better=True,
          note=LEGACY + "; one open-loop run per variant (the better vanilla policy is lru)"),
    Claim("eviction.e2e_ttft_p50.seed0", "eviction_e2e_h200_vs_lru_fifo.json", "ttft_p50_ms",
          baseline_variant="vanilla-fifo", note=LEGACY),
    Claim("eviction.e2e_ttft_p50.seed1", "eviction_e2e_h200_seed1_vs_lru_fifo.json",
          "ttft_p50_ms", note=LEGACY),
    *[Claim(f"eviction.replay.generated_mixed_{int(f * 100)}pct", "eviction_sim.json",
            "token_hit_rate", baseline_variant="best baseline", ours_variant="sae",
            higher_is_better=True, path="replay through SGLang's RadixCache (CPU)",
            extract=_replay("mix", f)) for f in (0.05, 0.1, 0.2, 0.4)],
    *[Claim(f"eviction.replay.mooncake_conv.whole_{pct}pct", "eviction_replay_mooncake.json",
            "token_hit_rate", baseline_variant="best baseline", ours_variant="sae",
            higher_is_better=True, path="replay of the Mooncake conversation trace (12,031 "
            "requests) through SGLang's RadixCache (CPU)", extract=_trace_replay(f"{pct}pct"))
      for pct in (5, 10, 20, 40)],
    *[Claim(f"eviction.replay.mooncake_conv.heldout_{pct}pct", "eviction_replay_mooncake.json",
            "heldout_hit_rate", baseline_variant="best baseline", ours_variant="sae",
            higher_is_better=True, path="same replay, hits of the last 40 % of the trace by time "
            "(nothing tuned on it)", extract=_trace_replay(f"{pct}pct", "heldout_hit_rate"))
      for pct in (5, 10, 20)],
    *[Claim(f"eviction.replay.mooncake_conv.hicache_{part}", TWO_TIER, metric,
            baseline_variant="best baseline", ours_variant="sae", higher_is_better=True,
            path="replay of the Mooncake conversation trace through SGLang's HiRadixCache "
            "(CPU): a 0.5M-token device tier (an H200's pool for an 8B model) and a 4M-token "
            "write-through host tier; hits on either tier" + where,
            extract=_trace_replay("500000+4000000", metric))
      for part, metric, where in (("whole", "token_hit_rate", ""),
                                  ("heldout", "heldout_hit_rate",
                                   ", requests of the last 40 % by time"))],
    *[Claim(f"eviction.replay.{trace}.{policy}_worst_vs_best{part}", raw, metric,
            baseline_variant="best baseline", ours_variant=policy, higher_is_better=True,
            target=0.005, target_kind="points",
            path=f"replay of the {what} through SGLang's RadixCache (CPU) at 5 / 10 / 20 / 40 % "
            "of its unique tokens, the worst of the four cells" + (
                ", hits of the last 40 % by time" if part else ""),
            extract=_worst_cell(policy, metric))
      for trace, raw, what in (
          ("mooncake_conv", "eviction_auto_mooncake_conv.json",
           "Mooncake conversation trace (12,031 requests)"),
          ("mooncake_synthetic", "eviction_auto_mooncake_synthetic.json",
           "Mooncake synthetic trace (3,993 requests; held out: auto's settings, a half-life "
           "of 1,000 requests and a 0.5 % switching margin, were set before either trace was "
           "replayed)"))
      for policy in ("auto", "sae")
      for part, metric in (("", "token_hit_rate"), (".heldout", "heldout_hit_rate"))],
    *[Claim(f"eviction.replay.generated_{split}_seeds{suffix}.{policy}_worst_vs_best",
            f"{stem}{'' if hints == 'all' else '_hints_none'}.json", "token_hit_rate",
            baseline_variant="best baseline", ours_variant=policy, higher_is_better=True,
            target=0.005, target_kind="points",
            path=f"generated traffic of seeds {seeds}, every workload of bench_eviction.py, "
            + ("no client hints (--hints none)" if hints == "none" else
               "with the session, application and token-type hints clients can send")
            + ", replayed through SGLang's RadixCache (CPU) at 5 / 10 / 20 / 40 % of the "
            "unique tokens: the worst workload and size, each cell the mean of the ten seeds",
            extract=_generated_worst_cell(policy))
      for split, stem, seeds in (
          ("tuning", "eviction_auto_tuning_seeds",
           "0-9 (the seeds auto's settings were chosen on)"),
          ("heldout", "eviction_sim_heldout_seeds",
           "100-109 (no setting was chosen on them; earlier designs were checked on them)"),
          ("unseen", "eviction_sim_unseen_seeds",
           "200-209 (first replayed after auto's paired test was fixed; some of their cells "
           "were then looked into)"),
          ("fresh", "eviction_sim_fresh_seeds",
           "300-309 (nothing was chosen on them)"))
      for suffix, hints in (("", "none"), (".hints", "all"))
      for policy in ("auto", "sae")],
    *[Claim(f"eviction.replay.generated_heldout_seeds.hints.mixed_{int(f * 100)}pct",
            "eviction_sim_heldout_seeds.json", "token_hit_rate",
            baseline_variant="best baseline", ours_variant="sae", higher_is_better=True,
            path="the mixed workload of generated traffic of seeds 100-109 with client hints, "
            "replayed through SGLang's RadixCache (CPU); sae against the best online baseline "
            "(the held-out check of eviction.replay.generated_mixed_*)",
            extract=_replay("mix", f, baselines=ONLINE_BASELINES))
      for f in (0.05, 0.1, 0.2, 0.4)],
    Claim("eviction.replay.mooncake_synthetic.auto_ms_per_request",
          "eviction_auto_mooncake_synthetic.json", "wall_s", baseline_variant="gdsf",
          ours_variant="auto", path="replay of the Mooncake synthetic trace (3,993 requests of "
          "20K-40K tokens) through SGLang's RadixCache on the 2-core CPU machine: the replay's "
          "wall time per request (cache work, hooks and policy), one value per cache size",
          extract=_replay_ms_per_request("gdsf", "auto")),
    *[Claim(f"eviction.two_tier.generated_{w}", TWO_TIER_GENERATED, "token_hit_rate",
            baseline_variant="best baseline", ours_variant="sae", higher_is_better=True,
            center=statistics.mean, path=TWO_TIER_GENERATED_PATH,
            extract=_replay(w, None, baselines=TWO_TIER_BASELINES))
      for w in ("mix", "chat", "agent", "sharegpt", "sharegpt_mix", "single_heavy", "shift")],
    *[Claim(f"eviction.two_tier.host_writes_{w}", TWO_TIER_GENERATED, "host_written_tokens",
            baseline_variant="sae-copy-all", ours_variant="sae", center=statistics.mean,
            path=TWO_TIER_GENERATED_PATH + "; tokens written to the host tier, sae deferring "
            "its evict_first blocks' copies against sae copying every block",
            extract=_replay(w, None, "host_written_tokens", "sae-copy-all"))
      for w in ("mix", "single_heavy")],
    *[Claim(f"sparse.tpot_{name}", SPARSE_E2E[case], f"tpot_ms_{case}",
            ours_variant="sglang-pic-flashinfer", target=target,
            path=f"{requests}, Llama-3-8B shape, dummy weights, decode CUDA graphs; "
            "pariskv_flashinfer (threshold 32K, top-k 100, 4096 candidates) vs vanilla dense "
            "FlashInfer decode" + extra, note=SPARSE_E2E_NOTE)
      for name, case, target, requests, extra in (
          ("128k", "1x131072", 1.3, "one request", ""),
          ("256k", "1x262144", 2.0, "one request", ""))],
    *[Claim(f"sparse.tpot_{name}.reselect4", SPARSE_E2E_RESELECT, f"tpot_ms_{case}",
            ours_variant="sglang-pic-flashinfer-r4", target=target, same_run=True,
            path=SPARSE_RESELECT_PATH + " with --sparse-reselect-interval 4 (a selection every "
            "4 decode steps, moved on by a row a step between) vs vanilla dense FlashInfer "
            "decode",
            note="3 TPOT samples per side (each from a 145- and a 17-token generation), vanilla "
            "then the sparse server in one device call (2026-12-04, tenth session)")
      for name, case, target in (("128k", "1x131072", 1.3), ("256k", "1x262144", 2.0))],
    *[Claim(f"sparse.tpot_{name}.reselect1", SPARSE_E2E_RESELECT, f"tpot_ms_{case}",
            ours_variant="sglang-pic-flashinfer", target=target, same_run=True,
            path=SPARSE_RESELECT_PATH + ", a selection at every step (the default) vs vanilla "
            "dense FlashInfer decode",
            note="3 TPOT samples per side; the sparse server in the device call after the one "
            "of vanilla and the interval-4 server, on the same machine (2026-12-04)")
      for name, case, target in (("128k", "1x131072", 1.3), ("256k", "1x262144", 2.0))],
    *[Claim(f"sparse.tpot_{name}.h100{suffix}", SPARSE_E2E_VOTE_H100, f"tpot_ms_{case}",
            ours_variant=variant, target=target, same_run=True,
            path=SPARSE_E2E_VOTE_H100_PATH + what + " vs vanilla dense FlashInfer decode",
            note=SPARSE_E2E_VOTE_H100_NOTE)
      for name, case, target in (("128k", "1x131072", 1.3), ("256k", "1x262144", 2.0))
      for suffix, variant, what in (
          ("", "sglang-pic-flashinfer", ", a selection at every step (the default)"),
          (".vote4", "sglang-pic-flashinfer-v4",
           " with --sparse-vote-interval 4 (a vote every 4 steps, its candidates reranked "
           "between)"))],
    Claim("sparse.tpot_b4_128k", SPARSE_E2E["4x131072"], "tpot_ms_4x131072",
          ours_variant="sglang-pic-flashinfer", target=1.5, same_run=True,
          path=B4_128K_PATH + ", the step of the seventh session",
          note="3 samples per side; vanilla, then the sparse server in the next device call of "
          "the same machine (2026-12-04, fifteenth session)"),
    Claim("sparse.tpot_b4_128k.fourth_session", SPARSE_E2E_B4_FOURTH, "tpot_ms_4x131072",
          ours_variant="sglang-pic-flashinfer", target=1.5, superseded=True,
          path=B4_128K_PATH,
          note="3 samples per side, same run, vanilla first; the fourth session's step (per-slot "
          "tables, `pariskv-all` graphs), before the kernel changes of the sixth"),
    *[Claim(f"sparse.tpot_{name}.packed_sums", SPARSE_E2E_PACKED_SUMS[file_case],
            f"tpot_ms_{case}", ours_variant="sglang-pic-flashinfer", target=target,
            superseded=True, path="the sixth session's sparse step (8-bit vote planes, the "
            "sampled threshold in its own launch, the selected rows in 256-row chunks)" + extra,
            note="3 samples per side, same run, vanilla first")
      for name, file_case, case, target, extra in (
          ("128k", "1x131072", "1x131072", 1.3, ""),
          ("128k.second_run", "1x262144", "1x131072", 1.3,
           "; one engine per side serving 128K, then 256K"),
          ("256k", "1x262144", "1x262144", 2.0, "; one engine per side serving 128K, then 256K"))],
    *[Claim(f"sparse.tpot_{name}.gather_in_rerank", SPARSE_E2E_GATHER, f"tpot_ms_{case}",
            ours_variant="sglang-pic-flashinfer", target=target, superseded=True,
            path="this session's step with GATHER_IN_RERANK on (the rerank's programs placing "
            "the kept keys): 24.8 us a layer in the server's graph against 13.9 for the merge "
            "and rerank it replaces, so it is off; one engine per side serving 128K, then 256K",
            note="3 samples per side, same run, vanilla first")
      for name, case, target in (("128k", "1x131072", 1.3), ("256k", "1x262144", 2.0))],
    *[Claim(f"sparse.tpot_{name}.step_fixes", SPARSE_E2E_STEP_FIXES[case], f"tpot_ms_{case}",
            ours_variant="sglang-pic-flashinfer", target=target, superseded=True,
            path="the sparse step before the 2026-12-03 kernel changes (per-slot tables "
            "written without a synchronising copy, `pariskv-all` graphs)",
            note="3 samples per side, same run, vanilla first")
      for name, case, target in (("128k", "1x131072", 1.3), ("256k", "1x262144", 2.0))],
    Claim("sparse.first_decode_extra_128k", SPARSE_E2E["1x131072"],
          "first_decode_extra_s_1x131072", ours_variant="sglang-pic-flashinfer",
          path="one 128K request, Llama-3-8B shape, dummy weights: the first decode (a 17-token "
          "generation right after the prefill) less a later 17-token generation, in seconds; "
          "ours includes the request's activation (its region encoded with the cuBLAS "
          "rotation) and first-use compiles, vanilla its own first-decode costs",
          note="one first decode per side, same run as sparse.tpot_128k (vanilla first); "
          "vanilla's was 0.012 s in this call and 0.16-0.19 s in the 256K and gather calls of "
          "the same day, so the ratio is noise on its side"),
    Claim("sparse.first_decode_extra_128k.radix_topk", SPARSE_E2E_RADIX_TOPK,
          "first_decode_extra_s_1x131072", ours_variant="sglang-pic-flashinfer",
          superseded=True, path="the same, in the run with the radix top-k (reverted since)",
          note="one first decode per side, same run (vanilla first)"),
    *[Claim(f"sparse.tpot_512k{suffix}{run}", raw, "tpot_ms_1x524288",
            ours_variant=variant, target=3.0, same_run=same_run,
            path=SPARSE_512K_PATH + what + " vs vanilla dense FlashInfer decode", note=note)
      for suffix, variant, what in (
          ("", "sglang-pic-flashinfer", ", a selection at every step (the default)"),
          (".reselect4", "sglang-pic-flashinfer-r4", " with --sparse-reselect-interval 4"))
      for run, raw, same_run, note in (
          ("", SPARSE_E2E_512K, True,
           "3 TPOT samples per side (each from a 145- and a 17-token generation); a 512K side "
           "takes a whole device call (engine start, ~210-330 s prefill), so the three sides "
           "ran in three consecutive calls of one machine: vanilla, interval 4, interval 1 "
           "(2026-12-04, fifteenth session)"),
          (".split_sessions", SPARSE_E2E_512K_SPLIT, False,
           "3 TPOT samples per side; vanilla in the session before, the two sparse servers in "
           "consecutive calls of one session (2026-12-04)"))],
    Claim("sparse.tpot_512k.offload", SPARSE_LONG, "tpot_ms_524288", target=3.0,
          same_run=False,
          path="one 512K-token prompt, Llama-3-8B shape, dummy weights; pariskv_flashinfer with "
          "--sparse-offload on a 64K-token pool (prefill and retrieval region in host memory) "
          "vs vanilla FlashInfer with the whole KV in a pool that holds it",
          note="one streamed generation per side (TPOT over 63 tokens), each variant in its own "
          "device call of the same machine lease (a 512K prefill takes minutes)"),
    Claim("sparse.prefill_512k", SPARSE_LONG, "prefill_s_524288", same_run=False,
          path="the same 512K-token prompt: time to the first token; ours prefills with at most "
          "threshold + 2 chunks + sink + local tokens in the GPU pool (16K + 2 x 16K + 528), the "
          "finished chunks attended from host memory",
          note="one sample per side, separate calls of the same machine lease"),
    Claim("sparse.tpot_128k.triton_baseline", "sparse_e2e_decode_sampled_h200.json",
          "tpot_ms_1x131072", note=LEGACY + " (second column: vanilla triton decode)"),
    Claim("sparse.overmemory_throughput", "sparse_offload_h200.json", "output_tokens_per_s",
          higher_is_better=True, target=4.0,
          note=LEGACY + "; 4 x 64K requests from a 72K-token pool, not 16 x 128K"),
    *[Claim(f"sparse.quality.{length}", SPARSE_QUALITY, f"score_{length}",
            ours_variant="sglang-pic-sparse", higher_is_better=True, target=1.0,
            target_kind="points", center=statistics.mean,
            path=f"SmolLM2-135M-Instruct, bf16, needle tasks at ~{length.upper()} tokens, "
            "ParisKV from 1024 tokens: sparse vs dense",
            note="% of the cases solved (each case a sample of 0 or 100); baseline: vanilla "
            "SGLang dense on FlashInfer; sparse: pariskv_triton, top-k 100, 4096 candidates (the "
            "server's default), 6-bit vote planes, a selection at every step (2026-12-04; the "
            "8-plane run is kept as sparse_quality_h200_planes8.json, the run at 800 candidates "
            "as sparse_quality_h200_c800.json)")
      for length in ("2k", "4k", "8k")],
    *[Claim(f"sparse.quality.{length}.reselect4", SPARSE_QUALITY, f"score_{length}",
            ours_variant="sglang-pic-sparse-r4", higher_is_better=True, target=1.0,
            target_kind="points", center=statistics.mean,
            path=f"SmolLM2-135M-Instruct, bf16, needle tasks at ~{length.upper()} tokens, "
            "ParisKV from 1024 tokens with --sparse-reselect-interval 4: sparse vs dense",
            note="the same cases and run as sparse.quality.*: a selection every 4 decode steps, "
            "moved on by a row a step between")
      for length in ("2k", "4k", "8k")],
    Claim("sparse.agreement_cpu.per_step", SPARSE_AGREEMENT, "first_divergence",
          baseline_variant=None, ours_variant="sglang-pic-sparse", higher_is_better=True,
          center=statistics.mean, path=SPARSE_AGREEMENT_PATH + ", a selection at every step",
          note="steps (of 64) the sparse server's greedy tokens equal dense torch_native's, "
          "mean over 16 passages; no target: how far sparse follows dense on free text"),
    *[Claim(f"sparse.agreement_cpu.reselect{n}", SPARSE_AGREEMENT, "first_divergence",
            baseline_variant="sglang-pic-sparse", ours_variant=f"sglang-pic-sparse-r{n}",
            higher_is_better=True, center=statistics.mean,
            path=SPARSE_AGREEMENT_PATH + f" with --sparse-reselect-interval {n} against a "
            "selection at every step",
            extract=_metric_pair(
                "first_divergence", "first_divergence",
                "design comparison, no vanilla side: steps (of 64) each server's greedy tokens "
                f"equal dense torch_native's, mean over 16 passages; ratio < 1: the interval-{n} "
                "server parts from dense earlier", baseline="sglang-pic-sparse",
                ours=f"sglang-pic-sparse-r{n}", vanilla_side=False))
      for n in (2, 4)],
    *[Claim(f"sparse.agreement_cpu_c256.{name}", SPARSE_AGREEMENT_C256, "first_divergence",
            baseline_variant="sglang-pic-sparse", ours_variant=variant, higher_is_better=True,
            center=statistics.mean,
            path=SPARSE_AGREEMENT_PATH + f", --sparse-candidates 256, {what} against a "
            "selection at every step (same candidates)",
            extract=_metric_pair(
                "first_divergence", "first_divergence",
                "design comparison, no vanilla side: steps (of 64) each server's greedy tokens "
                "equal dense torch_native's, mean over 16 passages; ratio < 1: it parts from "
                "dense earlier than per-step selection", baseline="sglang-pic-sparse",
                ours=variant, vanilla_side=False))
      for name, variant, what in (
          ("vote4", "sglang-pic-sparse-v4",
           "--sparse-vote-interval 4 (a vote every 4 steps, its candidates reranked between)"),
          ("reselect4", "sglang-pic-sparse-r4", "--sparse-reselect-interval 4"))],
    *[Claim(f"sparse.quality.recall_{length}", SPARSE_QUALITY, "recall", baseline_variant=None,
            ours_variant="sglang-pic-sparse", higher_is_better=True, center=statistics.mean,
            path=f"SmolLM2-135M-Instruct real keys (HF float32), ~{length.upper()}-token needle "
            "prompts, the server's selector (Triton kernels on the GPU)",
            extract=_selection_recall(length))
      for length in ("2k", "4k", "8k")],
    *[Claim(f"sparse.selector_recall_{length}", SELECTOR_RECALL, f"recall_{length}",
            baseline_variant="torch-reference", ours_variant="kernels", higher_is_better=True,
            target=0.98, center=statistics.mean,
            path="the same captured SmolLM2 keys (one needle prompt, 5 layers) through both "
            "index implementations; CPU, the kernels under TRITON_INTERPRET=1",
            note="samples are layers (recall@100, mean over KV heads); ratio: kernels / "
            "reference")
      for length in ("2k", "8k")],
]


def _source(c: Claim) -> Claim:
    """``c`` reading the first of its ``reruns`` that holds both sides' samples of its metric
    (a subset re-measured in a later run: each row still comes from one run), else itself."""
    for name in c.reruns:
        path = RESULTS / name
        if not path.exists():
            continue
        results = json.loads(path.read_text()).get("results", {})
        sides = [results.get(v, {}) for v in (c.baseline_variant, c.ours_variant)]
        if all("error" not in r and _samples(r, c.metric) for r in sides):
            return replace(c, raw_file=name)
    return c


def _row(c: Claim) -> dict:
    c = _source(c)
    row = {"claim": c.claim, "raw_file": c.raw_file, "metric": c.metric,
           "baseline_variant": c.baseline_variant, "baseline_backend": None,
           "ours_variant": c.ours_variant, "baseline": None, "ours": None, "ratio": None,
           "spread": None, "target": c.target, "target_kind": c.target_kind, "samples": 0,
           "same_run": False,
           "meets_target": None, "path": c.path, "note": c.note,
           "superseded": c.superseded}
    raw = RESULTS / c.raw_file
    if not raw.exists():
        row["note"] = f"not measured yet: {c.raw_file} is missing"
        return row
    if c.void is not None:
        row["note"] = f"void: {c.void}; to re-measure ({c.raw_file} kept as a record)"
        return row
    report = json.loads(raw.read_text())
    if c.extract is not None:
        try:
            base, ours, extra, *picked = c.extract(report)
        except (KeyError, statistics.StatisticsError) as e:
            # a report cut short: a side or cell it never finished, no samples
            row["note"] = f"{c.raw_file} lacks what the claim reads ({type(e).__name__}: {e})"
            return row
        row["baseline_backend"] = "n/a"
        if picked:  # the extract chose the baseline among the file's variants
            row["baseline_variant"] = picked[0]
            row["baseline_backend"] = _backend(report, picked[0])
        row["note"] = "; ".join(x for x in (c.note, extra) if x) or None
    else:
        results = report.get("results", {})
        missing = [v for v in (c.baseline_variant, c.ours_variant)
                   if v is not None and (v not in results or "error" in results[v])]
        if missing:
            row["note"] = f"variant(s) {', '.join(missing)} absent or failed in {c.raw_file}"
            return row
        base = (_samples(results[c.baseline_variant], c.metric)
                if c.baseline_variant is not None else [])
        ours = _samples(results[c.ours_variant], c.metric)
        row["baseline_backend"] = (_backend(report, c.baseline_variant)
                                   if c.baseline_variant is not None else "n/a")
    if not ours or (not base and c.baseline_variant is not None):
        row["note"] = f"{c.metric} missing in {c.raw_file}"
        return row
    # a row without a baseline (``baseline_variant`` None) quotes ours alone
    b, o = (c.center(base) if base else None), c.center(ours)
    ratio = (o / b if c.higher_is_better else b / o) if b and o else None
    row.update(baseline=b, ours=o, ratio=ratio, samples=len(ours) if not base
               else min(len(base), len(ours)),
               spread={"baseline": [min(base), max(base)] if base else None,
                       "ours": [min(ours), max(ours)]},
               same_run=(not report.get("merged_from_earlier_call")
                         or bool(report.get("one_machine"))) if c.same_run is None
               else c.same_run)
    if c.target is not None and c.target_kind == "points":
        row["meets_target"] = (o - b if c.higher_is_better else b - o) >= -c.target
    elif c.target is not None and ratio is not None:
        row["meets_target"] = ratio >= c.target
    return row


def problems(row: dict) -> list[str]:
    """The rules of docs/benchmarks.md a row breaks (empty: a headline-grade number)."""
    out = []
    if row["ours"] is None:
        return ["void" if (row["note"] or "").startswith("void:") else "not measured"]
    if row["baseline_backend"] not in (FLASHINFER, "fa3", "n/a"):
        out.append(f"baseline on {row['baseline_backend']}")
    if row["samples"] < MIN_SAMPLES:
        out.append(f"{row['samples']} sample(s) per side")
    if not row["same_run"]:
        out.append("not one run")
    if row.get("superseded"):
        out.append("measured before a fix")
    return out


def build() -> dict:
    rows = [_row(c) for c in CLAIMS]
    for r in rows:
        r["problems"] = problems(r)
    return {"generated_by": "benchmark/headlines.py", "rows": rows}


def print_table(doc: dict) -> None:
    def num(x: float | None, fmt: str = ".4g") -> str:
        return "-" if x is None else format(x, fmt)

    met = {True: "yes", False: "NO", None: "-"}
    print(f"{'claim':<38}{'backend':>11}{'baseline':>11}{'ours':>11}{'ratio':>8}{'target':>8}"
          f"{'met':>5}{'n':>3}  rule problems")
    for r in doc["rows"]:
        target = num(r["target"], ".2f")
        if r["target"] is not None and r["target_kind"] == "points":
            target = f"-{r['target']:g}pt"  # ours at most this far below the baseline
        print(f"{r['claim']:<38}{r['baseline_backend'] or '-':>11}{num(r['baseline']):>11}"
              f"{num(r['ours']):>11}{num(r['ratio'], '.3f'):>8}{target:>8}"
              f"{met[r['meets_target']]:>5}{r['samples']:>3}  {'; '.join(r['problems']) or '-'}")


README = RESULTS.parent.parent / "README.md"
README_START = "<!-- results:start (benchmark/headlines.py writes this table) -->"
README_END = "<!-- results:end -->"


@dataclass(frozen=True)
class ReadmeRow:
    """A row of the README's results table: ``claim``'s baseline and ours, as ``unit`` after
    multiplying by ``scale`` (a share as %), with ``case`` saying what was measured."""

    claim: str
    case: str
    unit: str
    scale: float = 1.0


README_ROWS = (
    ReadmeRow("spans.rag_grid.aligned",
              "Spans: RAG bursts, 128 requests x 4 of 32 documents of 2K tokens (H100)", "req/s"),
    ReadmeRow("spans.rag_grid.aligned.span_graphs",
              "Spans: the same, decode steps as CUDA graphs (--position-free-span-graphs)",
              "req/s"),
    ReadmeRow("spans.rag_grid.prefill_graphs.aligned.stream_ttft_p50",
              "Spans: first token, a Poisson stream of such requests at 70 % of vanilla's "
              "capacity, span graphs, SGLang's default prefill graphs on both sides", "ms"),
    ReadmeRow("spans.rag_grid.varlen_k6_p256_z07_t4",
              "Spans: RAG bursts, 6 of 256 documents of varied length, 4 tenants (H100)",
              "req/s"),
    ReadmeRow("spans.rag_grid.varlen_k10_p1024_z11_t4",
              "Spans: RAG bursts, 10 of 1024 documents of varied length, 4 tenants (H100)",
              "req/s"),
    ReadmeRow("spans.cached_span_ttft",
              "Spans, copy on reuse: TTFT of an 8K document cached after another system prompt",
              "ms"),
    ReadmeRow("spans.cold_ttft", "Spans: TTFT of a span prompt with nothing cached", "ms"),
    ReadmeRow("eviction.replay.generated_mixed_10pct",
              "Eviction: token hit rate, mixed traffic replayed at a 10 % cache (CPU; the "
              "best other policy)", "%", 100.0),
    ReadmeRow("eviction.e2e_hit_rate",
              "Eviction: token hit rate end to end, Mooncake trace sample (the better of "
              "vanilla lru / slru)",
              "%", 100.0),
    ReadmeRow("sparse.tpot_128k", "Sparse decode: time per output token, 1 x 128K", "ms"),
    ReadmeRow("sparse.tpot_b4_128k", "Sparse decode: time per output token, 4 x 128K", "ms"),
    ReadmeRow("sparse.tpot_512k", "Sparse decode: time per output token, 1 x 512K", "ms"),
    ReadmeRow("sparse.quality.8k",
              "Sparse decode: 8K needle tasks solved, SmolLM2-135M real weights", "%"),
    ReadmeRow("store.tcp_ttft_8k",
              "Prefix store: TTFT of an 8K prefix another instance computed (TCP)", "ms"),
    ReadmeRow("store.tcp_ttft_128k",
              "Prefix store: TTFT of a 128K prefix another instance computed (TCP)", "ms"),
    ReadmeRow("store.tcp_cold_miss_8k",
              "Prefix store: TTFT of an 8K prefix no store holds (lookup, miss, recompute)",
              "ms"),
)
"""The README's results table: the main current row of each capability, one line each."""


def _readme_number(x: float, row: ReadmeRow) -> str:
    x *= row.scale
    text = f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}" if abs(x) >= 100 else f"{x:.2f}"
    return f"{text} {row.unit}"


def readme_table(rows: list[dict]) -> str:
    """The README's results table (Markdown) from ``headlines.json``'s rows: per
    ``README_ROWS``, case, vanilla, ours and the ratio (> 1: ours better). Every row it shows
    must be current: measured, and breaking none of the rules (``problems``)."""
    by_claim = {r["claim"]: r for r in rows}
    lines = ["| case | vanilla SGLang | sglang-pic | ratio |", "|---|---:|---:|---:|"]
    for want in README_ROWS:
        r = by_claim.get(want.claim)
        if r is None or r["ratio"] is None or r["problems"]:
            why = "absent" if r is None else "; ".join(r["problems"]) or "no ratio"
            raise ValueError(f"README row {want.claim} is not a current headline row: {why}")
        lines.append(f"| {want.case} [`{want.claim}`] | {_readme_number(r['baseline'], want)} "
                     f"| {_readme_number(r['ours'], want)} | {r['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def readme_with_table(readme: str, table: str) -> str:
    """``readme`` with the text between ``README_START`` and ``README_END`` set to ``table``."""
    start, end = readme.find(README_START), readme.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"README.md lacks the lines {README_START!r} ... {README_END!r}")
    head = readme[: start + len(README_START)]
    return f"{head}\n{table}{readme[end:]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 if headlines.json differs from the raw files or "
                    "README.md's results table from headlines.json")
    args = ap.parse_args()
    doc = build()
    print_table(doc)
    text = json.dumps(doc, indent=1) + "\n"
    readme = README.read_text()
    try:
        new_readme = readme_with_table(readme, readme_table(doc["rows"]))
    except ValueError as e:  # a README row gone stale: headlines.json is still written
        print(f"README.md's results table: {e}", file=sys.stderr)
        new_readme = None
    if args.check:
        stale = [str(path) for path, ok in ((OUT, OUT.exists() and OUT.read_text() == text),
                                            (README, new_readme == readme)) if not ok]
        if stale:
            print(f"{', '.join(stale)} stale: run python -m benchmark.headlines",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    if new_readme is None:
        return 1
    if new_readme != readme:
        README.write_text(new_readme)
        print(f"wrote the results table of {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
