"""RAG with span caching on the H200: vanilla SGLang (FlashInfer; triton as a second column) vs
sglang-pic (ISPS; barrier on request), one run.

Model: Llama-3-8B shape, dummy weights, token ids only, bf16; vanilla on FlashInfer and on triton,
sglang-pic on ``pic_flashinfer`` (what ``--enable-span-cache`` selects on a GPU) with
``--radix-cache-backend pic_span``. Every variant gets the *same* token sequences; the
sglang-pic variants mark each retrieved document as an independent span (``-1`` before it) and the
question as dependent (``-2``); vanilla gets the plain concatenation and its own radix cache.

Two measurements:

1. **TTFT of an 8K document after a different prefix** (the case position-independent caching
   exists for). The document is first served after system prompt A; then, after system prompt B:
   ``cached_prefix`` (B was seen before with another document: every segment is cached) and
   ``new_prefix`` (B never seen: sglang-pic prefills B as a span sub-request first). Vanilla misses
   the document in both. Also ``cold`` (nothing cached), and ``same_prefix`` (A and the document
   again, a new question): a one-pass request for vanilla too, so vanilla's time there is the
   floor of ``cached_prefix`` on this setup (request path + one small extend after 8K cached).
2. **RAG batch**: a pool of documents with Zipf popularity, ``k`` distinct documents per request
   behind one system prompt, a question, a short answer (``ignore_eos``); all requests submitted at
   once through ``async_generate(stream=True)``: requests/s and TTFT p50/p99. Each request lists
   its documents in one canonical (sorted) order, as a careful vanilla user would to share
   prefixes. ``rag_repeats`` batches, each over a fresh document pool (nothing carried over),
   give the samples; medians are reported. An untimed burst of ``rag_warmup_requests`` over its
   own pool goes first, for every variant.

    python3 -m benchmark.bench_spans [--out DIR] [--variants vanilla,vanilla-triton,sglang-pic]
    .venv/bin/python -m benchmark.bench_spans --smoke   # CPU: SmolLM2, tiny sizes (~3 min; checks
                                                        # the script, writes to a temp folder)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

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

SCHEDULE = {"sglang-pic": "isps", "sglang-pic-barrier": "barrier"}
# variants of the span server beyond its schedule: the switches they turn on
SPAN_SWITCHES = {
    "sglang-pic-span-graphs": {"SGLANG_PIC_SPAN_GRAPHS": "1", "SGLANG_PIC_SPAN_COPY": "off"},
    "sglang-pic-shared": {"SGLANG_PIC_SPAN_COPY": "off"},  # moved spans read from shared pages
}


def _prompt(system: list[int], docs: list[list[int]], question: list[int], spans: bool) -> list[int]:
    ids = list(system)
    for d in docs:
        ids += ([SSEP] if spans else []) + d
    return ids + ([PDEP] if spans else []) + question


async def _stream_one(engine, ids: list[int], sp: dict) -> tuple[float, float, int]:
    first, total, last = await stream_generate(engine, ids, sp)
    return first, total, int(last.get("meta_info", {}).get("cached_tokens", 0))


def workload(engine_kwargs: dict, params: dict) -> dict:
    import numpy as np

    variant = current_variant()
    spans = variant.startswith("sglang-pic")
    if spans:
        os.environ["SGLANG_PIC_SPAN_SCHEDULE"] = SCHEDULE.get(variant, "isps")
        os.environ.update(SPAN_SWITCHES.get(variant, {}))  # read by the scheduler it starts
    import sglang as sgl

    kwargs = engine_arguments(
        engine_kwargs, params.get("pic_backend", "pic_flashinfer") if spans else None)
    t0 = time.perf_counter()
    engine = sgl.Engine(**kwargs)
    start_s = time.perf_counter() - t0
    rng = np.random.default_rng(params["seed"])
    vocab = params["vocab"]

    def toks(n: int) -> list[int]:
        return [int(t) for t in rng.integers(1000, vocab, size=n)]

    def ttft(ids: list[int]) -> tuple[float, int]:
        t = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
        return time.perf_counter() - t, int(out["meta_info"].get("cached_tokens", 0))

    sys_len, doc_len, q_len = params["system_tokens"], params["doc_tokens"], params["question_tokens"]
    result: dict = {"engine_start_s": start_s, "variant": variant,
                    "attention_backend": kwargs.get("attention_backend")}
    try:
        for _ in range(2):  # untimed warm-up: Triton JIT for prefill, prefix-extend and decode
            ttft(_prompt(toks(sys_len), [toks(doc_len)], toks(q_len), spans))
        cases: dict[str, list[float]] = {"cold": [], "same_prefix": [], "cached_prefix": [],
                                         "new_prefix": []}
        cached: dict[str, list[int]] = {k: [] for k in cases}
        for _ in range(params["repeats"]):
            sys_a, sys_b, sys_c = toks(sys_len), toks(sys_len), toks(sys_len)
            doc = toks(doc_len)
            dt, hit = ttft(_prompt(sys_a, [doc], toks(q_len), spans))
            cases["cold"].append(dt)
            cached["cold"].append(hit)
            # the same system prompt and document, a new question: a one-pass request for
            # vanilla too (its radix cache holds both), the floor of cached_prefix on this setup
            dt, hit = ttft(_prompt(sys_a, [doc], toks(q_len), spans))
            cases["same_prefix"].append(dt)
            cached["same_prefix"].append(hit)
            ttft(_prompt(sys_b, [toks(params["other_doc_tokens"])], toks(q_len), spans))  # B seen
            for case, system in (("cached_prefix", sys_b), ("new_prefix", sys_c)):
                dt, hit = ttft(_prompt(system, [doc], toks(q_len), spans))
                cases[case].append(dt)
                cached[case].append(hit)
        for case, times in cases.items():
            result[f"ttft_{case}_ms"] = 1000 * statistics.median(times)
            result[f"ttft_{case}_ms_all"] = [round(1000 * t, 2) for t in times]
            result[f"cached_tokens_{case}"] = statistics.median(cached[case])

        # RAG batches: Zipf popularity over a fresh pool each, k distinct documents per request
        n_docs, k = params["rag_docs"], params["rag_docs_per_request"]
        weights = 1.0 / np.arange(1, n_docs + 1) ** params["zipf_s"]
        weights /= weights.sum()
        sp = {"max_new_tokens": params["rag_output_tokens"], "temperature": 0, "ignore_eos": True}
        samples: dict[str, list[float]] = {}
        # one untimed burst first (its own pool): the first burst of a fresh engine paid for
        # kernel compiles and allocator growth (H200: 11.7 req/s, then 16.8 and 19.0)
        rounds = [params.get("rag_warmup_requests", 0)] + [params["rag_requests"]] * params[
            "rag_repeats"]
        for round_index, n_requests in enumerate(rounds):
            if n_requests == 0:
                continue
            pool = [toks(params["rag_doc_tokens"]) for _ in range(n_docs)]
            system = toks(sys_len)
            prompts = []
            for _ in range(n_requests):
                pick = sorted(rng.choice(n_docs, size=k, replace=False, p=weights))
                prompts.append(_prompt(system, [pool[int(d)] for d in pick], toks(q_len), spans))

            async def batch(prompts=prompts):
                return await asyncio.gather(*(_stream_one(engine, p, sp) for p in prompts))

            t = time.perf_counter()
            outs = engine.loop.run_until_complete(batch())
            rag_s = time.perf_counter() - t
            if round_index == 0:
                result["rag_warmup_s"] = rag_s
                continue
            ttfts = [o[0] for o in outs]
            for key, value in (
                ("rag_batch_s", rag_s),
                ("rag_requests_per_s", len(prompts) / rag_s),
                ("rag_ttft_p50_ms", 1000 * percentile(ttfts, 50)),
                ("rag_ttft_p99_ms", 1000 * percentile(ttfts, 99)),
                ("rag_latency_p50_ms", 1000 * percentile([o[1] for o in outs], 50)),
                ("rag_cached_tokens_total", sum(o[2] for o in outs)),
            ):
                samples.setdefault(key, []).append(value)
        for key, values in samples.items():
            result[key] = statistics.median(values)
            result[f"{key}_all"] = [round(v, 3) for v in values]
        result["rag_prompt_tokens_per_batch"] = params["rag_requests"] * (
            sys_len + k * params["rag_doc_tokens"] + q_len)
    finally:
        engine.shutdown()
    return result


ENGINE_KWARGS = {
    **LLAMA3_8B_DUMMY,
    "context_length": 16384,
    "mem_fraction_static": 0.80,
    "cuda_graph_max_bs_decode": 128,
}

PARAMS = {
    "seed": 0,
    "vocab": 120000,
    "repeats": 3,
    "system_tokens": 256,
    "doc_tokens": 8192,
    "other_doc_tokens": 512,
    "question_tokens": 64,
    "rag_docs": 32,
    "rag_doc_tokens": 2048,
    "rag_docs_per_request": 4,
    "rag_requests": 128,
    "rag_repeats": 3,
    "rag_warmup_requests": 32,
    "rag_output_tokens": 32,
    "zipf_s": 1.0,
}

SMOKE = {  # CPU check of the script: SmolLM2 on the CPU engine, tiny sizes
    "engine_kwargs": {"device": "cpu", "skip_tokenizer_init": True, "dtype": "bfloat16",
                      "attention_backend": "torch_native", "max_total_tokens": 8192,
                      "disable_cuda_graph": True, "page_size": 1},
    "params": {"vocab": 49000, "repeats": 1, "system_tokens": 16, "doc_tokens": 256,
               "other_doc_tokens": 32, "question_tokens": 8, "rag_docs": 6, "rag_doc_tokens": 64,
               "rag_docs_per_request": 2, "rag_requests": 6, "rag_output_tokens": 4,
               "rag_repeats": 1, "rag_warmup_requests": 2,
               "pic_backend": "pic_torch_native"},
}


def main() -> None:
    from benchmark.harness import run_side_by_side, smoke_dir

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None, help="results folder (default benchmark/results)")
    ap.add_argument("--variants", default=None,
                    help="any of vanilla (FlashInfer), vanilla-triton, sglang-pic (ISPS), "
                         "sglang-pic-barrier, sglang-pic-shared (--span-copy-on-reuse off: "
                         "moved spans read from the shared pages by segmented attention), "
                         "sglang-pic-span-graphs (the same with --position-free-span-graphs) "
                         "(default: vanilla,vanilla-triton,sglang-pic; "
                         "vanilla,sglang-pic with --smoke)")
    ap.add_argument("--repeats", type=int, default=PARAMS["repeats"])
    ap.add_argument("--requests", type=int, default=PARAMS["rag_requests"])
    ap.add_argument("--rag-repeats", type=int, default=PARAMS["rag_repeats"])
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant this many times, alternating which goes first")
    ap.add_argument("--prefill-graphs", action="store_true",
                    help="every variant with SGLang's prefill CUDA graphs (its default; the "
                         "benchmarks turn them off to start faster): small extends, as a "
                         "cached document's question, run as one graph. Writes "
                         "spans_rag_h200_prefill_graphs.json")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run with SmolLM2")
    args = ap.parse_args()
    engine_kwargs = ENGINE_KWARGS
    name = "spans_rag_h200"
    if args.prefill_graphs:
        engine_kwargs = {**ENGINE_KWARGS, "disable_prefill_cuda_graph": False}
        name += "_prefill_graphs"
    params = dict(PARAMS, repeats=args.repeats, rag_requests=args.requests,
                  rag_repeats=args.rag_repeats)
    if args.smoke:
        from sglang_pic.cpu.support import enable_cpu_engine
        from sglang_pic.launcher.default_model import ensure_default_model

        enable_cpu_engine()
        engine_kwargs = {"model_path": str(ensure_default_model()), **SMOKE["engine_kwargs"]}
        params = {**PARAMS, **SMOKE["params"]}
        name = "spans_rag_cpu_smoke"
        args.out = args.out or smoke_dir()
        args.variants = args.variants or "vanilla,sglang-pic"
    args.variants = args.variants or "vanilla,vanilla-triton,sglang-pic"
    report = run_side_by_side(name, "bench_spans", "workload", engine_kwargs, params,
                              higher_is_better={"rag_requests_per_s"}, out_dir=args.out,
                              variants=tuple(args.variants.split(",")), timeout_s=1800,
                              rounds=args.rounds)
    res = report["results"]
    van = res.get("vanilla", {})
    print(f"\n{'variant':<22}{'req/s':>9}{'x vanilla':>11}{'TTFT p50':>10}{'p99':>9}"
          f"{'cached-prefix TTFT':>20}{'x lower':>9}")
    for v, r in res.items():
        if "rag_requests_per_s" not in r:
            print(f"{v:<22} error: {r.get('error')}")
            continue
        thr = r["rag_requests_per_s"] / van["rag_requests_per_s"] if van.get("rag_requests_per_s") else float("nan")
        low = van.get("ttft_cached_prefix_ms", float("nan")) / r["ttft_cached_prefix_ms"]
        print(f"{v:<22}{r['rag_requests_per_s']:>9.2f}{thr:>11.2f}{r['rag_ttft_p50_ms']:>10.0f}"
              f"{r['rag_ttft_p99_ms']:>9.0f}{r['ttft_cached_prefix_ms']:>17.1f} ms{low:>9.1f}")
    if "ttft_same_prefix_ms" in van:
        print(f"vanilla's one-pass floor (same system prompt + document, new question): "
              f"{van['ttft_same_prefix_ms']:.1f} ms; cold {van.get('ttft_cold_ms', 0):.1f} ms")


if __name__ == "__main__":
    main()
