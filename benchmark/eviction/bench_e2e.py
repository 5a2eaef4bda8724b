"""End to end on the H200: `--radix-eviction-policy sae` (sglang-pic) vs `lru` (vanilla SGLang).

The trace is ``traces.generate("mix")`` (chat sessions, agent loops, templated single-turn
requests; content-faithful token ids) or, with ``--trace mooncake``, the first ``--requests``
requests of the Mooncake conversation trace (each 512-token block hash becomes 512 fixed token
ids, ``traces.load_mooncake``), replayed open-loop through ``Engine.async_generate`` at its
arrival times compressed by ``--speedup``, with a KV budget (``max_total_tokens``) well below the
trace's unique tokens so the prefix cache has to evict. The Mooncake trace is an hour of a
cluster's traffic (~46K prompt tokens/s), more than one GPU serves: ``--sample-conversations K``
replays one conversation in K (a conversation: the requests sharing the block after the common
system block, picked by a hash of that block's id) over the whole hour, compressed by
``--speedup`` (60: ~59 s), with the KV pool 10 % of the sample's unique tokens (the replay's
10 % column). ``--requests N`` instead replays the trace's first N requests, which share little
(4 % of their tokens at N=200: the conversations have only begun). The open-loop schedule moves the hit rate
between runs, so ``--rounds N`` runs every variant N times, alternating which goes first; the
per-run values are kept (``<metric>_all``) and the headline rows take their mean. Each request generates a few tokens
(``ignore_eos``); the next turn's prompt carries the trace's recorded answer, as a client resending
history would. Reported per variant: token hit rate (cached / prompt tokens), TTFT p50/p99,
makespan.

    python3 -m benchmark.eviction.bench_e2e [--scale 60] [--kv-tokens 32768] [--speedup 8] [--seed 0]
        [--no-cuda-graph] [--baselines lru,fifo]
    python3 -m benchmark.eviction.bench_e2e --smoke     # CPU, SmolLM2, tiny trace

``--baselines``: vanilla SGLang with each of these of its policies, in the same run (``vanilla``
is the first, ``lru`` by default; the others run as ``vanilla-<policy>``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time
from pathlib import Path

from benchmark import description
from benchmark.harness import LLAMA3_8B_DUMMY, percentile

HERE = Path(__file__).resolve().parent


def workload(engine_kwargs: dict, params: dict) -> dict:
    import sglang as sgl
    from sglang_pic.eviction.replay import traces

    repo = HERE.parent.parent
    kwargs = dict(engine_kwargs)
    if not Path(kwargs["model_path"]).is_absolute():
        kwargs["model_path"] = str(repo / kwargs["model_path"])
    if params.get("trace") == "mooncake":
        trace = traces.load_mooncake(os.environ["SGLANG_PIC_BENCH_TRACE_FILE"])
    else:
        trace = traces.generate("mix", scale=params["scale"], seed=params["seed"])
    limit = params["max_prompt_tokens"]
    vocab = params["vocab"]
    trace = [r for r in trace if len(r.prompt) <= limit]
    stats_file = None
    if kwargs.get("radix_eviction_policy") == "sae":  # where the policy's time goes
        import tempfile

        stats_file = Path(tempfile.mkdtemp()) / "sae_stats.json"
        os.environ["SGLANG_PIC_SAE_STATS"] = str(stats_file)
    t0 = time.perf_counter()
    engine = sgl.Engine(**kwargs)
    start_s = time.perf_counter() - t0
    out_tokens = params["output_tokens"]

    def ids(tokens: list[int]) -> list[int]:
        return [1000 + t % (vocab - 1000) for t in tokens]

    async def one(req, start: float) -> tuple[float, int, int]:
        delay = start + req.t / params["speedup"] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter()
        first = None
        last: dict = {}
        sp = {"max_new_tokens": min(out_tokens, max(1, len(req.output))), "temperature": 0,
              "ignore_eos": True}
        gen = await engine.async_generate(input_ids=ids(req.prompt), sampling_params=sp,
                                          stream=True)
        async for chunk in gen:
            if first is None:
                first = time.perf_counter() - sent
            last = chunk
        return first or 0.0, int(last["meta_info"].get("cached_tokens", 0)), len(req.prompt)

    async def replay():
        start = time.perf_counter()
        return await asyncio.gather(*(one(r, start) for r in trace))

    try:
        # warm-up outside the trace's token range, through every kernel path the replay takes
        # (a cold prompt, a prefix hit extended, a batch of prompts), so that first-use compiles
        # land here and not in the timed replay; then flush, so every variant starts empty
        warm = {"max_new_tokens": 2, "ignore_eos": True}
        engine.generate(input_ids=[7] * 512, sampling_params=warm)
        engine.generate(input_ids=[7] * 512 + [8] * 1024, sampling_params=warm)
        engine.generate(input_ids=[[9, j] + [7] * 700 for j in range(4)], sampling_params=warm)
        engine.flush_cache()
        t = time.perf_counter()
        outs = engine.loop.run_until_complete(replay())
        makespan = time.perf_counter() - t
    finally:
        engine.shutdown()
    ttft = [o[0] for o in outs]
    cached, prompt = sum(o[1] for o in outs), sum(o[2] for o in outs)
    profile = _policy_profile(stats_file) if stats_file else {}
    per_run = {"token_hit_rate": cached / prompt, "ttft_p50_ms": 1000 * percentile(ttft, 50),
               "ttft_p99_ms": 1000 * percentile(ttft, 99),
               "ttft_mean_ms": 1000 * sum(ttft) / len(ttft)}
    return {**profile, **{f"{k}_all": [v] for k, v in per_run.items()},
        # every request's TTFT in arrival order, one list per run (the plot's CDFs)
        "request_ttft_ms_all": [[round(1000 * t, 3) for t in ttft]],
        "engine_start_s": start_s,
        "requests": len(outs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        **per_run,
        "makespan_s": makespan,
        "policy": kwargs.get("radix_eviction_policy", "lru"),
    }


def conversation_key(hash_ids: list[int]) -> int:
    """A Mooncake request's conversation: the id of its block after the system block that every
    request shares (the trace has no session ids; a later turn resends the earlier turns, so it
    starts with the same blocks)."""
    return hash_ids[1] if len(hash_ids) > 1 else hash_ids[0]


def mooncake_slice(path: str, *, sample: int | None, requests: int | None,
                   max_prompt_tokens: int) -> list[str]:
    """The trace lines to replay: one conversation in ``sample`` (by a multiplicative hash of
    its key, so the pick does not follow the ids' order of first appearance) over the whole
    trace, or the first ``requests`` lines; prompts above ``max_prompt_tokens`` are left out
    (the engine's context). Malformed lines are kept: the loader reports and skips them."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key, n_in = conversation_key(rec["hash_ids"]), int(rec["input_length"])
            except (ValueError, KeyError, IndexError, TypeError):
                out.append(line)
                continue
            if n_in > max_prompt_tokens:
                continue
            if sample is not None and (key * 2654435761) % 2**32 % sample:
                continue
            out.append(line)
            if requests is not None and len(out) >= requests:
                break
    return out


def _policy_profile(path: Path) -> dict:
    """The scheduler's own account (``SGLANG_PIC_SAE_STATS``, dumped after every evict pass) of
    the policy's time against its busy time: whole evict passes (SGLang's heap and frees plus
    our scoring) and the callbacks outside them (requests, inserts, splits, hits)."""
    if not path.exists():
        return {"policy_profile": "no evict pass"}
    s = json.loads(path.read_text())
    outside = sum(v for k, v in s["seconds"].items() if k not in ("get_priority", "on_evict"))
    busy = max(s["scheduler"]["busy_seconds"], 1e-9)
    passes = max(s["evict"]["passes"], 1)
    return {"evict_passes": s["evict"]["passes"],
            "evict_pass_ms_mean": 1000 * s["evict"]["seconds"] / passes,
            "evict_pass_ms_max": 1000 * s["evict"]["max_seconds"],
            "policy_scoring_s": s["seconds"].get("get_priority", 0.0),
            "policy_callbacks_s": outside,
            "scheduler_steps": s["scheduler"]["steps"],
            "scheduler_busy_s": busy,
            "scheduler_step_ms_mean": 1000 * busy / max(s["scheduler"]["steps"], 1),
            "policy_share_of_busy_pct": 100 * (s["evict"]["seconds"] + outside) / busy,
            "policy_events": s["events"]}


ENGINE_KWARGS = {**LLAMA3_8B_DUMMY, "context_length": 32768, "max_total_tokens": 32768,
                 "mem_fraction_static": 0.80, "cuda_graph_max_bs_decode": 64}
PARAMS = {"scale": 60, "seed": 0, "speedup": 8.0, "output_tokens": 16, "vocab": 120000,
          "max_prompt_tokens": 24000, "trace": "mix"}
MOONCAKE_SAMPLE = 40  # one conversation in 40: 241 requests, 1.84M prompt tokens
MOONCAKE_SPEEDUP = 60.0  # the trace's hour in ~59 s: ~60 % of an H200's 8B prefill
MOONCAKE_POOL_FRACTION = 0.10
MOONCAKE_TRACE = HERE.parent.parent.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def plot_e2e(report: dict, out: Path) -> Path:
    """Each variant's TTFT distribution (one line per run; from ``request_ttft_ms_all``) beside
    its token hit rate per run: the figure of a ``bench_e2e.py`` report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmark.harness import save_figure

    results = {v: r for v, r in report["results"].items() if "token_hit_rate" in r}
    fig, (ax_cdf, ax_hit) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(2, 1))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (variant, r) in enumerate(results.items()):
        label = f"{variant} ({r.get('policy', '?')})"
        for j, ttft in enumerate(r.get("request_ttft_ms_all", [])):
            xs = sorted(ttft)
            ys = [(k + 1) / len(xs) for k in range(len(xs))]
            ax_cdf.step(xs, ys, where="post", color=colors[i % len(colors)], alpha=0.8,
                        label=label if j == 0 else None)
        if "request_ttft_ms_all" not in r:  # an older report: its p50 and p99, points of the CDF
            p50s = r.get("ttft_p50_ms_all", [r["ttft_p50_ms"]])
            p99s = r.get("ttft_p99_ms_all", [r["ttft_p99_ms"]])
            for j, (p50, p99) in enumerate(zip(p50s, p99s, strict=True)):
                ax_cdf.plot([p50, p99], [0.5, 0.99], "o--", color=colors[i % len(colors)],
                            label=f"{label}: p50, p99" if j == 0 else None)
        hits = r.get("token_hit_rate_all", [r["token_hit_rate"]])
        ax_hit.bar(i, sum(hits) / len(hits), color=colors[i % len(colors)], alpha=0.6)
        ax_hit.plot([i] * len(hits), hits, "k.", ms=6)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (ms, log)")
    ax_cdf.set_ylabel("share of requests")
    ax_cdf.set_ylim(0, 1.02)
    ax_cdf.grid(alpha=0.3)
    if ax_cdf.get_legend_handles_labels()[0]:
        ax_cdf.legend(loc="upper left", fontsize=8)
    ax_hit.set_xticks(range(len(results)), [r.get("policy", v) for v, r in results.items()])
    ax_hit.set_ylabel("token hit rate (bar: mean; dots: runs)")
    rounds = report.get("rounds", 1)
    fig.suptitle(f"{report['benchmark']}: {rounds} run(s) per variant, "
                 f"{next(iter(results.values()), {}).get('requests', '?')} requests",
                 fontsize=10)
    fig_path = save_figure(fig, out)
    plt.close(fig)
    return fig_path


def main() -> None:
    from benchmark.eviction.bench_eviction import SGLANG_POLICIES
    from benchmark.harness import RESULTS, run_side_by_side, smoke_dir

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None)
    ap.add_argument("--scale", type=int, default=PARAMS["scale"])
    ap.add_argument("--kv-tokens", type=int, default=None,
                    help=f"KV pool tokens (default {ENGINE_KWARGS['max_total_tokens']}; "
                         f"--trace mooncake: {100 * MOONCAKE_POOL_FRACTION:.0f} %% of the replayed "
                         "requests' unique tokens)")
    ap.add_argument("--speedup", type=float, default=None,
                    help=f"arrival-time compression (default {PARAMS['speedup']}; --trace "
                         f"mooncake: {MOONCAKE_SPEEDUP:g})")
    ap.add_argument("--seed", type=int, default=PARAMS["seed"], help="trace generator seed")
    ap.add_argument("--smoke", action="store_true", help="CPU, SmolLM2, tiny trace")
    ap.add_argument("--no-cuda-graph", action="store_true",
                    help="both variants without decode CUDA graphs (starts ~1 min sooner)")
    ap.add_argument("--baselines", default="lru",
                    help="comma-separated SGLang policies run as vanilla variants")
    ap.add_argument("--pic-first", action="store_true",
                    help="run sglang-pic before vanilla (to check the order does not decide)")
    ap.add_argument("--trace", choices=("mix", "mooncake"), default="mix",
                    help="generated mixed traffic, or the head of the Mooncake conversation trace")
    ap.add_argument("--trace-file", default=str(MOONCAKE_TRACE),
                    help="the Mooncake JSONL (--trace mooncake)")
    ap.add_argument("--sample-conversations", type=int, default=MOONCAKE_SAMPLE, metavar="K",
                    help="--trace mooncake: replay one conversation in K over the whole trace "
                         f"(default {MOONCAKE_SAMPLE})")
    ap.add_argument("--requests", type=int, default=None,
                    help="--trace mooncake: replay the trace's first N requests instead")
    ap.add_argument("--resume-from", default=None, metavar="REPORT",
                    help="an earlier call's report of this run (same settings; e.g. "
                         "benchmark/results/eviction_e2e_mooncake_h200.json): this call's rounds "
                         "continue its alternation and pool with its runs")
    ap.add_argument("--plot", default=None, metavar="REPORT",
                    help="only draw the figure of an earlier report (next to it, .png)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per variant, alternating which goes first (hit rate and TTFT "
                         "are reported per run and as their mean)")
    args = ap.parse_args()
    if args.plot:
        report_path = Path(args.plot)
        if not report_path.is_file():
            ap.error(f"--plot {args.plot}: no such file")
        plot_e2e(json.loads(report_path.read_text()), report_path.with_suffix(".png"))
        return
    if (args.requests is not None and args.requests < 1) or args.rounds < 1 \
            or args.sample_conversations < 1:
        ap.error("--requests, --sample-conversations and --rounds must be at least 1")
    if args.trace == "mooncake" and not Path(args.trace_file).is_file():
        ap.error(f"--trace-file {args.trace_file}: no such file")
    mooncake = args.trace == "mooncake"
    if args.speedup is None:
        args.speedup = MOONCAKE_SPEEDUP if mooncake else PARAMS["speedup"]
    if mooncake:
        import tempfile

        from sglang_pic.eviction.replay import traces

        sample = None if args.requests else args.sample_conversations
        lines = mooncake_slice(args.trace_file, sample=sample, requests=args.requests,
                               max_prompt_tokens=PARAMS["max_prompt_tokens"])
        # the variants' processes read the slice from here (the run's own copy)
        slice_file = Path(tempfile.mkdtemp()) / "mooncake_slice.jsonl"
        slice_file.write_text("".join(lines))
        sliced = traces.load_mooncake(slice_file)
        unique = traces.unique_tokens(sliced)
        if not sliced:
            ap.error(f"--trace-file {args.trace_file}: no request to replay")
        if args.kv_tokens is None:
            args.kv_tokens = max(int(MOONCAKE_POOL_FRACTION * unique),
                                 PARAMS["max_prompt_tokens"] + 2 * PARAMS["output_tokens"])
        print(f"mooncake slice: {len(sliced)} requests, "
              f"{sum(len(r.prompt) for r in sliced)} prompt tokens, {unique} unique; "
              f"KV pool {args.kv_tokens} tokens; {sliced[-1].t / args.speedup:.0f} s of arrivals")
    if args.kv_tokens is None:
        args.kv_tokens = ENGINE_KWARGS["max_total_tokens"]
    kwargs = {**ENGINE_KWARGS, "max_total_tokens": args.kv_tokens}
    if args.no_cuda_graph:
        kwargs["disable_cuda_graph"] = True
    params = {**PARAMS, "scale": args.scale, "speedup": args.speedup, "seed": args.seed,
              "trace": args.trace}
    name = "eviction_e2e_h200" if args.seed == PARAMS["seed"] else f"eviction_e2e_h200_seed{args.seed}"
    if args.trace == "mooncake":
        # the trace's bytes name it (a later call's --resume-from may find it elsewhere); the
        # variants' processes read it from where it is now
        params.update(trace_sha256=hashlib.sha256(Path(args.trace_file).read_bytes()).hexdigest(),
                      requests=len(sliced), first_requests=args.requests,
                      sample_conversations=sample,
                      unique_tokens=unique)
        os.environ["SGLANG_PIC_BENCH_TRACE_FILE"] = str(slice_file)
        name = "eviction_e2e_mooncake_h200"
    if args.pic_first:
        name += "_pic_first"
    if args.scale != PARAMS["scale"]:
        name += f"_scale{args.scale}"
    if args.smoke:
        from sglang_pic.cpu.support import enable_cpu_engine
        from sglang_pic.launcher.default_model import ensure_default_model

        enable_cpu_engine()
        kwargs = {"model_path": str(ensure_default_model()), "device": "cpu",
                  "skip_tokenizer_init": True, "attention_backend": "torch_native",
                  "max_total_tokens": 6000, "disable_cuda_graph": True}
        params = {**params, "scale": 4, "speedup": 200.0, "output_tokens": 2, "vocab": 49000,
                  "max_prompt_tokens": 2500}
        name = "eviction_e2e_cpu_smoke"
        args.out = args.out or smoke_dir()
    baselines = args.baselines.split(",")
    unknown = [p for p in baselines if p not in SGLANG_POLICIES]
    if unknown:
        ap.error(f"--baselines {','.join(unknown)}: not one of SGLang's policies "
                 f"{SGLANG_POLICIES}")
    vanilla = {"vanilla" if i == 0 else f"vanilla-{p}": p for i, p in enumerate(baselines)}
    if baselines != ["lru"] and args.trace != "mooncake":  # the Mooncake rows' file is one name
        name += "_vs_" + "_".join(baselines)
    variant_kwargs = {v: {"radix_eviction_policy": p} for v, p in vanilla.items()}
    variant_kwargs["sglang-pic"] = {"radix_eviction_policy": "sae"}
    variants = (*vanilla, "sglang-pic")
    if args.pic_first:
        variants = ("sglang-pic", *vanilla)
    os.environ.setdefault("SGLANG_PIC_SAE_SAMPLE", "1024")
    report = run_side_by_side(name, "eviction.bench_e2e", "workload", kwargs, params,
                              higher_is_better={"token_hit_rate", "cached_tokens"},
                              out_dir=args.out, variant_kwargs=variant_kwargs, timeout_s=1800,
                              variants=variants, rounds=args.rounds,
                              resume_from=args.resume_from)
    plot_e2e(report, Path(args.out or RESULTS) / f"{name}.png")
    print(f"\n{'variant':<16}{'policy':<8}{'hit rate':>10}{'TTFT p50 ms':>13}{'p99 ms':>10}"
          f"{'mean ms':>10}")
    for v, r in report["results"].items():
        if "token_hit_rate" in r:
            mean = r.get("ttft_mean_ms", float("nan"))
            print(f"{v:<16}{r['policy']:<8}{r['token_hit_rate']:>10.3f}{r['ttft_p50_ms']:>13.0f}"
                  f"{r['ttft_p99_ms']:>10.0f}{mean:>10.0f}")


if __name__ == "__main__":
    main()
