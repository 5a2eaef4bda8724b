"""End to end on the H200: `--radix-eviction-policy sae` (sglang-pic) vs `lru` (vanilla SGLang).

The trace is ``traces.generate("mix")`` (chat sessions, agent loops, templated single-turn
requests; content-faithful token ids) or, with ``--trace mooncake``, the first ``--requests``
requests of the Mooncake conversation trace (each 512-token block hash becomes 512 fixed token
ids, ``traces.load_mooncake``), replayed open-loop through ``Engine.async_generate`` at its
arrival times compressed by ``--speedup``, with a KV budget (``max_total_tokens``) well below the
trace's unique tokens so the prefix cache has to evict. The open-loop schedule moves the hit rate
between runs, so ``--rounds N`` runs every variant N times, alternating which goes first; the
per-run values are kept (``<metric>_all``) and the headline rows take their mean. Each request generates a few tokens
(``ignore_eos``); the next turn's prompt carries the trace's recorded answer, as a client resending
history would. Reported per variant: token hit rate (cached / prompt tokens), TTFT p50/p99,
makespan.

    python3 benchmark/eviction/bench_e2e.py [--scale 60] [--kv-tokens 32768] [--speedup 8] [--seed 0]
        [--no-cuda-graph] [--baselines lru,fifo]
    python3 benchmark/eviction/bench_e2e.py --smoke     # CPU, SmolLM2, tiny trace

``--baselines``: vanilla SGLang with each of these of its policies, in the same run (``vanilla``
is the first, ``lru`` by default; the others run as ``vanilla-<policy>``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from harness import LLAMA3_8B_DUMMY  # noqa: E402


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def workload(engine_kwargs: dict, params: dict) -> dict:
    import sglang as sgl
    import traces

    repo = HERE.parent.parent
    kwargs = dict(engine_kwargs)
    if not Path(kwargs["model_path"]).is_absolute():
        kwargs["model_path"] = str(repo / kwargs["model_path"])
    if params.get("trace") == "mooncake":
        trace = _mooncake_head(traces, os.environ["SGLANG_PIC_BENCH_TRACE_FILE"],
                               params["requests"])
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
        # warm-up outside the trace's token range (JIT compile); then flush, so both start empty
        engine.generate(input_ids=[7] * 512, sampling_params={"max_new_tokens": 2})
        engine.flush_cache()
        t = time.perf_counter()
        outs = engine.loop.run_until_complete(replay())
        makespan = time.perf_counter() - t
    finally:
        engine.shutdown()
    ttft = [o[0] for o in outs]
    cached, prompt = sum(o[1] for o in outs), sum(o[2] for o in outs)
    profile = _policy_profile(stats_file) if stats_file else {}
    per_run = {"token_hit_rate": cached / prompt, "ttft_p50_ms": 1000 * _percentile(ttft, 50),
               "ttft_p99_ms": 1000 * _percentile(ttft, 99)}
    return {**profile, **{f"{k}_all": [v] for k, v in per_run.items()},
        "engine_start_s": start_s,
        "requests": len(outs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt,
        "ttft_p50_ms": 1000 * _percentile(ttft, 50),
        "ttft_p99_ms": 1000 * _percentile(ttft, 99),
        "ttft_mean_ms": 1000 * sum(ttft) / len(ttft),
        "makespan_s": makespan,
        "policy": kwargs.get("radix_eviction_policy", "lru"),
    }


def _mooncake_head(traces, path: str, n: int) -> list:
    """The first ``n`` records of a Mooncake trace file (by line; the file is in time order),
    loaded by ``traces.load_mooncake`` (which reports and skips malformed lines)."""
    import tempfile

    lines = []
    with open(path) as f:
        for line in f:
            if line.strip():
                lines.append(line)
            if len(lines) >= n:
                break
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as tmp:
        tmp.writelines(lines)
    try:
        return traces.load_mooncake(tmp.name)
    finally:
        os.unlink(tmp.name)


def _policy_profile(path: Path) -> dict:
    """The scheduler's own account (``SGLANG_PIC_SAE_STATS``, dumped after every evict pass) of
    the policy's time against its busy time: whole evict passes (SGLang's heap and frees plus
    our scoring) and the callbacks outside them (requests, inserts, splits, hits)."""
    import json

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
MOONCAKE_KV_TOKENS = 262144
MOONCAKE_TRACE = HERE.parent.parent.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def main() -> None:
    from bench_eviction import SGLANG_POLICIES
    from harness import run_side_by_side, smoke_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--scale", type=int, default=PARAMS["scale"])
    ap.add_argument("--kv-tokens", type=int, default=None,
                    help=f"KV pool tokens (default {ENGINE_KWARGS['max_total_tokens']}; "
                         f"--trace mooncake: {MOONCAKE_KV_TOKENS}, ~10 %% of the unique tokens of "
                         "its first 400 requests)")
    ap.add_argument("--speedup", type=float, default=None,
                    help=f"arrival-time compression (default {PARAMS['speedup']}; --trace "
                         "mooncake: 1, real time: its requests carry ~9K-token prompts)")
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
    ap.add_argument("--requests", type=int, default=400,
                    help="--trace mooncake: how many of its first requests to replay")
    ap.add_argument("--resume-from", default=None, metavar="REPORT",
                    help="an earlier call's report of this run (same settings; e.g. "
                         "benchmark/results/eviction_e2e_mooncake_h200.json): this call's rounds "
                         "continue its alternation and pool with its runs")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per variant, alternating which goes first (hit rate and TTFT "
                         "are reported per run and as their mean)")
    args = ap.parse_args()
    if args.requests < 1 or args.rounds < 1:
        ap.error("--requests and --rounds must be at least 1")
    if args.trace == "mooncake" and not Path(args.trace_file).is_file():
        ap.error(f"--trace-file {args.trace_file}: no such file")
    mooncake = args.trace == "mooncake"
    if args.kv_tokens is None:
        args.kv_tokens = MOONCAKE_KV_TOKENS if mooncake else ENGINE_KWARGS["max_total_tokens"]
    if args.speedup is None:
        args.speedup = 1.0 if mooncake else PARAMS["speedup"]
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
                      requests=args.requests)
        os.environ["SGLANG_PIC_BENCH_TRACE_FILE"] = str(Path(args.trace_file).resolve())
        name = "eviction_e2e_mooncake_h200"
    if args.pic_first:
        name += "_pic_first"
    if args.scale != PARAMS["scale"]:
        name += f"_scale{args.scale}"
    if args.smoke:
        sys.path.insert(0, str(HERE.parent.parent / "python"))
        from sglang_pic.cpu_support import enable_cpu_engine
        from sglang_pic.default_model import ensure_default_model

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
    print(f"\n{'variant':<16}{'policy':<8}{'hit rate':>10}{'TTFT p50 ms':>13}{'p99 ms':>10}")
    for v, r in report["results"].items():
        if "token_hit_rate" in r:
            print(f"{v:<16}{r['policy']:<8}{r['token_hit_rate']:>10.3f}{r['ttft_p50_ms']:>13.0f}"
                  f"{r['ttft_p99_ms']:>10.0f}")


if __name__ == "__main__":
    main()
