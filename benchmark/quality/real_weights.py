"""Real weights on the H200: a span-cache server's greedy tokens against vanilla SGLang on
FlashInfer (non-span prompts) and against the HF block-attention reference (span prompts).

Dummy weights prove speed, never quality: this run uses SmolLM2-135M-Instruct, the embedded
default model, converted once from its GGUF (``sglang_pic.launcher.default_model``), in bf16.

- ``vanilla``: SGLang 0.5.17 on FlashInfer serves ``prompts`` x ``new_tokens`` greedy tokens.
- ``sglang-pic-spans``: the span-cache server (``pic_flashinfer`` + ``pic_span``, what
  ``--enable-span-cache`` selects) serves the same prompts, then span prompts (documents marked
  as independent spans after different system prompts).
- The parent runs the span prompts through the HF block-attention reference
  (``sglang_pic.spans.reference``) on the GPU in float32.

Reported per comparison: prompts whose tokens are identical, and for each divergence its position
and the top-2 logprob gap at that step on each side (``ref_top2_gap``: vanilla for non-span
prompts, the float32 HF reference for span prompts; ``ours_top2_gap``): where the reference's own
gap is within bf16's noise (a few tenths on SmolLM2) either pick is right; elsewhere a divergence
is a bug.

    python3 -m benchmark.quality.real_weights --out DIR [--prompts 24] [--new-tokens 64]
    python3 -m benchmark.quality.real_weights --smoke     # CPU: 4 prompts, torch_native
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmark import description

HERE = Path(__file__).resolve().parent

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.",
    "Explain photosynthesis in one sentence.", "What is 12 times 12?",
    "Write a haiku about the sea.", "Who wrote Romeo and Juliet?",
    "What does a compiler do?", "Give me a synonym for happy.",
    "How many legs does a spider have?", "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.", "What is the largest planet in our solar system?",
    "Describe a cat in two sentences.", "What is machine learning?",
    "List the days of the week.", "Why is the sky blue?",
    "What is the square root of 81?", "Suggest a name for a pet goldfish.",
    "What language is spoken in Brazil?", "Summarize the plot of Cinderella briefly.",
    "What is an atom?", "Give an example of a prime number greater than 50.",
    "What is the opposite of cold?", "How do airplanes stay in the air?",
]
DOCS = [
    "The secret code of the blue castle is 4417. The castle was built in 1502 by King Aldric.",
    "Mount Quellen is 3120 metres high and lies north of the river Aster, near the town of Brill.",
    "The bakery on Elm Street sells rye bread on Mondays and cherry pie on Fridays.",
    "The river Aster floods every spring; the town of Brill built a stone wall in 1880.",
]
SYSTEMS = ["You are a helpful assistant.", "Read the documents below and answer briefly.",
           "Answer the question using only the documents."]
SPAN_QUESTIONS = ["What is the secret code of the blue castle?", "How high is Mount Quellen?",
                  "When does the bakery sell cherry pie?", "What did the town of Brill build?"]


def build_prompts(tok, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """Chat-templated plain prompts, and span prompts (SSEP before each document, PDEP before
    the question) as token ids."""
    from sglang_pic.spans.request import PDEP_ID, SSEP_ID

    plain = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                         add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"] for q in QUESTIONS[:n]]
    spans = []
    for i, q in enumerate(SPAN_QUESTIONS * max(1, n // (len(SPAN_QUESTIONS) * 2))):
        ids = tok(SYSTEMS[i % len(SYSTEMS)])["input_ids"]
        order = DOCS[i % len(DOCS):] + DOCS[: i % len(DOCS)]  # each document at other offsets
        for d in order:
            ids += [SSEP_ID] + tok(" " + d, add_special_tokens=False)["input_ids"]
        spans.append(ids + [PDEP_ID] + tok(f"\nQuestion: {q}\nAnswer:",
                                            add_special_tokens=False)["input_ids"])
    return plain, spans


def _steps(out: dict) -> tuple[list[int], list[list[tuple[float, int]]]]:
    meta = out["meta_info"]
    ids = [t[1] for t in meta["output_token_logprobs"]]
    tops = [[(lp, tid) for lp, tid, *_ in step] for step in meta["output_top_logprobs"]]
    return ids, tops


def workload(engine_kwargs: dict, params: dict) -> dict:
    import sglang as sgl

    variant = os.environ.get("SGLANG_PIC_BENCH_VARIANT", "vanilla")
    engine = sgl.Engine(**engine_kwargs)
    sp = {"temperature": 0, "max_new_tokens": params["new_tokens"], "ignore_eos": True}
    result: dict = {"variant": variant}
    try:
        outs = engine.generate(input_ids=params["plain"], sampling_params=sp,
                               return_logprob=True, top_logprobs_num=2)
        result["plain"] = [_steps(o) for o in outs]
        if variant.startswith("sglang-pic"):
            spans = []
            for ids in params["spans"]:  # one at a time: later prompts hit earlier spans
                spans.append(_steps(engine.generate(input_ids=ids, sampling_params=sp,
                                                    return_logprob=True, top_logprobs_num=2)))
            result["spans"] = spans
    finally:
        engine.shutdown()
    return result


def _top2_gap(tops: list, step: int) -> float | None:
    """The top-2 logprob gap at ``step`` (0 is an exact bf16 tie), or None without logprobs."""
    top = sorted(tops[step], reverse=True) if tops else []
    return top[0][0] - top[1][0] if len(top) > 1 else None


def compare(ref: list, ours: list) -> dict:
    """Identical prompts; for each divergence its step and the top-2 logprob gap there on each
    side (how near a tie the float32 reference's and our pick were)."""
    diverged = []
    for i, ((rid, rtop), (oid, otop)) in enumerate(zip(ref, ours, strict=True)):
        step = next((k for k, (a, b) in enumerate(zip(rid, oid, strict=True)) if a != b), None)
        if step is not None:
            diverged.append({"prompt": i, "step": step, "ref_top2_gap": _top2_gap(rtop, step),
                             "ours_top2_gap": _top2_gap(otop, step)})
    return {"prompts": len(ref), "identical": len(ref) - len(diverged), "diverged": diverged}


def reference_spans(model_dir: str, spans: list[list[int]], new_tokens: int, pad_id: int,
                    device: str, dtype: str = "float32", top_logprobs_num: int = 2) -> list:
    """HF block-attention greedy continuation of each span prompt: per prompt its tokens and
    each step's best ``top_logprobs_num`` (logprob, token), as a server's
    ``output_top_logprobs`` gives them. ``dtype`` float32 is the reference; bfloat16 measures
    how far bf16 arithmetic alone moves the logprobs on the same prompts."""
    import torch
    from sglang_pic.spans.reference import block_attention_greedy
    from sglang_pic.spans.request import PDEP_ID, SSEP_ID, layout_prompt
    from sglang_pic.spans.segments import decode_pieces
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 attn_implementation="eager").to(device).eval()
    out = []
    for ids in spans:
        padded, layout = layout_prompt(ids, marker_ids=(SSEP_ID, PDEP_ID), page_size=1,
                                       pad_id=pad_id)
        tops: list = []
        toks = block_attention_greedy(model, padded, decode_pieces(layout), new_tokens,
                                      top_logprobs=tops, top_logprobs_num=top_logprobs_num)
        out.append((toks, tops))
    return out


def main() -> None:
    import json

    from sglang_pic.launcher.default_model import ensure_default_model
    from transformers import AutoTokenizer

    from benchmark.harness import run_side_by_side, smoke_dir

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="CPU: 4 prompts, 8 tokens")
    ap.add_argument("--control", action="store_true",
                    help="vanilla on FlashInfer vs vanilla on triton only: how often two of "
                         "SGLang's own kernels disagree at bf16 on these prompts")
    args = ap.parse_args()
    model_dir = str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(model_dir)
    if args.smoke:
        args.prompts, args.new_tokens = 4, 8
        args.out = args.out or smoke_dir()
        from sglang_pic.cpu.support import enable_cpu_engine

        enable_cpu_engine()
        base = {"device": "cpu", "attention_backend": "torch_native", "max_total_tokens": 8192,
                "disable_cuda_graph": True}
        ours = {"attention_backend": "pic_torch_native", "radix_cache_backend": "pic_span"}
    else:
        base = {"attention_backend": "flashinfer", "mem_fraction_static": 0.3,
                "cuda_graph_max_bs_decode": 32}
        ours = {"attention_backend": "pic_flashinfer", "radix_cache_backend": "pic_span"}
    plain, spans = build_prompts(tok, args.prompts)
    params = {"plain": plain, "spans": spans, "new_tokens": args.new_tokens}
    engine_kwargs = {"model_path": model_dir, "dtype": "bfloat16", "page_size": 1, **base}
    name = "real_weights_smoke" if args.smoke else "real_weights_h200"
    if args.control:
        report = run_side_by_side(name + "_control", "quality.real_weights", "workload",
                                  engine_kwargs, params, variants=("vanilla", "vanilla-triton"),
                                  out_dir=args.out, timeout_s=570)
        res = report["results"]
        c = compare(res["vanilla"]["plain"], res["vanilla-triton"]["plain"])
        report["comparison"] = {"vanilla_triton_vs_vanilla": c}
        folder = Path(args.out) if args.out else HERE.parent / "results"
        (folder / f"{report['benchmark']}.json").write_text(json.dumps(report, indent=1))
        print(f"vanilla-triton vs vanilla: {c['identical']}/{c['prompts']} identical; "
              f"divergences: {c['diverged']}")
        return
    report = run_side_by_side(name, "quality.real_weights", "workload", engine_kwargs, params,
                              variants=("vanilla", "sglang-pic-spans"), out_dir=args.out,
                              variant_kwargs={"sglang-pic-spans": ours}, timeout_s=570)
    res = report["results"]
    device = "cpu" if args.smoke else "cuda"
    ref_spans = reference_spans(model_dir, spans, args.new_tokens, tok.eos_token_id, device)
    report["comparison"] = {
        "nonspan_vs_vanilla": compare(res["vanilla"]["plain"], res["sglang-pic-spans"]["plain"]),
        "spans_vs_reference": compare(ref_spans, res["sglang-pic-spans"]["spans"]),
    }
    folder = Path(args.out) if args.out else HERE.parent / "results"
    (folder / f"{report['benchmark']}.json").write_text(json.dumps(report, indent=1))
    for name, c in report["comparison"].items():
        print(f"{name}: {c['identical']}/{c['prompts']} identical; divergences: {c['diverged']}")


if __name__ == "__main__":
    main()
