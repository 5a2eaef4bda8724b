"""Long contexts beyond the GPU KV pool: ``--sparse-offload`` vs vanilla SGLang, same run.

``B`` requests of ``N`` random tokens arrive together and each generates ``M`` tokens; the KV
pool holds ``--pool-tokens`` tokens, enough for one of them (prompt + generation) but not two.
Vanilla SGLang (FlashInfer attention) must then run them one after another: a request keeps its
whole context in the pool until it finishes. With ParisKV and ``--sparse-offload`` a request's
retrieval region moves to pinned host memory at its first decode step and its pool slots are
freed, so the next request prefills while the first decodes, and all of them decode together
from a pool that holds ~``sink + local + update`` tokens of each.

sglang-pic runs ``pariskv_flashinfer`` (FlashInfer for prefill and the dense parts). Both
variants run with ``--disable-radix-cache`` (offload needs it; vanilla gets the same),
Llama-3-8B shape, dummy weights, bf16, decode CUDA graphs on. Reported per variant: makespan,
output tokens/s, TTFT (per request, p50 and p99) and finish time per request, and the most
requests decoding at once (from each request's first and last token).

    python3 -m benchmark.sparse.bench_offload [--requests 4] [--tokens 65536] [--new 512]
                                              [--pool-tokens 73728] [--samples 1]
                                              [--shape llama3-8b|qwen2.5-7b] [--out DIR]

``--samples N`` runs N batches one after another in each variant's engine, each of fresh
prompts (the radix cache is off: nothing carries over), and reports every batch's figures.
``--shape qwen2.5-7b`` takes Qwen2.5-7B's attention and MLP sizes (28 layers, 4 KV heads: 56
KiB of KV a token, half of Llama-3-8B's), so that 8 x 128K tokens fit the H200 host's memory;
the issue's over-memory case is ``--shape qwen2.5-7b --requests 8 --tokens 130048 --new 512
--pool-tokens 262144 --samples 3`` (a pool of 256K tokens stands in for a smaller GPU: vanilla
holds two of the requests at once).

Prints a table; writes ``sparse_offload.json`` (machine, versions, config, ratios) and a plot
of each request's prefill-wait / decode span into ``--out`` (default ``benchmark/results``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from benchmark import description, harness
from benchmark.sparse.bench_e2e_decode import start_engine
from benchmark.sparse.bench_long_prompt import QWEN25_7B_SHAPE


def workload(engine_kwargs: dict, params: dict) -> dict:
    """Runs in the variant's process: one Engine, the requests all sent at once."""
    import numpy as np

    engine, out = start_engine(engine_kwargs, params["sparse_env"])
    rng = np.random.default_rng(params["seed"])
    sp = {"max_new_tokens": params["new"], "ignore_eos": True, "temperature": 0}

    async def one(prompt: list[int], start: float) -> dict:
        first, finish, last = await harness.stream_generate(engine, prompt, sp, start)
        return {"ttft_s": first, "finish_s": finish, "output_ids": last.get("output_ids", [])}

    async def run_all(prompts):
        start = time.perf_counter()
        return await asyncio.gather(*(one(p, start) for p in prompts))

    batches = []
    try:
        # warm-up (kernel compilation, the first sparse activation) outside the timed run
        warm = [int(t) for t in rng.integers(1000, params["vocab"], size=params["warm_tokens"])]
        engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
        for i in range(params["samples"]):
            prompts = [[int(t) for t in rng.integers(1000, params["vocab"],
                                                     size=params["tokens"])]
                       for _ in range(params["requests"])]
            t = time.perf_counter()
            reqs = engine.loop.run_until_complete(run_all(prompts))
            batches.append((time.perf_counter() - t, reqs))
            print(f"[bench] batch {i + 1}/{params['samples']}: {batches[-1][0]:.1f} s", flush=True)
    finally:
        engine.shutdown()
    def figures(makespan: float, reqs: list[dict]) -> dict[str, float]:
        spans = [(r["ttft_s"], r["finish_s"]) for r in reqs]
        ttfts = [a for a, _ in spans]
        return {"makespan_s": makespan,
                "output_tokens_per_s": params["requests"] * params["new"] / makespan,
                "max_decoding_at_once": max(sum(a <= t < b for a, b in spans) for t, _ in spans),
                "ttft_p50_s": float(np.percentile(ttfts, 50)),
                "ttft_p99_s": float(np.percentile(ttfts, 99))}

    per_batch = [figures(makespan, reqs) for makespan, reqs in batches]
    for key in per_batch[0]:
        out[f"{key}_all"] = [f[key] for f in per_batch]
        out[key] = float(np.median(out[f"{key}_all"]))
    # the last batch's requests, for the plot and the output check
    reqs = batches[-1][1]
    out["ttft_s"] = [round(r["ttft_s"], 3) for r in reqs]
    out["finish_s"] = [round(r["finish_s"], 3) for r in reqs]
    out["output_ids"] = [r["output_ids"] for r in reqs]
    return out


def plot(report: dict, out_dir: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    labels = {"vanilla": "vanilla SGLang", "sglang-pic": "sglang-pic --sparse-offload"}
    ticks = []
    for i, variant in enumerate(("vanilla", "sglang-pic")):
        r = res.get(variant, {})
        for j, (a, b) in enumerate(zip(r.get("ttft_s", []), r.get("finish_s", []), strict=False)):
            y = i * (len(r["ttft_s"]) + 1) + j
            ax.barh(y, a, color="#cccccc")
            ax.barh(y, b - a, left=a, color="C0" if variant == "vanilla" else "C1")
            ticks.append((y, f"{labels[variant]} #{j}"))
    ax.set_yticks([y for y, _ in ticks], [t for _, t in ticks], fontsize=7)
    ax.set_xlabel("seconds since all requests arrived (grey: waiting + prefill, colour: decode)")
    p = report["params"]
    ax.set_title(f"{p['requests']} x {p['tokens']} tokens, {p['new']} new each, KV pool "
                 f"{p['pool_tokens']} tokens ({p.get('shape', 'llama3-8b')} shape, last batch)",
                 fontsize=9)
    fig.tight_layout()
    return harness.save_figure(fig, out_dir / f"{report['benchmark']}.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--pool-tokens", type=int, default=73728)
    ap.add_argument("--samples", type=int, default=1,
                    help="batches per variant, one after another in its engine")
    ap.add_argument("--shape", choices=("llama3-8b", "qwen2.5-7b"), default="llama3-8b",
                    help="model shape (dummy weights); qwen2.5-7b: half the KV per token")
    ap.add_argument("--variants", default="vanilla,sglang-pic")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU engine, SmolLM2, 2 x 1500 tokens (checks the script, not speed)")
    args = ap.parse_args()
    if args.samples < 1:
        ap.error("--samples must be at least 1")
    name, backend = "sparse_offload", "pariskv_flashinfer"
    context = args.tokens + args.new + 64
    engine_kwargs = {**harness.LLAMA3_8B_DUMMY, "context_length": context,
                     "max_total_tokens": args.pool_tokens, "disable_radix_cache": True,
                     "mem_fraction_static": 0.6,
                     "cuda_graph_max_bs_decode": max(8, args.requests),
                     "max_running_requests": max(8, args.requests),
                     "chunked_prefill_size": 16384}
    if args.shape == "qwen2.5-7b":
        engine_kwargs["json_model_override_args"] = json.dumps(QWEN25_7B_SHAPE)
        name += "_qwen25_7b"
    sparse_env = {"SGLANG_PIC_SPARSE_MAX_REQUESTS": args.requests,
                  "SGLANG_PIC_SPARSE_MAX_CONTEXT": context, "SGLANG_PIC_SPARSE_OFFLOAD": 1}
    params = {"requests": args.requests, "tokens": args.tokens, "new": args.new,
              "pool_tokens": args.pool_tokens, "samples": args.samples, "shape": args.shape,
              "seed": 0, "vocab": 128000,
              "warm_tokens": 40000, "sparse_env": sparse_env}
    if args.smoke:
        name, backend = "sparse_offload_cpu_smoke", "pariskv_torch_native"
        args.out = args.out or harness.smoke_dir()
        engine_kwargs = harness.cpu_smoke_engine(max_total_tokens=1800, context_length=2048,
                                                 chunked_prefill_size=256)
        params.update(requests=2, tokens=1500, new=20, pool_tokens=1800, vocab=49000,
                      warm_tokens=800, sparse_env={**sparse_env, "SGLANG_PIC_SPARSE_MAX_CONTEXT":
                                                   2048, "SGLANG_PIC_SPARSE_THRESHOLD": 700,
                                                   "SGLANG_PIC_SPARSE_LOCAL": 128,
                                                   "SGLANG_PIC_SPARSE_UPDATE": 16})
    report = harness.run_side_by_side(
        name, "sparse.bench_offload", "workload", engine_kwargs, params,
        higher_is_better={"output_tokens_per_s", "max_decoding_at_once"},
        variants=tuple(args.variants.split(",")), timeout_s=590, out_dir=args.out,
        variant_kwargs={"sglang-pic": {"attention_backend": backend}})
    res = report["results"]
    ids = [res.get(v, {}).get("output_ids") for v in ("vanilla", "sglang-pic")]
    if all(ids):
        same = [sum(a == b for a, b in zip(x, y, strict=False)) / max(len(x), 1)
                for x, y in zip(*ids, strict=False)]
        print(f"[bench] output ids equal to vanilla, per request: {same}")
    path = plot(report, Path(args.out) if args.out else harness.RESULTS)
    if path:
        print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
