"""Reference semantics of span prompts in plain HF transformers (tests and the accuracy benchmark).

One forward pass over the whole prompt with an explicit attention mask and explicit positions:

* a dependent token attends to every earlier (visible) token;
* a token of an independent span attends only to earlier tokens of its span (Block-Attention);
* with link recompute (k tokens), the span's first k tokens appear twice: a *ghost* copy that sees
  only itself (the standalone computation the cache holds) and a *link* copy, recomputed in context
  (sees everything before); the rest of the span (the *tail*) sees the ghost copy and itself, exactly
  what the engine does when it reuses the standalone pages from offset k. Ghosts are invisible to
  every other token and share the link tokens' positions.

Generated tokens are dependent. ``recompute_tokens`` is taken as given: the server rounds it up to a
page, so pass the rounded value when comparing with a server whose page size is above 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .segments import Piece


@dataclass(frozen=True)
class _Tok:
    token: int
    position: int
    group: int  # -1: dependent (sees all visible); otherwise the span it belongs to
    ghost: bool = False
    link: bool = False


def _layout(ids: Sequence[int], pieces: Sequence[Piece], recompute_tokens: int) -> list[_Tok]:
    toks: list[_Tok] = []
    for g, p in enumerate(pieces):
        span = ids[p.start : p.end]
        if not p.independent:
            toks += [_Tok(t, p.start + i, -1) for i, t in enumerate(span)]
            continue
        k = min(recompute_tokens, len(span))
        if k >= len(span):
            toks += [_Tok(t, p.start + i, -1) for i, t in enumerate(span)]
            continue
        toks += [_Tok(t, p.start + i, g, ghost=True) for i, t in enumerate(span[:k])]
        toks += [_Tok(t, p.start + i, g, link=True) for i, t in enumerate(span[:k])]
        toks += [_Tok(t, p.start + k + i, g) for i, t in enumerate(span[k:])]
    return toks


def _mask(toks: Sequence[_Tok]):
    import torch

    n = len(toks)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i, a in enumerate(toks):
        for j in range(i + 1):
            b = toks[j]
            if a.ghost:
                ok = b.ghost and b.group == a.group
            elif a.group == -1 or a.link:
                ok = not b.ghost
            else:  # independent span token (tail): its own span, ghost copy included, no links
                ok = b.group == a.group and not b.link
            allowed[i, j] = ok
    return allowed


def block_attention_greedy(
    model,
    ids: Sequence[int],
    pieces: Sequence[Piece],
    max_new_tokens: int,
    recompute_tokens: int = 0,
    top_logprobs: list | None = None,
    top_logprobs_num: int = 2,
) -> list[int]:
    """Greedy continuation of a span prompt under block-attention semantics (see module doc).

    The prompt runs once with its full mask; each generated token then runs with the KV cache and
    a one-row mask that hides the ghost copies. With ``top_logprobs`` (a list) each step's best
    ``top_logprobs_num`` tokens are appended to it as ``[(logprob, token), ...]``, best first, as
    a server's ``output_top_logprobs`` gives them: how near a tie each greedy pick was.
    """
    import torch

    toks = _layout(list(ids), pieces, recompute_tokens)
    neg = torch.finfo(model.dtype).min
    dev = model.device
    allowed = _mask(toks)
    bias = torch.zeros(allowed.shape, dtype=model.dtype).masked_fill_(~allowed, neg).to(dev)
    visible = [not t.ghost for t in toks]
    out: list[int] = []
    with torch.no_grad():
        res = model(
            input_ids=torch.tensor([[t.token for t in toks]], device=dev),
            position_ids=torch.tensor([[t.position for t in toks]], device=dev),
            attention_mask=bias[None, None],
            use_cache=True,
        )
        position = toks[-1].position
        for _ in range(max_new_tokens):
            logits = res.logits[0, -1]
            nxt = int(logits.argmax())
            out.append(nxt)
            if top_logprobs is not None:
                lp, ix = torch.log_softmax(logits.float(), -1).topk(top_logprobs_num)
                top_logprobs.append(list(zip(lp.tolist(), ix.tolist(), strict=True)))
            position += 1
            visible.append(True)
            row = torch.zeros(1, 1, 1, len(visible), dtype=model.dtype)
            row[0, 0, 0, ~torch.tensor(visible)] = neg
            res = model(
                input_ids=torch.tensor([[nxt]], device=dev),
                position_ids=torch.tensor([[position]], device=dev),
                attention_mask=row.to(dev),
                past_key_values=res.past_key_values,
                use_cache=True,
            )
    return out
