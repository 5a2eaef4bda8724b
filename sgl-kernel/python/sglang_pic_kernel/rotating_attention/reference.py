"""Plain-torch references for the rotating-attention kernels: rotate K, then standard attention.

The references take keys *un-rotated* and rotate each at its index in the request's KV sequence
(new key ``n`` of an extend at ``prefix + n``): what the kernels must compute from the same keys
in the shifted layout (rotated where computed, turned on read). Used by the kernel tests (CPU
interpreter and GPU).
"""

from __future__ import annotations

import torch

from .rope import RotaryTable, rotate_neox


def _attend(q, k, v, sm_scale, causal_offset: int | None, logit_cap: float = 0.0):
    """q [m, hq, d], k/v [n, hk, d] -> [m, hq, dv]; query i sees keys <= causal_offset + i."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), k) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if causal_offset is not None:
        m, n = q.shape[0], k.shape[0]
        keep = torch.arange(n)[None, :] <= (causal_offset + torch.arange(m))[:, None]
        s = s.masked_fill(~keep.to(s.device), float("-inf"))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v)


def reference_decode(q, k_buffer, v_buffer, kv_indptr, kv_indices, sm_scale, rope: RotaryTable,
                     logit_cap: float = 0.0) -> torch.Tensor:
    """q [batch, hq, d], k_buffer un-rotated; returns float32 [batch, hq, dv]."""
    out = []
    for b in range(q.shape[0]):
        slots = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        pos = torch.arange(slots.numel(), device=q.device)
        k = rotate_neox(k_buffer[slots], pos, rope)
        out.append(_attend(q[b : b + 1], k, v_buffer[slots], sm_scale, None, logit_cap))
    return torch.cat(out)


def reference_extend(q, k_ext, v_ext, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                     sm_scale, rope: RotaryTable, causal: bool = True,
                     logit_cap: float = 0.0) -> torch.Tensor:
    """k_ext and k_buffer un-rotated; returns float32 [new_tokens, hq, dv]."""
    out = []
    for s in range(qo_indptr.numel() - 1):
        qs, qe = int(qo_indptr[s]), int(qo_indptr[s + 1])
        slots = kv_indices[kv_indptr[s] : kv_indptr[s + 1]].long()
        pre = slots.numel()
        k = torch.cat((k_buffer[slots], k_ext[qs:qe]))
        v = torch.cat((v_buffer[slots], v_ext[qs:qe]))
        k = rotate_neox(k, torch.arange(k.shape[0], device=q.device), rope)
        out.append(_attend(q[qs:qe], k, v, sm_scale, pre if causal else None, logit_cap))
    return torch.cat(out)
