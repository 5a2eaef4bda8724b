"""How long sparse decoding follows dense decoding on free text, with real weights.

The needle suite (``sparse_needle.py``) scores copying a number out of a haystack: the keys a
step needs are the ones after those the previous step read, which is what a selection moved on
by a row a step (``--sparse-reselect-interval``) guesses. Free text asks more of the selection.
This run gives SmolLM2-135M-Instruct (real weights, bf16) ``--prompts`` passages of this
repository's documentation, each ``--prompt-tokens`` tokens read from a fixed commit
(``TEXT_COMMIT``) and followed by a request for a summary, and decodes ``--new-tokens`` tokens
greedily (EOS ignored) with every variant, in the same run:

- ``vanilla``: SGLang dense (FlashInfer on the GPU, torch_native with ``--cpu``), the reference;
- ``sglang-pic-sparse``: ParisKV from ``--threshold`` tokens (the needle suite's settings), a
  selection at every step;
- ``sglang-pic-sparse-r<N>``: the same with ``--sparse-reselect-interval N``;
- ``sglang-pic-sparse-v<N>``: the same with ``--sparse-vote-interval N``.

Per variant and prompt: the first step whose token differs from vanilla's (``--new-tokens`` when
none does) and the share of the steps before it. Greedy decoding amplifies a first difference
(later steps continue other text), so the first divergence is the measure; a bf16 tie can cause
one as well, which is why the score is an average over prompts and compared between variants.

Writes ``sparse_agreement_cpu.json`` (``--cpu``) or ``sparse_agreement_h200.json`` into ``--out``
(default ``benchmark/results``); each variant's ``first_divergence_all`` holds one value per
prompt, which ``benchmark/headlines.py`` reads for the rows ``sparse.agreement_*``.

    .venv/bin/python -m benchmark.quality.sparse_agreement --cpu     # here: ~12 min on 2 cores
    python3 -m benchmark.quality.sparse_agreement --out DIR           # device
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmark import description

# sparse_needle puts benchmark/ (the harness) and python/ (sglang_pic) on the path
from benchmark.quality.sparse_needle import (
    SPARSE_KNOBS,
    add_reselect_variants,
    add_sparse_knobs,
    engine_settings,
)

HERE = Path(__file__).resolve().parent

REPO = HERE.parent.parent
TEXT_COMMIT = "9e7c3d5"  # the documentation the passages are read from (git show)
TEXT_FILES = ("docs/eviction.md", "docs/sparse-decode.md", "docs/store.md", "docs/spans.md",
              "docs/position-free-kv.md")
QUESTION = "\n\nSummary of the section above, in plain words:"
DEFAULT_VARIANTS = "vanilla,sglang-pic-sparse,sglang-pic-sparse-r4"


def source_text() -> tuple[str, str]:
    """The documentation at ``TEXT_COMMIT``, and where it came from: the working tree's files
    when git or the commit is not there (a shallow clone), which the report then says."""
    try:
        text = "".join(subprocess.run(["git", "-C", str(REPO), "show", f"{TEXT_COMMIT}:{f}"],
                                      capture_output=True, text=True, check=True).stdout
                       for f in TEXT_FILES)
        return text, f"git {TEXT_COMMIT}"
    except (OSError, subprocess.CalledProcessError):
        print(f"sparse_agreement: commit {TEXT_COMMIT} not found; the passages come from the "
              "working tree's documentation (not comparable with reports from the commit's)",
              file=sys.stderr)
        return "".join((REPO / f).read_text() for f in TEXT_FILES), "working tree"


def passages(tok, n: int, tokens: int, stride: int = 3000) -> list[list[int]]:
    """``n`` prompts: ``tokens`` tokens of the documentation (``source_text``), ``stride``
    tokens apart, each followed by ``QUESTION``."""
    text, _ = source_text()
    ids = tok(text)["input_ids"]
    question = tok(QUESTION)["input_ids"]
    if (n - 1) * stride + tokens > len(ids):
        raise SystemExit(f"sparse_agreement: {n} passages of {tokens} tokens, {stride} apart, "
                         f"need more than the {len(ids)} tokens of text")
    return [ids[i * stride : i * stride + tokens] + question for i in range(n)]


def first_divergence(ids: list[int], ref: list[int]) -> int:
    """The first step where ``ids`` differs from ``ref`` (their common length if none)."""
    return next((k for k, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b),
                min(len(ids), len(ref)))


def main() -> None:
    from sglang_pic.launcher.default_model import ensure_default_model
    from transformers import AutoTokenizer

    from benchmark.harness import RESULTS, environment, run_side_by_side

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None, help="default benchmark/results")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=2400)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="vanilla first; sglang-pic-sparse and sglang-pic-sparse-r<N>")
    ap.add_argument("--cpu", action="store_true", help="SGLang's CPU engine (torch_native)")
    add_sparse_knobs(ap)
    args = ap.parse_args()
    variants = tuple(args.variants.split(","))
    if variants[0] != "vanilla":
        ap.error("--variants: vanilla must come first (the reference)")
    if not 1 <= args.prompts <= 64 or not 1 <= args.new_tokens <= 512:
        ap.error("--prompts must be in [1, 64] and --new-tokens in [1, 512]")
    if args.prompt_tokens + args.new_tokens + 64 > 8192 or args.prompt_tokens <= args.threshold:
        ap.error("--prompt-tokens must be over --threshold, and leave room in SmolLM2's 8K")
    t_start = time.perf_counter()
    model_dir = str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = passages(tok, args.prompts, args.prompt_tokens)
    knobs = {k: getattr(args, k) for k in SPARSE_KNOBS}
    engine_kwargs, ours = engine_settings(model_dir, args.cpu, args.max_requests)
    try:
        add_reselect_variants(variants, ours)
    except ValueError as e:
        ap.error(str(e))
    params = {"prompts": prompts, "new_tokens": args.new_tokens, "ignore_eos": True,
              "sparse_env": {f"SGLANG_PIC_SPARSE_{k.upper()}": v for k, v in knobs.items()}}
    name = "sparse_agreement_cpu" if args.cpu else "sparse_agreement_h200"
    report = run_side_by_side(
        name, "quality.sparse_needle", "workload", engine_kwargs, params, variants=variants,
        out_dir=args.out, variant_kwargs={v: ours[v] for v in variants if v in ours},
        timeout_s=1800 if args.cpu else 400)
    res = report["results"]
    ref = res["vanilla"]["output_ids"]
    for variant in variants:
        firsts = [first_divergence(ids, want) for ids, want in
                  zip(res[variant]["output_ids"], ref, strict=True)]
        res[variant].update(
            first_divergence_all=firsts, mean_first_divergence=statistics.mean(firsts),
            identical_prompts=sum(f == args.new_tokens for f in firsts))
        res[variant].pop("texts", None)
    report["params"] = {"prompts": f"{len(prompts)} passages of {args.prompt_tokens} tokens "
                        f"from {', '.join(TEXT_FILES)} ({source_text()[1]}), then "
                        f"{QUESTION!r}",
                        "new_tokens": args.new_tokens, "sparse": knobs}
    report["environment"] = environment()
    report["wall_s"] = time.perf_counter() - t_start
    path = (Path(args.out) if args.out else RESULTS) / f"{name}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"\n{'variant':>24} {'mean first divergence':>22} {'identical':>10}  per prompt")
    for variant in variants:
        r = res[variant]
        print(f"{variant:>24} {r['mean_first_divergence']:>22.1f} "
              f"{r['identical_prompts']:>6}/{len(prompts):<3}  {r['first_divergence_all']}")
    print(f"wrote {path} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
