"""RULER-style long-context suite: does ParisKV sparse decoding answer like dense decoding?

Tasks generated in-repo with a fixed seed (after RULER, Hsieh et al. 2024):

* ``niah_single`` - one needle ("The special magic number for <key> is <7 digits>.") at a random
  depth in a haystack of filler essays; asked for that number;
* ``niah_multikey`` - four needles with different keys; asked for one of them;
* ``variable_tracking`` - ``VAR A = <5 digits>``, then a chain ``VAR B = VAR A``, ... spread
  through the haystack; asked for the value of the chain's last variable.

The model (SmolLM2-135M-Instruct, HF transformers, CPU, greedy) prefills the prompt densely and
decodes the answer twice: with dense attention, and with ParisKV at every decode step of every
layer - sink + local window attended densely plus the ``k`` keys ParisKV retrieves
(``sglang_pic.sparse.retrieval``: SRHT, analytic centroids, similarity votes, candidate pruning,
4-bit RSQ-IP rerank), merged by log-sum-exp. A task counts as solved when the answer's digits
appear in the first generated tokens. Reports accuracy per task and length for both, and how
often the two generations are identical. Writes ``benchmark/results/sparse_ruler_cpu.json``.

    python -m benchmark.sparse.bench_ruler [--lengths 1024 2048 4096] [--samples 5] [--k 100]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmark import description

REPO = Path(__file__).resolve().parents[2]

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")
KEYS = ("apple", "river", "falcon", "marble", "cedar", "lantern", "harbor", "violet", "summit",
        "copper", "meadow", "comet")


def _haystack(tok, n_tokens: int, inserts: list[str], rng: random.Random) -> str:
    """Filler of about ``n_tokens`` tokens with ``inserts`` at random sentence boundaries, in
    order of appearance."""
    per = len(tok(FILLER, add_special_tokens=False).input_ids)
    units = [FILLER] * max(1, n_tokens // per)
    slots = sorted(rng.sample(range(len(units) + 1), len(inserts)))
    for pos, text in sorted(zip(slots, inserts, strict=True), reverse=True):
        units.insert(pos, text + " ")
    return "".join(units)


def make_task(task: str, tok, n_tokens: int, rng: random.Random) -> tuple[str, str]:
    """``(prompt, answer digits)``."""
    if task in ("niah_single", "niah_multikey"):
        keys = rng.sample(KEYS, 1 if task == "niah_single" else 4)
        values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
        needles = [f"The special magic number for {k} is {v}." for k, v in zip(keys, values,
                                                                               strict=True)]
        rng.shuffle(needles)
        target = rng.randrange(len(keys))
        body = _haystack(tok, n_tokens, needles, rng)
        question = (f"What is the special magic number for {keys[target]} mentioned in the "
                    f"text above? The special magic number for {keys[target]} is")
        return f"{body}\n{question}", values[target]
    if task == "variable_tracking":
        value = str(rng.randrange(10_000, 100_000))
        names = rng.sample([chr(c) for c in range(ord("A"), ord("Z") + 1)], 4)
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in
                                                   zip(names, names[1:], strict=False)]
        body = _haystack(tok, n_tokens, chain, rng)
        question = f"What is the value of VAR {names[-1]}? The value of VAR {names[-1]} is"
        return f"{body}\n{question}", value
    raise ValueError(task)


class SparseDecode:
    """A transformers attention function: dense (SDPA) for prefill, ParisKV for decode steps.

    Each layer keeps a ``KeyIndex`` of its keys, extended by the keys each decode step adds
    (rebuilt when the cache was reset), so keys are encoded once, as in the real layout."""

    def __init__(self, k: int, sink: int, local: int, vote: str = "similarity") -> None:
        from sglang_pic.sparse.retrieval import ParisConfig

        self.k, self.sink, self.local = k, sink, local
        self.cfg = ParisConfig(vote=vote)
        self.enabled = True
        self.indexes: dict[int, object] = {}
        self.steps = 0

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 is_causal=None, **kwargs):
        from sglang_pic.sparse.retrieval import KeyIndex, sparse_attention
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if not self.enabled or query.shape[2] != 1 or query.shape[0] != 1:
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling, is_causal=is_causal,
                                          **kwargs)
        hq, hk = query.shape[1], key.shape[1]
        keys = key[0].repeat_interleave(hq // hk, 0).float()  # [hq, n, d]
        values = value[0].repeat_interleave(hq // hk, 0).float()
        layer = id(module)
        index = self.indexes.get(layer)
        n = keys.shape[1]
        if index is None or index.n > n or index.n < n - 1:
            index = self.indexes[layer] = KeyIndex(keys, self.cfg)
        elif index.n == n - 1:
            index.append(keys[:, -1:])
        self.steps += 1
        out = sparse_attention(query[0, :, 0].float(), keys, values, index, self.k, self.sink,
                               self.local, scaling)
        return out.to(query.dtype)[None, None], None  # [1, q_len=1, heads, d]

    def reset(self) -> None:
        self.indexes.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--tasks", nargs="+",
                    default=["niah_single", "niah_multikey", "variable_tracking"])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--k", type=int, default=100,
                    help="retrieved keys per step (0: sink + local window only, the control)")
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--local", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=10)
    ap.add_argument("--out", default=str(REPO / "benchmark/results/sparse_ruler_cpu.json"))
    args = ap.parse_args()

    import torch
    from sglang_pic.launcher.default_model import ensure_default_model
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from benchmark.harness import environment

    torch.manual_seed(0)
    path = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(path)
    sparse = SparseDecode(args.k, args.sink, args.local)
    AttentionInterface.register("pariskv_decode", sparse)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="pariskv_decode").eval()
    rows, t0 = [], time.perf_counter()
    print(f"{'task':>18} {'tokens':>7} {'dense':>6} {'sparse':>7} {'same text':>10}", flush=True)
    for task in args.tasks:
        for length in args.lengths:
            rng = random.Random(f"{task}-{length}")
            dense_ok = sparse_ok = same = 0
            for _ in range(args.samples):
                prompt, answer = make_task(task, tok, length, rng)
                ids = tok(prompt, return_tensors="pt").input_ids
                outs = {}
                for mode in ("dense", "sparse"):
                    sparse.enabled = mode == "sparse"
                    sparse.reset()
                    with torch.no_grad():
                        gen = model.generate(ids, max_new_tokens=args.new_tokens,
                                             do_sample=False, pad_token_id=tok.eos_token_id)
                    outs[mode] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
                dense_ok += answer in outs["dense"].replace(",", "")
                sparse_ok += answer in outs["sparse"].replace(",", "")
                same += outs["dense"] == outs["sparse"]
                rows.append({"task": task, "tokens": int(ids.shape[1]), "answer": answer,
                             "dense": outs["dense"], "sparse": outs["sparse"]})
            print(f"{task:>18} {length:>7} {dense_ok / args.samples:>6.2f} "
                  f"{sparse_ok / args.samples:>7.2f} {same / args.samples:>10.2f}", flush=True)
    summary = {}
    for r in rows:
        key = f"{r['task']}@{min(args.lengths, key=lambda n: abs(n - r['tokens']))}"
        s = summary.setdefault(key, {"dense": 0, "sparse": 0, "same": 0, "n": 0})
        s["dense"] += r["answer"] in r["dense"].replace(",", "")
        s["sparse"] += r["answer"] in r["sparse"].replace(",", "")
        s["same"] += r["dense"] == r["sparse"]
        s["n"] += 1
    report = {"benchmark": "sparse_ruler", "environment": environment(), "model": str(path),
              "params": {k: getattr(args, k) for k in ("lengths", "tasks", "samples", "k",
                                                       "sink", "local", "new_tokens")},
              "vote": sparse.cfg.vote, "sparse_attention_calls": sparse.steps,
              "summary": summary, "rows": rows,
              "wall_s": time.perf_counter() - t0}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    total = {m: sum(s[m] for s in summary.values()) for m in ("dense", "sparse", "same", "n")}
    print(f"overall: dense {total['dense']}/{total['n']}, sparse {total['sparse']}/{total['n']}, "
          f"identical generations {total['same']}/{total['n']} ({report['wall_s']:.0f} s)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
