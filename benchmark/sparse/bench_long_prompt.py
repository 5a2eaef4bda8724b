"""One prompt longer than the GPU KV pool: prefill with its chunks in host memory, then decode.

Issue 27 item 4. sglang-pic runs ``pariskv_flashinfer`` with ``--sparse-offload`` on a KV pool of
``--pool-tokens`` (default 64K tokens, far below the prompts): past the threshold each prefill
chunk first moves the finished positions to pinned host memory and attends them from there
(``sglang_pic/sparse/prefill_offload.py``), and the decode reads the selected keys from host
memory. Vanilla SGLang (FlashInfer) gets a pool as large as the GPU allows and runs the lengths
that fit it; SGLang's refusal of the others is recorded (``skipped_<length>``).

Per variant and length, one streamed generation of ``--long`` tokens (ignore_eos): the prefill
time is the time to its first token, TPOT the time per token after it; and the GPU memory in
use. Llama-3-8B shape by default (``--shape qwen2.5-7b``: 28 layers, 4 KV heads, half the KV
per token), dummy weights, bf16.

    python3 -m benchmark.sparse.bench_long_prompt [--lengths 131072,262144,524288]
        [--pool-tokens 65536] [--shape llama3-8b] [--variants vanilla,sglang-pic] [--out DIR]

Prints a table; writes ``sparse_long_prompt.json`` (machine, versions, config, raw samples) and
a plot of prefill time and TPOT against length into ``--out`` (default ``benchmark/results``).
``--smoke``: CPU engine, SmolLM2, a 2.9K-token prompt: sglang-pic on a 2048-token pool, vanilla
on a 4096-token one (checks the script, not speed).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmark import description, harness
from benchmark.sparse.bench_e2e_decode import start_engine

QWEN25_7B_SHAPE = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "hidden_size": 3584, "intermediate_size": 18944}
"""Qwen2.5-7B's attention and MLP sizes over the Llama-3-8B checkpoint config (dummy weights)."""


def workload(engine_kwargs: dict, params: dict) -> dict:
    """Runs in the variant's process: one Engine; per length, prefill then the two decodes."""
    import numpy as np

    engine, out = start_engine(engine_kwargs, params["sparse_env"])
    rng = np.random.default_rng(params["seed"])
    tag = engine_kwargs.get("attention_backend")
    try:
        warm = [int(t) for t in rng.integers(1000, params["vocab"], size=params["warm_tokens"])]
        engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
        for n in params["lengths"]:
            prompt = [int(t) for t in rng.integers(1000, params["vocab"], size=n)]
            try:
                res = _streamed(engine, prompt, params["long"])
            except ValueError as e:  # SGLang's length check
                res = {"finish_reason": str(e)}
            if "prefill_s" not in res:  # SGLang refused it (longer than its pool)
                out[f"skipped_{n}"] = str(res.get("finish_reason"))[:300]
                print(f"[bench] {tag}: {n} tokens not served: {out[f'skipped_{n}']}", flush=True)
                continue
            out[f"prefill_s_{n}"] = res["prefill_s"]
            out[f"tpot_ms_{n}"] = res["tpot_ms"]
            out[f"output_ids_{n}"] = res["output_ids"]
            print(f"[bench] {tag}: {n} tokens: prefill {out[f'prefill_s_{n}']:.1f} s, TPOT "
                  f"{out[f'tpot_ms_{n}']:.2f} ms", flush=True)
        try:
            import torch

            free, total = torch.cuda.mem_get_info()
            out["gpu_used_gib"] = (total - free) / 2**30
        except (RuntimeError, AssertionError):
            pass
    finally:
        engine.shutdown()
    return out


def _streamed(engine, prompt: list[int], new_tokens: int) -> dict:
    """One streamed generation (``harness.stream_generate``): the prefill is the time to the
    first token, TPOT the time per token after it (one prefill per length: a 512K-token prefill
    takes minutes, and with ``--sparse-offload`` the radix cache is off, so a second generation
    would prefill again)."""
    sp = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
    first, finish, last = engine.loop.run_until_complete(
        harness.stream_generate(engine, prompt, sp))
    meta = last.get("meta_info", {})
    tokens = int(meta.get("completion_tokens", 0))
    if not tokens:  # refused: no token came
        return {"finish_reason": meta.get("finish_reason")}
    return {"prefill_s": first, "output_ids": last.get("output_ids", []),
            "finish_reason": meta.get("finish_reason"),
            "tpot_ms": 1000 * (finish - first) / (tokens - 1) if tokens > 1 else float("nan")}


def plot(report: dict, out_dir: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, res = report["params"], report["results"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for variant, r in res.items():
        xs = [n for n in p["lengths"] if f"prefill_s_{n}" in r]
        axes[0].plot([n / 1024 for n in xs], [r[f"prefill_s_{n}"] for n in xs], "o-",
                     label=variant)
        axes[1].plot([n / 1024 for n in xs], [r[f"tpot_ms_{n}"] for n in xs], "o-",
                     label=variant)
    axes[0].set(xlabel="prompt (K tokens)", ylabel="prefill (s)")
    axes[1].set(xlabel="prompt (K tokens)", ylabel="TPOT (ms)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"one prompt, KV pool of {p['pool_tokens']} tokens for sglang-pic "
                 f"({p['shape']} shape)", fontsize=9)
    fig.tight_layout()
    return harness.save_figure(fig, out_dir / "sparse_long_prompt.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--lengths", default="131072,262144,524288")
    ap.add_argument("--pool-tokens", type=int, default=65536)
    ap.add_argument("--shape", choices=("llama3-8b", "qwen2.5-7b"), default="llama3-8b")
    ap.add_argument("--long", type=int, default=80,
                    help="new tokens per prompt; TPOT is measured over those after the first")
    ap.add_argument("--chunk", type=int, default=16384, help="--chunked-prefill-size")
    ap.add_argument("--threshold", type=int, default=16384, help="--sparse-threshold")
    ap.add_argument("--variants", default="vanilla,sglang-pic",
                    help="of vanilla, sglang-pic, and sglang-pic-r<N> (--sparse-reselect-interval "
                         "N)")
    ap.add_argument("--timeout", type=float, default=590)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU engine, SmolLM2, one 2.9K-token prompt on a 2048-token pool")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    context = max(lengths) + args.long + 64
    name, backend = "sparse_long_prompt", "pariskv_flashinfer"
    engine_kwargs = {**harness.LLAMA3_8B_DUMMY, "context_length": context,
                     "disable_radix_cache": True, "chunked_prefill_size": args.chunk,
                     "cuda_graph_max_bs_decode": 4, "max_running_requests": 4}
    if args.shape == "qwen2.5-7b":
        import json

        engine_kwargs["json_model_override_args"] = json.dumps(QWEN25_7B_SHAPE)
    # a prompt longer than the pool holds threshold + 2 chunks + sink + local pool tokens while
    # it is prefilled (49K here: the server refuses a pool smaller than that)
    sparse_env = {"SGLANG_PIC_SPARSE_MAX_REQUESTS": 1, "SGLANG_PIC_SPARSE_MAX_CONTEXT": context,
                  "SGLANG_PIC_SPARSE_OFFLOAD": 1, "SGLANG_PIC_SPARSE_THRESHOLD": args.threshold}
    params = {"lengths": lengths, "pool_tokens": args.pool_tokens, "shape": args.shape,
              "long": args.long, "seed": 0, "vocab": 128000,
              "warm_tokens": 40000, "sparse_env": sparse_env}
    ours = {"attention_backend": backend, "max_total_tokens": args.pool_tokens}
    if args.smoke:
        name, backend = "sparse_long_prompt_cpu_smoke", "pariskv_torch_native"
        args.out = args.out or harness.smoke_dir()
        engine_kwargs = harness.cpu_smoke_engine(context_length=4096, chunked_prefill_size=256,
                                                 max_total_tokens=4096)
        ours = {"attention_backend": backend, "max_total_tokens": 2048}
        params.update(lengths=[2900], pool_tokens=2048, long=12, vocab=49000,
                      warm_tokens=300, sparse_env={**sparse_env,
                                                   "SGLANG_PIC_SPARSE_MAX_CONTEXT": 4096,
                                                   "SGLANG_PIC_SPARSE_THRESHOLD": 700,
                                                   "SGLANG_PIC_SPARSE_LOCAL": 128,
                                                   "SGLANG_PIC_SPARSE_UPDATE": 16})
    variants = tuple(args.variants.split(","))
    try:
        variant_kwargs = harness.sparse_variant_kwargs(variants, {"sglang-pic": ours})
    except ValueError as e:
        ap.error(str(e))
    report = harness.run_side_by_side(
        name, "sparse.bench_long_prompt", "workload", engine_kwargs, params,
        variants=variants, timeout_s=args.timeout, out_dir=args.out,
        variant_kwargs=variant_kwargs)
    res = report["results"]
    for n in params["lengths"]:
        row = [f"{n:>8}"]
        for variant in args.variants.split(","):
            r = res.get(variant, {})
            row.append(f"{variant}: " + (f"prefill {r[f'prefill_s_{n}']:.1f} s, TPOT "
                                         f"{r[f'tpot_ms_{n}']:.2f} ms" if f"prefill_s_{n}" in r
                                         else r.get(f"skipped_{n}", "no result")))
        print(" | ".join(row))
    path = plot(report, Path(args.out) if args.out else harness.RESULTS)
    if path:
        print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
