"""Split-KV decode attention over keys in the shifted layout (one query token per request).

Same contract as SGLang's ``decode_attention_fwd`` (``sglang.kernels.ops.attention.
decode_attention``) so SGLang's Triton backend can call it unchanged, plus a RoPE table and the
pool's ``stored_positions``. Keys sit in the pool rotated at the position they were computed at,
``stored_positions[slot]``; key ``n`` of request ``b`` (slot ``kv_indices[kv_indptr[b] + n]``) is
read at logical position ``n`` and turned by ``n - stored_positions[slot]`` in registers. That
shift is zero for every key that was computed where it is read (prompts without spans, generated
tokens) and such keys read no table row; a span computed at ``0..L-1`` and reused at offset ``o``
is turned by ``o``. So one physical copy of a span's pages serves it at any offset.

Stage 1 (grid ``batch x head-blocks x splits``): each program takes up to ``BLOCK_H`` query
heads sharing one KV head (GQA/MQA) and one contiguous slice of the sequence, and writes a
partial output and its log-sum-exp. Stage 2 merges the splits. Buffers, shapes:

    q                 [batch, q_heads, head_dim]        (rotated at its position by the model)
    k/v_buffer        [pool_slots, kv_heads, head_dim]  (k rotated where computed)
    stored_positions  [pool_slots] int32
    attn_logits       [batch, q_heads, max_kv_splits, head_dim]  float32 scratch
    attn_lse          [batch, q_heads, max_kv_splits]            float32 scratch
    num_kv_splits[batch] int32 (chosen by SGLang's backend), o [batch, q_heads, head_dim]

Page size does not enter: ``kv_indices`` holds token slots for any page size. The kernel has no
host-side branching on data, so it is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    merge_partial,
    next_pow2,
    online_softmax_step,
    rotated_scores,
    shift_cos_sin,
)
from .rope import RotaryTable

MIN_BLOCK_KV = 32
# (BLOCK_N, num_warps, num_stages) of stage 1 on CUDA; measured on the H200 (see
# benchmark/kernels/bench_rotating_attention.py --tune-decode). The server passes its
# --position-free-decode-config; the kernel reads no setting of its own.
DECODE_CONFIG = (64, 2, 3)


@triton.jit
def _decode_stage1(
    Q,
    K_Buffer,
    V_Buffer,
    CosSin,
    sm_scale,
    kv_indptr,
    kv_indices,
    Mid_O,
    Mid_Lse,
    num_kv_splits,
    StoredPos,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,
    Q_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    LV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    MIN_BLOCK: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    MAX_POS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    if BLOCK_H < GROUP:
        HEADS: tl.constexpr = BLOCK_H
    else:
        HEADS: tl.constexpr = GROUP
    kv_head = head_block // tl.cdiv(GROUP, BLOCK_H)
    lane_h = tl.arange(0, BLOCK_H)
    heads = head_block * HEADS + lane_h
    mask_h = (lane_h < HEADS) & (heads < Q_HEADS)

    offs_d = tl.arange(0, HALF_P)
    mask_d = offs_d < HALF
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < LV

    kv_start = tl.load(kv_indptr + b)
    seq_len = tl.load(kv_indptr + b + 1) - kv_start
    splits = tl.load(num_kv_splits + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, splits), MIN_BLOCK) * MIN_BLOCK
    start = per_split * split
    end = tl.minimum(start + per_split, seq_len)

    if end > start:
        q_off = b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q_mask = mask_h[:, None] & mask_d[None, :]
        q1 = tl.load(Q + q_off, mask=q_mask, other=0.0).to(K_Buffer.dtype.element_ty)
        q2 = tl.load(Q + q_off + HALF, mask=q_mask, other=0.0).to(K_Buffer.dtype.element_ty)

        e_max = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
        e_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        k_base = kv_head * stride_kh + offs_d[:, None]
        v_base = kv_head * stride_vh + offs_dv[None, :]
        for n0 in tl.range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            loc = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k_mask = mask_n[None, :] & mask_d[:, None]
            k_off = loc[None, :] * stride_kt + k_base
            k1 = tl.load(K_Buffer + k_off, mask=k_mask, other=0.0)
            k2 = tl.load(K_Buffer + k_off + HALF, mask=k_mask, other=0.0)
            # rotated where computed: turn each key by the distance it moved (table rows are
            # read only for keys that moved, a span reused at another offset)
            cos, sin = shift_cos_sin(offs_n, loc, mask_n, offs_d, mask_d, StoredPos, CosSin,
                                     stride_cs, HALF, MAX_POS)
            qk = rotated_scores(q1, q2, k1, k2, cos, sin, sm_scale, LOGIT_CAP)
            qk = tl.where(mask_h[:, None] & mask_n[None, :], qk, float("-inf"))
            v = tl.load(
                V_Buffer + loc[:, None] * stride_vt + v_base,
                mask=mask_n[:, None] & mask_dv[None, :],
                other=0.0,
            )
            acc, e_max, e_sum = online_softmax_step(qk, v, acc, e_max, e_sum)

        mo_off = b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_dv[None, :]
        tl.store(Mid_O + mo_off, acc / e_sum[:, None], mask=mask_h[:, None] & mask_dv[None, :])
        ml_off = b * stride_mlb + heads * stride_mlh + split
        tl.store(Mid_Lse + ml_off, e_max + tl.log(e_sum), mask=mask_h)


@triton.jit
def _decode_stage2(
    Mid_O,
    Mid_Lse,
    Out,
    v_scale,
    kv_indptr,
    num_kv_splits,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    MAX_KV_SPLITS: tl.constexpr,
    MIN_BLOCK: tl.constexpr,
    LV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq_len = tl.load(kv_indptr + b + 1) - tl.load(kv_indptr + b)
    splits = tl.load(num_kv_splits + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, splits), MIN_BLOCK) * MIN_BLOCK

    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < LV
    e_max = -float("inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s in range(0, MAX_KV_SPLITS):
        if per_split * s < seq_len:
            part = tl.load(
                Mid_O + b * stride_mob + h * stride_moh + s * stride_mos + offs_dv,
                mask=mask_dv,
                other=0.0,
            )
            lse = tl.load(Mid_Lse + b * stride_mlb + h * stride_mlh + s)
            acc, e_sum, e_max = merge_partial(acc, e_sum, e_max, part, lse)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_dv, acc / e_sum * v_scale, mask=mask_dv)


def rotating_decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_kv_splits: int,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    xai_temperature_len: int = -1,
    has_mla: bool = False,
    use_pdl: bool = False,
    page_size: int = 1,
    score_mod=None,
    aux_tensors=None,
    enable_lean: bool | None = None,
    lean_Mp: torch.Tensor | None = None,  # noqa: N803 - SGLang's keyword names
    lean_Lp: torch.Tensor | None = None,  # noqa: N803
    lean_Op: torch.Tensor | None = None,  # noqa: N803
    lean_locks: torch.Tensor | None = None,
    uneven_batch: bool | None = None,
    *,
    rope: RotaryTable,
    stored_positions: torch.Tensor,
    config: tuple[int, int, int] | None = None,
) -> None:
    """Decode attention over keys in the shifted layout; writes ``o``. See the module docstring.

    ``rope``: the model's RoPE table (row ``p`` turns a key by ``p``). ``stored_positions``: int32
    ``[pool_slots]``, the position each slot's key was rotated at. ``config`` = (BLOCK_N,
    num_warps, num_stages) for stage 1 (default: ``DECODE_CONFIG``).

    The trailing SGLang arguments exist so the backend can call this exactly like
    ``decode_attention_fwd``; features the kernel does not implement (attention sinks, MLA,
    score mods, xai temperature, SGLang 0.5.23's lean decode: the backend turns it off) are
    refused at server start by the backend, and asserted here.
    """
    assert not enable_lean, "rotating decode attention: lean decode is not supported"
    del lean_Mp, lean_Lp, lean_Op, lean_locks, uneven_batch
    assert sinks is None and not has_mla and score_mod is None and xai_temperature_len <= 0, (
        "rotating decode attention: sinks / MLA / score_mod / xai temperature are not supported"
    )
    del use_pdl, page_size, aux_tensors  # PDL is an optimisation; slots are token-level
    assert max_kv_splits == attn_logits.shape[2]
    batch, q_heads, head_dim = q.shape[0], q.shape[1], q.shape[-1]
    kv_heads = k_buffer.shape[-2]
    lv = v_buffer.shape[-1]
    assert head_dim == rope.head_dim and head_dim % 2 == 0, (head_dim, rope.head_dim)
    assert stored_positions.dtype == torch.int32 and stored_positions.numel() >= k_buffer.shape[0]
    group = q_heads // kv_heads
    block_h = 16
    half = head_dim // 2
    block_dv = next_pow2(lv)
    interp = not q.is_cuda
    block_n, warps, stages = config or DECODE_CONFIG
    if interp:
        block_n = max(block_n, 16)

    grid = (batch, triton.cdiv(q_heads, min(block_h, group)), max_kv_splits)
    _decode_stage1[grid](
        q, k_buffer, v_buffer, rope.cos_sin_cache, sm_scale * k_scale,
        kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits, stored_positions,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), rope.cos_sin_cache.stride(0),
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1),
        GROUP=group, Q_HEADS=q_heads, HALF=half, HALF_P=max(16, next_pow2(half)),
        LV=lv, BLOCK_DV=block_dv, BLOCK_N=block_n, BLOCK_H=block_h, MIN_BLOCK=MIN_BLOCK_KV,
        LOGIT_CAP=float(logit_cap), MAX_POS=rope.max_positions,
        **({} if interp else {"num_warps": warps, "num_stages": stages}),
    )
    _decode_stage2[(batch, q_heads)](
        attn_logits, attn_lse, o, v_scale, kv_indptr, num_kv_splits,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1), o.stride(0), o.stride(1),
        MAX_KV_SPLITS=max_kv_splits, MIN_BLOCK=MIN_BLOCK_KV, LV=lv, BLOCK_DV=block_dv,
        **({} if interp else {"num_warps": 4, "num_stages": 2}),
    )
