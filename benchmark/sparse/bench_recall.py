"""ParisKV retrieval quality on real attention patterns: SmolLM2-135M on a long input, CPU.

Runs the model over a ~4K-token haystack with a planted needle and a question at the end,
captures every layer's post-RoPE queries/keys/values (forward pre-hooks on the attention modules)
and, for the last ``--queries`` positions, compares ParisKV's selection (``sglang_pic.sparse``)
with the exact top-k of q.k: recall@k, and the relative error of the sparse attention output
(sink + local window + k retrieved tokens) against dense attention.

    python -m benchmark.sparse.bench_recall [--tokens 4096] [--k 100]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from benchmark import description

REPO = Path(__file__).resolve().parents[2]


def haystack(tok, n_tokens: int, seed: int) -> tuple[list[int], str]:
    rng = random.Random(seed)
    from benchmark.bench_span_accuracy import FILLER, make_questions

    docs = [d for q in make_questions(200, 4, seed) for d in q["docs"]]
    needle = f"The special magic number for the archive is {rng.randint(10000, 99999)}."
    parts, total = [], 0
    while total < n_tokens - 64:
        p = rng.choice(docs + FILLER)
        parts.append(p)
        total += len(tok(" " + p, add_special_tokens=False)["input_ids"])
    parts.insert(rng.randrange(len(parts)), needle)
    text = " ".join(parts) + "\nQuestion: what is the special magic number for the archive?\nAnswer:"
    return tok(text)["input_ids"], needle



def capture_qkv(model, ids: list[int], device: str = "cpu") -> dict[int, tuple]:
    """Per layer, the post-RoPE queries, keys and values of the prompt ``ids``, each
    ``[heads, n, D]``, from forward pre-hooks on the HF model's attention modules (one pass)."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    captured: dict[int, tuple] = {}

    def hook(layer_idx):
        def pre(module, a, kw):
            hs = kw["hidden_states"]
            cos, sin = kw["position_embeddings"]
            shape = (*hs.shape[:-1], -1, module.head_dim)
            q = module.q_proj(hs).view(shape).transpose(1, 2)
            k = module.k_proj(hs).view(shape).transpose(1, 2)
            v = module.v_proj(hs).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            captured[layer_idx] = (q[0].detach(), k[0].detach(), v[0].detach())

        return pre

    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=device))
    finally:
        for h in handles:
            h.remove()
    return captured

def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--queries", type=int, default=4, help="last positions evaluated")
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--local", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vote", default="tiers", choices=["tiers", "similarity"])
    ap.add_argument("--out", default=None, help="default benchmark/results/sparse_recall_cpu_<vote>.json")
    args = ap.parse_args()

    import torch
    from sglang_pic.launcher.default_model import ensure_default_model
    from sglang_pic.sparse.retrieval import (
        KeyIndex,
        ParisConfig,
        partial_attention,
        sparse_attention,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    model_dir = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, needle = haystack(tok, args.tokens, args.seed)
    t0 = time.time()
    captured = capture_qkv(model, ids)
    print(f"forward over {len(ids)} tokens: {time.time() - t0:.1f} s; needle: {needle}")
    cfg = ParisConfig(vote=args.vote)
    rows = []
    for layer_idx, (q, k, v) in sorted(captured.items()):
        groups = q.shape[0] // k.shape[0]
        k = k.repeat_interleave(groups, 0)
        v = v.repeat_interleave(groups, 0)
        for pos in range(len(ids) - args.queries, len(ids)):
            keys, vals = k[:, : pos + 1], v[:, : pos + 1]
            qq = q[:, pos]
            n = keys.shape[1]
            dense_mask = torch.zeros(n, dtype=torch.bool)
            dense_mask[: args.sink] = True
            dense_mask[n - args.local:] = True
            index = KeyIndex(keys, cfg)
            got = index.select(qq, args.k, dense_mask)
            scores = torch.einsum("hd,hnd->hn", qq, keys).masked_fill(dense_mask, float("-inf"))
            exact = scores.topk(args.k, dim=-1).indices
            recall = sum(len(set(got[h].tolist()) & set(exact[h].tolist()))
                         for h in range(q.shape[0])) / (q.shape[0] * args.k)
            out = sparse_attention(qq, keys, vals, index, args.k, args.sink, args.local)
            dense, _ = partial_attention(qq, keys, vals, 1 / keys.shape[-1] ** 0.5)
            err = float(((out - dense).norm(dim=-1) / dense.norm(dim=-1)).mean())
            rows.append({"layer": layer_idx, "position": pos, "recall": recall, "rel_err": err})
    mean_recall = sum(r["recall"] for r in rows) / len(rows)
    mean_err = sum(r["rel_err"] for r in rows) / len(rows)
    worst = min(rows, key=lambda r: r["recall"])
    print(f"{'layers':>8}{'queries':>9}{'k':>6}{'recall@k':>10}{'min':>8}{'rel err':>10}")
    print(f"{len(captured):>8}{args.queries:>9}{args.k:>6}{mean_recall:>10.3f}{worst['recall']:>8.2f}"
          f"{mean_err:>10.4f}")
    by_layer = {}
    for r in rows:
        by_layer.setdefault(r["layer"], []).append(r["recall"])
    print("recall by layer:", " ".join(f"{sum(v) / len(v):.2f}" for _, v in sorted(by_layer.items())))
    from benchmark.harness import environment

    args.out = args.out or str(REPO / f"benchmark/results/sparse_recall_cpu_{args.vote}.json")
    Path(args.out).write_text(json.dumps({
        "benchmark": "sparse_recall_cpu", "environment": environment(), "params": vars(args),
        "config": cfg.__dict__ if hasattr(cfg, "__dict__") else str(cfg), "tokens": len(ids),
        "mean_recall": mean_recall, "min_recall": worst["recall"], "mean_rel_err": mean_err,
        "rows": rows}, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
