"""The model-side change of position-free KV: rotate only the query.

SGLang's Llama/Qwen attention does ``q, k = self.rotary_emb(positions, q, k)`` and then writes
``k`` into the KV pool. With position-free KV the pool must hold keys *un-rotated*, so while a
position-free attention backend is active in this process we wrap
``sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward`` (inherited from
``MultiPlatformOp.forward``; AROUND hook): SGLang's own kernel rotates ``q`` exactly as in vanilla
(bit-identical queries), and ``k`` is handed back untouched. The kernel still wants a key
tensor, so it gets a one-head scratch tensor whose result is thrown away (1/kv_heads of the work
vanilla spent on keys). Keys are rotated later, inside the attention kernels, at their index in
the request's KV sequence.
"""

from __future__ import annotations

from typing import Any

import torch

HOOK_TARGET = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward"

_active = False


def activate() -> None:
    """Called by a position-free backend once it has validated the model (one per process)."""
    global _active
    _active = True


def is_active() -> bool:
    return _active


def rotate_query_only(original, self, positions, query, key, *args: Any, **kwargs: Any):
    """AROUND hook: ``(rope(q), k)`` instead of ``(rope(q), rope(k))`` when active."""
    if not _active or key is None:
        return original(self, positions, query, key, *args, **kwargs)
    scratch = torch.empty(
        (positions.shape[0], self.head_size), dtype=key.dtype, device=key.device
    )
    query, _ = original(self, positions, query, scratch, *args, **kwargs)
    return query, key
