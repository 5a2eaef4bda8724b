"""RAG with span caching over a grid of workload shapes: vanilla SGLang (FlashInfer) vs
sglang-pic, one run per machine.

Each cell is one RAG workload family member:

* documents: fixed length, or log-normal lengths cut to [128, 4096] (median ~900), as chunkers
  that cut at sentence and section boundaries give;
* ``k`` documents per request, drawn without replacement from a pool with Zipf popularity;
* tenants: each has its own system prompt (256-1024 tokens); a request picks one uniformly;
* a question (64 tokens) and 64 output tokens (``ignore_eos``).

Per cell and variant: ``samples`` closed bursts of ``burst`` requests (each over a fresh pool
and fresh system prompts, the cache flushed before each). The last burst is followed by a Poisson
stream of ``stream`` new requests over the same pool and tenants, with the cache as the burst
left it (a service that has been running), at ``stream_load`` x vanilla's burst throughput in
that cell (vanilla runs first and writes its rates to ``rates_file``; another call of the same
run reads them). Recorded: requests/s
and TTFT p50/p99 per burst, the stream's TTFT p50/p99, the most requests running at once and the
most KV pool tokens in use (sampled every 0.2 s from the scheduler's load report), and each
cell's *ideal*: prompt tokens over the tokens that must be computed (each distinct document
once, each system prompt once, every question).

Vanilla gets the documents of a request in one canonical (sorted) order, as a careful user would
to share prefixes; sglang-pic gets the same tokens with each document marked as a span.

    python3 -m benchmark.bench_rag_grid --out DIR [--variants vanilla,sglang-pic] [--cells ...]
    python3 -m benchmark.bench_rag_grid --combine A.json B.json   # the calls of one run -> one report
    .venv/bin/python -m benchmark.bench_rag_grid --smoke   # CPU: SmolLM2, tiny sizes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from sglang_pic.spans.request import PDEP_ID as PDEP  # the span markers' token ids
from sglang_pic.spans.request import SSEP_ID as SSEP

from benchmark import description
from benchmark.harness import (
    LLAMA3_8B_DUMMY,
    current_variant,
    engine_arguments,
    percentile,
    stream_generate,
)

SPAN_SWITCHES = {  # variants of the span server: the settings they change
    "sglang-pic": {},
    "sglang-pic-copy": {"SGLANG_PIC_SPAN_COPY": "on"},  # turned copies of moved spans
    "sglang-pic-triton": {},  # pic_triton: the shift-aware kernels for every batch
    # decode steps reading moved keys replay a second CUDA graph set (segmented attention in a
    # padded layout) instead of running eagerly
    "sglang-pic-span-graphs": {"SGLANG_PIC_SPAN_GRAPHS": "1"},
    # and --span-schedule ready-first: requests whose spans are cached batched ahead of span
    # prefills still waiting
    "sglang-pic-span-graphs-ready-first": {"SGLANG_PIC_SPAN_GRAPHS": "1",
                                           "SGLANG_PIC_SPAN_SCHEDULE": "ready-first"},
    # every request's runs read on their own in decode steps (--span-group-shared-runs off)
    "sglang-pic-per-run": {"SGLANG_PIC_SPAN_GROUPS": "off"},
}
PIC_BACKEND = {"sglang-pic-triton": "pic_triton"}

# name -> (document lengths, docs per request, pool, zipf, tenants)
CELLS = {
    "aligned": ("fixed2048", 4, 32, 1.1, 1),
    "varlen_k6_p256_z07_t4": ("lognormal", 6, 256, 0.7, 4),
    # variable lengths with much reuse: every request's documents at offsets of their own
    "varlen_k6_p32_z11_t4": ("lognormal", 6, 32, 1.1, 4),
    "varlen_k10_p1024_z11_t4": ("lognormal", 10, 1024, 1.1, 4),
    "varlen_k10_p256_z11_t1": ("lognormal", 10, 256, 1.1, 1),
    "fixed_k6_p1024_z07_t4": ("fixed2048", 6, 1024, 0.7, 4),
    "smoke": ("lognormal", 3, 8, 1.0, 2),  # --smoke: tiny, on the CPU
}
DEFAULT_CELLS = ("aligned", "varlen_k6_p256_z07_t4", "varlen_k10_p1024_z11_t4",
                 "fixed_k6_p1024_z07_t4")


def doc_lengths(rng, kind: str, n: int, params: dict) -> list[int]:
    """``n`` document lengths: ``fixed<L>`` or log-normal cut to [min, max] tokens."""
    import numpy as np

    if kind.startswith("fixed"):
        return [int(kind[5:])] * n
    lo, hi, median = params["doc_min"], params["doc_max"], params["doc_median"]
    lengths = np.exp(rng.normal(np.log(median), params["doc_sigma"], size=n))
    return [int(x) for x in np.clip(lengths, lo, hi)]


def draw_requests(rng, cell: tuple, n: int, params: dict, over: dict | None = None) -> dict:
    """``n`` requests (each one's tenant, sorted document ids and question) over a fresh pool and
    fresh tenants, or over ``over``'s pool and tenants."""
    import numpy as np

    kind, k, pool_size, zipf, tenants = cell
    vocab = params["vocab"]

    def toks(m: int) -> list[int]:
        return [int(t) for t in rng.integers(1000, vocab, size=m)]

    if over is not None:
        pool, systems = over["pool"], over["systems"]
    else:
        pool = [toks(m) for m in doc_lengths(rng, kind, pool_size, params)]
        lo, hi = params["system_min"], params["system_max"]
        systems = [toks(int(rng.integers(lo, hi + 1))) for _ in range(tenants)]
    weights = 1.0 / np.arange(1, pool_size + 1) ** zipf
    weights /= weights.sum()
    requests = []
    for _ in range(n):
        docs = sorted(int(d) for d in rng.choice(pool_size, size=k, replace=False, p=weights))
        requests.append((int(rng.integers(tenants)), docs, toks(params["question_tokens"])))
    return {"pool": pool, "systems": systems, "requests": requests}


def prompt(draw: dict, request: tuple, spans: bool) -> list[int]:
    tenant, docs, question = request
    ids = list(draw["systems"][tenant])
    for d in docs:
        ids += ([SSEP] if spans else []) + draw["pool"][d]
    return ids + ([PDEP] if spans else []) + question


TTFT_PARTS = ("wait", "prefill", "rest")
"""The parts ``ttft_parts`` splits a stream request's time to first token into."""


def ttft_parts(ttft_s: float, meta: dict) -> dict | None:
    """Where a request's time to first token went, in ms, from the server's timestamps
    (``meta_info`` with ``enable_metrics``): ``wait`` from its arrival at the server to its
    first forward batch (tokenizing, the span planner's hold, the waiting queue), ``prefill``
    that batch until its prefill finished, ``rest`` the remainder of the client's TTFT (to and
    from the server, the first token's way out). None without the timestamps."""
    keys = ("request_received_ts", "forward_entry_time", "prefill_finished_time")
    if not all(meta.get(k) for k in keys):
        return None
    received, entry, done = (float(meta[k]) for k in keys)
    return dict(zip(TTFT_PARTS, (1000 * (entry - received), 1000 * (done - entry),
                                 1000 * (ttft_s - (done - received))), strict=True))


def ideal(draw: dict) -> float:
    """Prompt tokens over what must be computed: each distinct document and system prompt once,
    every question."""
    prompt_tokens = must = 0
    docs_seen, systems_seen = set(), set()
    for tenant, docs, question in draw["requests"]:
        prompt_tokens += len(draw["systems"][tenant]) + len(question)
        prompt_tokens += sum(len(draw["pool"][d]) for d in docs)
        must += len(question)
        if tenant not in systems_seen:
            systems_seen.add(tenant)
            must += len(draw["systems"][tenant])
        for d in docs:
            if d not in docs_seen:
                docs_seen.add(d)
                must += len(draw["pool"][d])
    return prompt_tokens / must


async def _load_sampler(engine, stop: asyncio.Event, peaks: dict) -> None:
    """The most running requests and KV tokens in use while ``stop`` is not set."""
    while not stop.is_set():
        try:
            for snap in await engine.tokenizer_manager.get_loads():
                peaks["running"] = max(peaks.get("running", 0), int(snap.num_running_reqs))
                peaks["used_tokens"] = max(peaks.get("used_tokens", 0), int(snap.num_used_tokens))
                peaks["pool_tokens"] = int(snap.max_total_num_tokens)
        except Exception as e:  # a version without load reports: no peaks
            peaks["error"] = repr(e)
            return
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most of the ``(start, end)`` intervals open at one time (an end before a start at
    the same instant)."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = open_ = 0
    for _, step in events:
        open_ += step
        most = max(most, open_)
    return most


async def _burst(engine, prompts: list[list[int]], sp: dict) -> tuple[list, float, dict]:
    """The burst's outputs, its seconds and its peaks: SGLang's running requests and KV tokens
    in use (sampled), and ``decoding``: the most client requests between their first token and
    their last at once (SGLang's count also holds the span cache's prefill units)."""
    stop, peaks = asyncio.Event(), {}
    sampler = asyncio.ensure_future(_load_sampler(engine, stop, peaks))
    t = time.perf_counter()
    outs = await asyncio.gather(*(stream_generate(engine, p, sp) for p in prompts))
    elapsed = time.perf_counter() - t
    stop.set()
    await sampler
    # each request's times count from its own send, within a scheduling step of the burst's
    peaks["decoding"] = most_at_once([(first, end) for first, end, _ in outs])
    return outs, elapsed, peaks


async def _stream(engine, prompts: list[list[int]], sp: dict, rate: float, rng) -> list:
    async def one(delay: float, p: list[int]):
        await asyncio.sleep(delay)
        return await stream_generate(engine, p, sp)

    delays, at = [], 0.0
    for _ in prompts:
        at += float(rng.exponential(1.0 / rate))
        delays.append(at)
    return await asyncio.gather(*(one(d, p) for d, p in zip(delays, prompts, strict=True)))


def span_counters() -> dict[str, float]:
    """sglang-pic's counters of this process's engine so far (``sglang_pic:*`` on ``/metrics``:
    span extends replayed in prefill graphs, decode steps from the span graph set, ...), read
    from SGLang's prometheus multiprocess folder; empty without ``enable_metrics``."""
    from sglang.srt.utils import common

    folder = getattr(getattr(common, "prometheus_multiproc_dir", None), "name", None)
    if not folder:
        return {}
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=folder)
    return {s.name: s.value for metric in registry.collect() for s in metric.samples
            if s.name.startswith("sglang_pic:")}


def workload(engine_kwargs: dict, params: dict) -> dict:
    import numpy as np

    variant = current_variant()
    spans = variant.startswith("sglang-pic")
    if spans:
        os.environ.update(SPAN_SWITCHES.get(variant, {}))  # read by the scheduler it starts
    import sglang as sgl

    kwargs = engine_arguments(
        engine_kwargs, PIC_BACKEND.get(variant, params["pic_backend"]) if spans else None)
    t0 = time.perf_counter()
    engine = sgl.Engine(**kwargs)
    result: dict = {"engine_start_s": time.perf_counter() - t0, "variant": variant,
                    "attention_backend": kwargs.get("attention_backend"), "cells": {}}
    sp = {"max_new_tokens": params["output_tokens"], "temperature": 0, "ignore_eos": True}
    rates_path = Path(params["rates_file"]) if params.get("rates_file") else None
    rates = json.loads(rates_path.read_text()) if rates_path and rates_path.exists() else {}
    partial = Path(params["partial_dir"]) / f"rag_grid.{variant}.partial.json" \
        if params.get("partial_dir") else None
    try:
        rng = np.random.default_rng(params["seed"])
        warm_cell = CELLS[params["cells"][0]][:1] + (2, 8, 1.0, 1)
        warm = draw_requests(rng, warm_cell, params["warmup"], params)  # untimed: compiles
        engine.loop.run_until_complete(_burst(engine, [prompt(warm, r, spans)
                                                       for r in warm["requests"]], sp))
        for name in params["cells"]:
            cell = CELLS[name]
            cell_rng = np.random.default_rng([params["seed"], sorted(CELLS).index(name)])
            burst = params.get("bursts", {}).get(name, params["burst"])
            out: dict = {"burst": burst, "ideal": [], "requests_per_s": [],
                         "ttft_p50_ms": [], "ttft_p99_ms": [], "peak_running": [],
                         "peak_decoding": [], "peak_used_tokens": [], "prompt_tokens": []}
            for _ in range(params["samples"]):
                draw = draw_requests(cell_rng, cell, burst, params)
                prompts = [prompt(draw, r, spans) for r in draw["requests"]]
                engine.flush_cache()
                outs, elapsed, peaks = engine.loop.run_until_complete(
                    _burst(engine, prompts, sp))
                ttfts = [o[0] for o in outs]
                out["ideal"].append(ideal(draw))
                out["requests_per_s"].append(len(prompts) / elapsed)
                out["ttft_p50_ms"].append(1000 * percentile(ttfts, 50))
                out["ttft_p99_ms"].append(1000 * percentile(ttfts, 99))
                out["peak_running"].append(peaks.get("running"))
                out["peak_decoding"].append(peaks.get("decoding"))
                out["peak_used_tokens"].append(peaks.get("used_tokens"))
                out["pool_tokens"] = peaks.get("pool_tokens")
                out["prompt_tokens"].append(sum(len(p) - (len(r[1]) + 1 if spans else 0)
                                                for p, r in zip(prompts, draw["requests"],
                                                                strict=True)))
            capacity = statistics.median(out["requests_per_s"])
            if variant == "vanilla":
                rates[name] = params["stream_load"] * capacity
            rate = rates.get(name) or params.get("stream_rate")
            if rate and params["stream"]:
                draw = draw_requests(cell_rng, cell, params["stream"], params, over=draw)
                outs = engine.loop.run_until_complete(_stream(
                    engine, [prompt(draw, r, spans) for r in draw["requests"]], sp, rate,
                    cell_rng))
                ttfts = [o[0] for o in outs]
                out["stream_rate"] = rate
                out["stream_ttft_ms_all"] = [round(1000 * t, 2) for t in ttfts]
                out["stream_ttft_p50_ms"] = 1000 * percentile(ttfts, 50)
                out["stream_ttft_p99_ms"] = 1000 * percentile(ttfts, 99)
                parts = [p for p in (ttft_parts(o[0], o[2].get("meta_info", {}))
                                     for o in outs) if p is not None]
                for part in TTFT_PARTS if parts else ():
                    values = [p[part] for p in parts]
                    out[f"stream_{part}_ms_all"] = [round(v, 2) for v in values]
                    out[f"stream_{part}_p50_ms"] = percentile(values, 50)
            for key in ("requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "ideal"):
                out[f"{key}_median"] = statistics.median(out[key])
            if spans and engine_kwargs.get("enable_metrics"):
                out["counters_so_far"] = span_counters()  # since the engine started
            result["cells"][name] = out
            breakdown = ", ".join(f"{part} {out[f'stream_{part}_p50_ms']:.1f}"
                                  for part in TTFT_PARTS if f"stream_{part}_p50_ms" in out)
            print(f"[rag-grid] {variant} {name}: {capacity:.2f} req/s, TTFT p50 "
                  f"{out['ttft_p50_ms_median']:.0f} ms, stream p50 "
                  f"{out.get('stream_ttft_p50_ms', float('nan')):.0f} ms"
                  + (f" ({breakdown})" if breakdown else "") + ", peak running "
                  f"{out['peak_running']}, decoding {out['peak_decoding']}", flush=True)
            if out.get("counters_so_far"):
                print(f"[rag-grid] {variant} counters so far: " + ", ".join(
                    f"{k.removeprefix('sglang_pic:')} {v:.0f}"
                    for k, v in sorted(out["counters_so_far"].items())), flush=True)
            if partial is not None:
                partial.write_text(json.dumps(result))
            if variant == "vanilla" and rates_path is not None:
                rates_path.write_text(json.dumps(rates))
    finally:
        engine.shutdown()
    return result


ENGINE_KWARGS = {
    **LLAMA3_8B_DUMMY,
    "context_length": 65536,
    "mem_fraction_static": 0.80,
    "cuda_graph_max_bs_decode": 128,
}

PARAMS = {
    "seed": 1,
    "vocab": 120000,
    "samples": 3,
    "burst": 48,
    "stream": 32,
    "stream_load": 0.7,
    "warmup": 8,
    "output_tokens": 64,
    "question_tokens": 64,
    "system_min": 256,
    "system_max": 1024,
    "doc_min": 128,
    "doc_max": 4096,
    "doc_median": 900,
    "doc_sigma": 0.9,
    "pic_backend": "pic_flashinfer",
    "cells": list(DEFAULT_CELLS),
}

SMOKE = {  # CPU check of the script: SmolLM2 on the CPU engine, tiny sizes
    "engine_kwargs": {"dtype": "bfloat16", "max_total_tokens": 16384, "page_size": 1,
                      "context_length": 4096},
    "params": {"vocab": 49000, "samples": 1, "burst": 4, "stream": 3, "warmup": 2,
               "output_tokens": 4, "question_tokens": 8, "system_min": 16, "system_max": 32,
               "doc_min": 16, "doc_max": 96, "doc_median": 40,
               "pic_backend": "pic_torch_native", "cells": ["smoke"]},
}


def summarize(report: dict, counts: tuple[str, ...] = ("peak_decoding",)) -> list[dict]:
    """One row per cell: each variant's medians and its ratios to vanilla; for each of
    ``counts`` (per-sample counts of a cell) both sides recorded, the most of any sample,
    ours and vanilla's."""
    res = report["results"]
    van = res.get("vanilla", {}).get("cells", {})
    rows = []
    for variant, r in res.items():
        if variant == "vanilla" or "cells" not in r:
            continue
        for name, c in r["cells"].items():
            v = van.get(name)
            if not v:
                continue
            row = {"variant": variant, "cell": name, "ideal": c["ideal_median"],
                   "requests_per_s": c["requests_per_s_median"],
                   "vanilla_requests_per_s": v["requests_per_s_median"],
                   "throughput_ratio": c["requests_per_s_median"] / v["requests_per_s_median"],
                   "ttft_p50_ratio": v["ttft_p50_ms_median"] / c["ttft_p50_ms_median"]}
            for key in counts:
                if key in c and key in v:
                    row[key] = _most(c[key])
                    row[f"vanilla_{key}"] = _most(v[key])
            if "stream_ttft_p50_ms" in c and "stream_ttft_p50_ms" in v:
                row["stream_ttft_p50_ratio"] = v["stream_ttft_p50_ms"] / c["stream_ttft_p50_ms"]
                row["stream_ttft_p99_ratio"] = v["stream_ttft_p99_ms"] / c["stream_ttft_p99_ms"]
            row["fraction_of_bound"] = row["throughput_ratio"] / row["ideal"]
            rows.append(row)
    return rows


def _most(x) -> int:
    return max(n or 0 for n in x) if isinstance(x, list) else int(x or 0)


def print_summary(rows: list[dict], count: str = "peak_decoding", label: str = "decoding") -> None:
    """The summary's table; ``count``: the per-cell count shown as ours/vanilla's."""
    w = max((len(r["variant"]) for r in rows), default=0) + 2  # sglang-pic-span-graphs: 22
    print(f"\n{'variant':<{w}}{'cell':<26}{'ideal':>6}{'req/s':>8}{'x van':>7}{'TTFT x':>8}"
          f"{'stream x':>9}{label:>9}")
    for r in rows:
        print(f"{r['variant']:<{w}}{r['cell']:<26}{r['ideal']:>6.2f}{r['requests_per_s']:>8.2f}"
              f"{r['throughput_ratio']:>7.2f}{r['ttft_p50_ratio']:>8.2f}"
              f"{r.get('stream_ttft_p50_ratio', float('nan')):>9.2f}"
              f"{r.get(count, '-'):>5}/{r.get(f'vanilla_{count}', '-'):<3}")
    for variant in sorted({r["variant"] for r in rows}):
        mine = [r for r in rows if r["variant"] == variant]
        worst = min(mine, key=lambda r: r["throughput_ratio"])
        print(f"{variant}: worst cell {worst['cell']} at {worst['throughput_ratio']:.2f}x "
              f"(ideal {worst['ideal']:.2f})")


def combine(paths: list[str], out: str | None, one_machine: bool = False) -> dict:
    """The calls of a grid as one report: harness reports, and the per-variant partial files a
    call cut by its time limit left (``rag_grid.<variant>.partial.json``; the first harness
    report gives the parameters and the machine). ``cell_calls`` names, per cell, the call
    each variant's samples came from. Flagged ``merged_from_earlier_call``: in some cell the
    variants came from different calls (they did not alternate within one call);
    ``one_machine``: the calls ran back to back on one machine (one run, as ``headlines.py``
    counts runs). Cells whose two sides share a call are a same-run comparison on their own,
    so calls of different machines may be merged when every cell's sides share one."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    reports = [d for d in docs if "results" in d]
    if not reports:
        raise SystemExit("--combine: at least one harness report is needed (its parameters)")
    merged = {k: v for k, v in reports[0].items() if k not in ("ratios", "summary")}
    merged["results"] = {}
    merged["calls"] = [{"file": Path(p).name,
                        "variants": list(d["results"]) if "results" in d else [d["variant"]],
                        "cells": d["params"]["cells"] if "params" in d else list(d["cells"]),
                        "environment": d.get("environment")}
                       for p, d in zip(paths, docs, strict=True)]
    merged["one_machine"] = one_machine
    cell_calls: dict[str, dict[str, str]] = {}

    def settings(r: dict) -> dict:  # the run's parameters, less where its files went
        return {k: v for k, v in r["params"].items()
                if k not in ("rates_file", "partial_dir", "cells", "burst", "bursts", "stream")}

    def add(variant: str, result: dict, call: str) -> None:  # a variant's cells from the calls
        into = merged["results"].setdefault(variant, {**result, "cells": {}})
        into["cells"].update(result.get("cells", {}))
        for cell in result.get("cells", {}):
            cell_calls.setdefault(cell, {})[variant] = call

    for path, d in zip(paths, docs, strict=True):
        if "results" in d:
            if settings(d) != settings(reports[0]):
                raise SystemExit(f"--combine: {paths} were run with different params")
            for variant, result in d["results"].items():
                add(variant, result, Path(path).name)
        else:
            add(d["variant"], d, Path(path).name)
    merged["cell_calls"] = cell_calls
    merged["merged_from_earlier_call"] = any(len(set(by_variant.values())) > 1
                                             for by_variant in cell_calls.values())
    merged["summary"] = summarize(merged)
    target = Path(out or Path(paths[0]).with_name("spans_rag_grid_h200.json"))
    target.write_text(json.dumps(merged, indent=1))
    print_summary(merged["summary"])
    print(f"[bench] wrote {target}")
    return merged


def main() -> None:
    from benchmark.harness import cpu_smoke_engine, run_side_by_side, smoke_dir

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None, help="results folder (default benchmark/results)")
    ap.add_argument("--variants", default="vanilla,sglang-pic",
                    help="any of vanilla (FlashInfer), sglang-pic (segmented attention over "
                         "shared pages), sglang-pic-copy (--span-copy-on-reuse on), "
                         "sglang-pic-triton (pic_triton), sglang-pic-span-graphs "
                         "(--position-free-span-graphs), sglang-pic-span-graphs-ready-first "
                         "(and --span-schedule ready-first), sglang-pic-per-run "
                         "(--span-group-shared-runs off)")
    ap.add_argument("--cells", default=",".join(DEFAULT_CELLS),
                    help=f"cells to run, of {', '.join(CELLS)}")
    ap.add_argument("--samples", type=int, default=PARAMS["samples"])
    ap.add_argument("--burst", type=int, default=PARAMS["burst"])
    ap.add_argument("--burst-of", default="", metavar="CELL=N,...",
                    help="a burst size for named cells (e.g. aligned=128: more requests than "
                         "vanilla's pool holds at once, to count how many each side runs)")
    ap.add_argument("--stream", type=int, default=PARAMS["stream"])
    ap.add_argument("--rates-file", default=None,
                    help="vanilla's per-cell stream rates (written by vanilla, read by the "
                         "others; default <out>/rag_grid_rates.json)")
    ap.add_argument("--name", default="spans_rag_grid_h200", help="the report's file name")
    ap.add_argument("--combine", nargs="+", default=None, metavar="REPORT",
                    help="merge the reports (and partial files) of one run's calls into one "
                         "(--out: the file) and print the summary")
    ap.add_argument("--one-machine", action="store_true",
                    help="with --combine: the calls ran back to back on one machine")
    ap.add_argument("--ttft-breakdown", action="store_true",
                    help="both sides with SGLang's --enable-metrics: each stream request's "
                         "TTFT split into its wait for a forward batch, its prefill and the "
                         "rest (stream_{wait,prefill,rest}_ms_all)")
    ap.add_argument("--prefill-graphs", action="store_true",
                    help="both sides with SGLang's default prefill CUDA graphs (attention runs "
                         "between their captured pieces, so span extends replay them too); "
                         "without it both sides prefill eagerly")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run with SmolLM2")
    args = ap.parse_args()
    if args.combine:
        combine(args.combine, args.out, args.one_machine)
        return
    unknown = set(args.cells.split(",")) - set(CELLS)
    if unknown:
        ap.error(f"unknown cells {sorted(unknown)}; known: {', '.join(CELLS)}")
    engine_kwargs = ENGINE_KWARGS
    try:
        bursts = {c: int(n) for c, n in (kv.split("=") for kv in args.burst_of.split(",") if kv)}
    except ValueError:
        ap.error(f"--burst-of: expected CELL=N,..., got {args.burst_of!r}")
    if set(bursts) - set(CELLS) or any(n < 1 for n in bursts.values()):
        ap.error(f"--burst-of: known cells and positive sizes only, got {args.burst_of!r}")
    params = dict(PARAMS, samples=args.samples, burst=args.burst, stream=args.stream,
                  cells=args.cells.split(","), bursts=bursts)
    name = args.name
    if args.smoke:
        engine_kwargs = cpu_smoke_engine(disable_radix_cache=False, **SMOKE["engine_kwargs"])
        params = {**PARAMS, **SMOKE["params"]}
        name = "spans_rag_grid_cpu_smoke"
        args.out = args.out or smoke_dir()
    if args.ttft_breakdown:
        engine_kwargs = dict(engine_kwargs, enable_metrics=True)
    if args.prefill_graphs:
        engine_kwargs = dict(engine_kwargs, disable_prefill_cuda_graph=False)
    out_dir = Path(args.out) if args.out else Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    params["rates_file"] = args.rates_file or str(out_dir / "rag_grid_rates.json")
    params["partial_dir"] = str(out_dir)
    report = run_side_by_side(name, "bench_rag_grid", "workload", engine_kwargs, params,
                              out_dir=str(out_dir), variants=tuple(args.variants.split(",")),
                              timeout_s=3600)
    rows = summarize(report)
    print_summary(rows)


if __name__ == "__main__":
    main()
