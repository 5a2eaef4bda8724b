"""What independent spans cost in answer quality: synthetic multi-document QA, three ways.

A question set generated here (seeded, no download), shaped like 2WikiMultihopQA: every question
comes with ``k`` short documents, facts planted in some of them, the rest distractors, in random
order. Two kinds of question: *single-hop* (the answer is stated in one document) and *two-hop*
(compose two documents: "the company that makes X" in one, "who founded that company" in another).

Each question is asked three ways, same tokens, greedy decoding:

* ``full``: the documents are ordinary prompt text (full recompute; vanilla semantics);
* ``spans``: each document is an independent span (SSEP), the question dependent (PDEP);
* ``spans+link``: spans with EPIC-style link recompute of the first k tokens of each span.

A model not fine-tuned for block attention loses accuracy with spans; link recompute is meant to
win some back. The trade-off is the user's to see, so it is reported, not asserted.

    python -m benchmark.bench_span_accuracy [--questions 60] [--link-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmark import description

REPO = Path(__file__).resolve().parent.parent

FIRST = ["Ana", "Boris", "Chen", "Dalia", "Emeka", "Freya", "Goran", "Hana", "Ivo", "Jun", "Kira",
         "Luis", "Mira", "Nils", "Oona", "Pavel", "Rosa", "Sami", "Tara", "Umar"]
LAST = ["Lind", "Okafor", "Marsh", "Vogel", "Ito", "Reyes", "Novak", "Quinn", "Haas", "Berg"]
PRODUCTS = ["Zephyr lamp", "Orbit kettle", "Nimbus drone", "Quartz radio", "Falcon bike",
            "Ember stove", "Tidal pump", "Comet watch", "Lumen camera", "Atlas tent"]
COMPANIES = ["Veltrix", "Korvane", "Pellmark", "Istoria", "Brandwell", "Ostrava Works", "Melkin",
             "Quorra", "Sundale", "Tarvik"]
CITIES = ["Harlow", "Brenn", "Castellan", "Dunmore", "Elsby", "Fenwick", "Galloway", "Holt"]
FILLER = [
    "The region is known for its mild winters and busy river trade.",
    "Local records describe a long tradition of craft workshops.",
    "Visitors often mention the old stone bridge near the market square.",
    "Several festivals take place there each spring and autumn.",
    "The area was mapped in detail during the last century.",
]


def make_questions(n: int, k: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        product, company = rng.choice(PRODUCTS), rng.choice(COMPANIES)
        founder = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        city = rng.choice(CITIES)
        fill = lambda: " ".join(rng.sample(FILLER, 2))  # noqa: E731
        made_by = f"The {product} is manufactured by {company}. {fill()}"
        founded = f"{company} was founded by {founder} in {city}. {fill()}"
        distractors = []
        for _ in range(k - 2):
            c2, f2 = rng.choice([c for c in COMPANIES if c != company]), f"{rng.choice(FIRST)} {rng.choice(LAST)}"
            p2 = rng.choice([p for p in PRODUCTS if p != product])
            distractors.append(rng.choice([f"{c2} was founded by {f2} in {rng.choice(CITIES)}. {fill()}",
                                           f"The {p2} is manufactured by {c2}. {fill()}"]))
        docs = [made_by, founded, *distractors]
        rng.shuffle(docs)
        if i % 2 == 0:
            out.append({"kind": "single-hop", "docs": docs, "answer": founder,
                        "question": f"Who founded {company}?"})
        else:
            out.append({"kind": "two-hop", "docs": docs, "answer": founder,
                        "question": f"Who founded the company that manufactures the {product}?"})
    return out


def prompt(tok, q: dict, spans: bool) -> str:
    ssep, pdep = ("<|ssep|>", "<|pdep|>") if spans else ("", "")
    docs = "".join(f"{ssep}Document: {d}\n" for d in q["docs"])
    user = f"Read the documents and answer with a name only.\n{docs}{pdep}Question: {q['question']}"
    return tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                   add_generation_prompt=True)


def run_engine(model: str, prompts: list[str], link_tokens: int) -> list[str]:
    import os

    os.environ["SGLANG_PIC_SPAN_RECOMPUTE_TOKENS"] = str(link_tokens)
    import sglang as sgl

    engine = sgl.Engine(model_path=model, device="cpu", attention_backend="pic_torch_native",
                        radix_cache_backend="pic_span", max_total_tokens=16384,
                        disable_cuda_graph=True, log_level="error")
    try:
        outs = []
        for i, p in enumerate(prompts):
            outs.append(engine.generate(prompt=p, sampling_params={"max_new_tokens": 24,
                                                                   "temperature": 0})["text"])
            if (i + 1) % 20 == 0:
                print(f"  {i + 1}/{len(prompts)}", flush=True)
        return outs
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--questions", type=int, default=60)
    ap.add_argument("--docs", type=int, default=4, help="documents per question")
    ap.add_argument("--link-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmark" / "results" / "spans_accuracy_cpu.json"))
    args = ap.parse_args()

    from sglang_pic.cpu.support import enable_cpu_engine
    from sglang_pic.launcher.default_model import ensure_default_model

    enable_cpu_engine()
    model = str(ensure_default_model())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    qs = make_questions(args.questions, args.docs, args.seed)
    modes = {"full": (False, 0), "spans": (True, 0), "spans+link": (True, args.link_tokens)}
    answers: dict[str, list[str]] = {}
    t0 = time.time()
    # full and spans share an engine without link recompute; spans+link needs its own
    plain = run_engine(model, [prompt(tok, q, False) for q in qs] + [prompt(tok, q, True) for q in qs], 0)
    answers["full"], answers["spans"] = plain[: len(qs)], plain[len(qs):]
    answers["spans+link"] = run_engine(model, [prompt(tok, q, True) for q in qs], args.link_tokens)
    rows = []
    for mode in modes:
        for kind in ("single-hop", "two-hop", "all"):
            idx = [i for i, q in enumerate(qs) if kind == "all" or q["kind"] == kind]
            hits = sum(qs[i]["answer"].lower() in answers[mode][i].lower() for i in idx)
            rows.append({"mode": mode, "kind": kind, "n": len(idx), "accuracy": hits / len(idx)})
    print(f"\n{'mode':<12}{'single-hop':>12}{'two-hop':>10}{'all':>8}")
    for mode in modes:
        acc = {r["kind"]: r["accuracy"] for r in rows if r["mode"] == mode}
        print(f"{mode:<12}{acc['single-hop']:>12.2f}{acc['two-hop']:>10.2f}{acc['all']:>8.2f}")
    from benchmark.harness import environment

    report = {"benchmark": "spans_accuracy_cpu", "environment": environment(),
              "model": "SmolLM2-135M-Instruct", "params": vars(args), "rows": rows,
              "elapsed_s": time.time() - t0,
              "samples": [{"question": q["question"], "answer": q["answer"],
                           **{m: answers[m][i] for m in modes}} for i, q in enumerate(qs[:10])]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
