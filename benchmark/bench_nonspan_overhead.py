"""Non-span traffic on a span-cache server vs vanilla SGLang on FlashInfer, H200, one run.

A server started with ``--enable-span-cache`` (span radix cache ``pic_span``, position-free KV on
``pic_triton``) serves requests that carry no spans; a drop-in replacement must be as fast as the
SGLang it replaces on them. The workload is ``bench_position_free.workload`` (Llama-3.1-8B shape,
dummy weights): TTFT of fresh 1K / 8K / 32K prompts and TPOT at batch 1 / 32 / 256 x 1K / 8K /
32K context where the KV fits, ``repeats`` samples each (medians reported, every sample kept).

Variants: ``vanilla`` (FlashInfer, the baseline), ``vanilla-triton`` (second column) and
``sglang-pic-spans`` (the span-cache server).

    python3 benchmark/bench_nonspan_overhead.py [--out DIR] [--variants ...] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench_position_free import ENGINE_KWARGS, PARAMS

SPAN_SERVER = {"attention_backend": "pic_triton", "radix_cache_backend": "pic_span"}
VARIANT_KWARGS = {"sglang-pic-spans": SPAN_SERVER}


def main() -> None:
    from harness import run_side_by_side, smoke_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results folder (default benchmark/results)")
    ap.add_argument("--variants", default="vanilla,sglang-pic-spans,vanilla-triton")
    ap.add_argument("--quick", action="store_true",
                    help="1K/8K prompts, batch 1/32, 2 repeats (writes to a temp folder)")
    args = ap.parse_args()
    params = dict(PARAMS)
    if args.quick:
        params.update(prefill_lengths=[1024, 8192], decode_batches=[1, 32],
                      decode_contexts=[1024, 8192], repeats=2)
        args.out = args.out or smoke_dir()
    run_side_by_side("nonspan_overhead_h200", "bench_position_free", "workload", ENGINE_KWARGS,
                     params, out_dir=args.out, variants=tuple(args.variants.split(",")),
                     variant_kwargs=VARIANT_KWARGS, timeout_s=590)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
