"""Non-span traffic on a span-cache server vs vanilla SGLang on FlashInfer, H200, one run.

A server started with ``--enable-span-cache`` (span radix cache ``pic_span``, position-free KV on
``pic_flashinfer``, what the flag selects on a GPU) serves requests that carry no spans; a
drop-in replacement must be as fast as the SGLang it replaces on them. The workload is
``bench_position_free.workload`` (Llama-3.1-8B shape, dummy weights): TTFT of fresh 1K / 8K / 32K
/ 128K prompts and TPOT at batch 1 / 32 / 256 x 1K / 8K / 32K context where the KV fits,
``repeats`` samples each (medians reported, every sample kept).

Variants: ``vanilla`` (FlashInfer, the baseline), ``sglang-pic-spans`` (the span-cache server),
``sglang-pic-spans-graphs`` (the same with ``--position-free-span-graphs``: a second decode
CUDA graph set, captured for span batches, which batches without spans never replay;
``sglang-pic-spans-graphs-r1`` captures it for one run per request),
``sglang-pic-spans-triton`` (the same on ``pic_triton``: our Triton kernels for every batch) and
``vanilla-triton`` (a second column).

    python3 -m benchmark.bench_nonspan_overhead [--out DIR] [--variants ...] [--rounds N] [--quick]
        [--prefill-lengths 1024,8192] [--decode-cases 32x8192,256x1024] [--name NAME]

A subset (``--prefill-lengths ""`` skips TTFT; ``--decode-cases`` picks batch x context cases)
with ``--name nonspan_overhead_rerun_h200`` re-measures some rows in one device call:
``headlines.py`` takes a row from that file when it holds both variants' samples for it.
"""

from __future__ import annotations

import argparse

from benchmark import description
from benchmark.bench_position_free import ENGINE_KWARGS, PARAMS

SPAN_SERVER = {"attention_backend": "pic_flashinfer", "radix_cache_backend": "pic_span"}
VARIANT_KWARGS = {
    "sglang-pic-spans": SPAN_SERVER,
    "sglang-pic-spans-graphs": SPAN_SERVER,
    "sglang-pic-spans-graphs-r1": SPAN_SERVER,
    "sglang-pic-spans-triton": {**SPAN_SERVER, "attention_backend": "pic_triton"},
}
VARIANT_SETTINGS = {
    "sglang-pic-spans-graphs": {"SGLANG_PIC_SPAN_GRAPHS": "1"},
    # the smallest second graph set: one run per request (--span-graph-runs 1)
    "sglang-pic-spans-graphs-r1": {"SGLANG_PIC_SPAN_GRAPHS": "1", "SGLANG_PIC_SPAN_GRAPH_RUNS": "1"},
}
# 128K prompts: every variant gets the longer context (the KV budget is unchanged)
NONSPAN_ENGINE_KWARGS = {**ENGINE_KWARGS, "context_length": 131072}  # the model's maximum
NONSPAN_PARAMS = {**PARAMS, "prefill_lengths": [1024, 8192, 32768, 131000]}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _cases(text: str) -> list[list[int]]:
    try:
        cases = [[int(v) for v in case.lower().split("x")] for case in text.split(",") if case]
    except ValueError:
        cases = []
    if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
        raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT,... (positive integers), "
                                         f"got {text!r}")
    return cases


def main() -> None:
    from benchmark.harness import run_side_by_side, smoke_dir

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None, help="results folder (default benchmark/results)")
    ap.add_argument("--variants", default="vanilla,sglang-pic-spans",
                    help="comma-separated, of vanilla, sglang-pic-spans, sglang-pic-spans-graphs, "
                         "sglang-pic-spans-graphs-r1, sglang-pic-spans-triton, vanilla-triton")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant this many times, alternating which goes first "
                         "(samples pooled; 2 = A B B A)")
    ap.add_argument("--quick", action="store_true",
                    help="1K/8K prompts, batch 1/32, 2 repeats (writes to a temp folder)")
    ap.add_argument("--prefill-lengths", type=_ints, default=None,
                    help="comma-separated TTFT prompt lengths ('' for none; default "
                         "1024,8192,32768,131000)")
    ap.add_argument("--decode-cases", type=_cases, default=None,
                    help="comma-separated BATCHxCONTEXT TPOT cases (default: batch 1/32/256 x "
                         "context 1K/8K/32K where the KV fits)")
    ap.add_argument("--name", default="nonspan_overhead_h200",
                    help="result file name (nonspan_overhead_rerun_h200 for a re-measured subset)")
    args = ap.parse_args()
    params = dict(NONSPAN_PARAMS)
    if args.prefill_lengths is not None:
        params["prefill_lengths"] = args.prefill_lengths
    if args.decode_cases is not None:
        params["decode_cases"] = args.decode_cases
    if args.quick:
        params.update(prefill_lengths=[1024, 8192], decode_batches=[1, 32],
                      decode_contexts=[1024, 8192], repeats=2)
        args.out = args.out or smoke_dir()
    run_side_by_side(args.name, "bench_position_free", "workload",
                     NONSPAN_ENGINE_KWARGS,
                     params, out_dir=args.out, variants=tuple(args.variants.split(",")),
                     variant_kwargs=VARIANT_KWARGS, timeout_s=590, rounds=args.rounds,
                     variant_settings=VARIANT_SETTINGS)


if __name__ == "__main__":
    main()
