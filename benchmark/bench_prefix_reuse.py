"""Prefix reuse on the H200: TTFT of an 8K-token document and a RAG batch, vanilla vs sglang-pic.

Workload (the baseline numbers in ``shared/notes/PLATFORM.md``), Llama-3-8B-shaped model with
dummy weights, token ids only (no tokenizer), triton attention, bf16:

- TTFT of system(256) + document(8192) + question(64), one output token, in three cases:
  ``cold`` (nothing cached), ``reused`` (same system + document, new question: a prefix hit),
  ``other_system`` (same document after a different system prompt: a prefix cache misses it;
  position-independent span caching exists for this case). Each case is repeated with fresh
  documents; medians are reported, cached-token counts recorded.
- RAG batch: 64 requests, each a system prompt + 4 of 32 shared 2K-token documents + a 64-token
  question, 32 output tokens (ignore_eos), submitted together; requests/s and wall time.

Run on the device (after ``source .devkit/c/install.sh``):

    python3 -m benchmark.bench_prefix_reuse [--out DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmark import description
from benchmark.harness import LLAMA3_8B_DUMMY

MODEL = LLAMA3_8B_DUMMY["model_path"]


def _tokens(rng, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1000, 120000, size=n)]


def _ttft(engine, ids: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    return time.perf_counter() - t0, int(out["meta_info"].get("cached_tokens", 0))


def workload(engine_kwargs: dict, params: dict) -> dict:
    import numpy as np
    import sglang as sgl

    repo = Path(__file__).resolve().parent.parent
    kwargs = dict(engine_kwargs)
    kwargs["model_path"] = str(repo / kwargs["model_path"])
    t0 = time.perf_counter()
    engine = sgl.Engine(**kwargs)
    start_s = time.perf_counter() - t0
    rng = np.random.default_rng(params.get("seed", 0))
    sys_len, doc_len, q_len = params["system_tokens"], params["doc_tokens"], params["question_tokens"]
    try:
        # Warm-up, untimed: compile the prefill and prefix-extend kernels once, so the first
        # measured sample of each case does not pay Triton JIT time.
        warm_prefix = _tokens(rng, sys_len + doc_len)
        for _ in range(2):
            _ttft(engine, warm_prefix + _tokens(rng, q_len))
        cases: dict[str, list[float]] = {"cold": [], "reused": [], "other_system": []}
        cached: dict[str, list[int]] = {k: [] for k in cases}
        for _ in range(params["repeats"]):
            sys_a, sys_b = _tokens(rng, sys_len), _tokens(rng, sys_len)
            doc = _tokens(rng, doc_len)
            for case, ids in (
                ("cold", sys_a + doc + _tokens(rng, q_len)),
                ("reused", sys_a + doc + _tokens(rng, q_len)),
                ("other_system", sys_b + doc + _tokens(rng, q_len)),
            ):
                dt, hit = _ttft(engine, ids)
                cases[case].append(dt)
                cached[case].append(hit)

        # RAG batch
        n_docs, n_req = params["rag_docs"], params["rag_requests"]
        docs = [_tokens(rng, params["rag_doc_tokens"]) for _ in range(n_docs)]
        system = _tokens(rng, sys_len)
        prompts = []
        for _ in range(n_req):
            pick = rng.choice(n_docs, size=params["rag_docs_per_request"], replace=False)
            ids = list(system)
            for d in pick:
                ids += docs[int(d)]
            prompts.append(ids + _tokens(rng, q_len))
        sp = {"max_new_tokens": params["rag_output_tokens"], "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        rag_s = time.perf_counter() - t0
        rag_cached = sum(int(o["meta_info"].get("cached_tokens", 0)) for o in outs)
    finally:
        engine.shutdown()

    result: dict = {"engine_start_s": start_s}
    for case, times in cases.items():
        result[f"ttft_{case}_ms"] = 1000 * statistics.median(times)
        result[f"ttft_{case}_ms_all"] = [1000 * t for t in times]
        result[f"cached_tokens_{case}"] = statistics.median(cached[case])
    result["rag_batch_s"] = rag_s
    result["rag_requests_per_s"] = n_req / rag_s
    result["rag_cached_tokens_total"] = rag_cached
    return result


ENGINE_KWARGS = {
    **LLAMA3_8B_DUMMY,
    "context_length": 16384,
    "mem_fraction_static": 0.80,
    "cuda_graph_max_bs_decode": 64,
}

PARAMS = {
    "seed": 0,
    "repeats": 3,
    "system_tokens": 256,
    "doc_tokens": 8192,
    "question_tokens": 64,
    "rag_docs": 32,
    "rag_doc_tokens": 2048,
    "rag_docs_per_request": 4,
    "rag_requests": 64,
    "rag_output_tokens": 32,
}


def main() -> None:
    from benchmark.harness import run_side_by_side

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None, help="results folder (default benchmark/results)")
    ap.add_argument("--repeats", type=int, default=PARAMS["repeats"])
    ap.add_argument("--order", default="vanilla,sglang-pic",
                    help="variant order (the first pays cold Triton/CUDA-graph caches at start)")
    args = ap.parse_args()
    params = dict(PARAMS, repeats=args.repeats)
    run_side_by_side(
        "prefix_reuse_h200",
        "bench_prefix_reuse",
        "workload",
        ENGINE_KWARGS,
        params,
        higher_is_better={"rag_requests_per_s"},
        out_dir=args.out,
        variants=tuple(args.order.split(",")),
    )


if __name__ == "__main__":

    main()
