"""Extend (prefill) attention over keys in the shifted layout: cached prefix + new tokens, causal.

Same contract as SGLang's ``extend_attention_fwd`` (``sglang.kernels.ops.attention.
extend_attention``), plus a RoPE table and the pool's ``stored_positions``. A request ``s`` has
``P = kv_indptr[s+1]-kv_indptr[s]`` cached prefix keys in the pool and
``E = qo_indptr[s+1]-qo_indptr[s]`` new tokens. Prefix keys sit in the pool rotated at the
position they were computed at, ``stored_positions[slot]``; prefix key ``n`` is read at ``n`` and
turned by ``n - stored_positions[slot]`` in registers (no table row for keys that did not move).
The new keys and the queries arrive rotated at their positions by the model (new key ``n`` at
``P + n``) and are used as they are. This covers plain prefill (``P = 0``), prefix-cache hits,
chunked prefill (earlier chunks are the prefix) and a prompt after a span reused at an offset.

Grid ``requests x q_heads x (ceil(max E / BLOCK_M) * splits)``; each program keeps an online
softmax over its share of the prefix tiles (gathered through ``kv_indices``, turned in registers)
and, in the last split, over the causal new-key tiles. ``splits`` > 1 when that grid would
otherwise leave most of the GPU idle - a few new tokens after a long cached prefix, which is
every request that reuses a cached span: the prefix is cut in ``splits`` ranges, each program
writes its partial output and log-sum-exp, and ``_merge_splits`` combines them (as split-KV
decode does).

    q_extend, o_extend   [new_tokens, q_heads, head_dim]
    k_extend, v_extend   [new_tokens, kv_heads, head_dim]  (k rotated at its position)
    k/v_buffer           [pool_slots, kv_heads, head_dim]  (k rotated where computed)
    stored_positions     [pool_slots] int32
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
    tanh,
)
from .rope import RotaryTable


@triton.jit
def _extend_kernel(
    Q,
    K_Ext,
    V_Ext,
    Out,
    K_Buffer,
    V_Buffer,
    qo_indptr,
    kv_indptr,
    kv_indices,
    StoredPos,
    CosSin,
    sm_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ket,
    stride_keh,
    stride_vet,
    stride_veh,
    stride_ot,
    stride_oh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    stride_cs,
    Mid_O,
    Mid_Lse,
    stride_mos,
    stride_mot,
    stride_moh,
    stride_mls,
    stride_mlt,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    LV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    MAX_POS: tl.constexpr,
    SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    kv_head = head // GROUP

    q_start = tl.load(qo_indptr + seq).to(tl.int64)
    ext_len = tl.load(qo_indptr + seq + 1) - q_start
    kv_start = tl.load(kv_indptr + seq)
    pre_len = tl.load(kv_indptr + seq + 1) - kv_start
    if block_m * BLOCK_M >= ext_len:
        return

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, HALF_P)
    mask_d = offs_d < HALF
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < LV

    q_off = (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q_mask = mask_m[:, None] & mask_d[None, :]
    q1 = tl.load(Q + q_off, mask=q_mask, other=0.0)
    q2 = tl.load(Q + q_off + HALF, mask=q_mask, other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    e_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    e_sum = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Stage 1: this split's range of the cached prefix, gathered through kv_indices, turned to
    # its index n.
    per_split = tl.cdiv(tl.cdiv(pre_len, SPLITS), BLOCK_N) * BLOCK_N
    pre_lo = split * per_split
    pre_hi = tl.minimum(pre_lo + per_split, pre_len)
    kb_base = kv_head * stride_kbh + offs_d[:, None]
    vb_base = kv_head * stride_vbh + offs_dv[None, :]
    for n0 in range(pre_lo, pre_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < pre_hi
        loc = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        k_mask = mask_n[None, :] & mask_d[:, None]
        k_off = loc[None, :] * stride_kbt + kb_base
        k1 = tl.load(K_Buffer + k_off, mask=k_mask, other=0.0)
        k2 = tl.load(K_Buffer + k_off + HALF, mask=k_mask, other=0.0)
        # rotated where computed: turn by the distance moved (table read only if it moved)
        cos, sin = shift_cos_sin(offs_n, loc, mask_n, offs_d, mask_d, StoredPos, CosSin,
                                 stride_cs, HALF, MAX_POS)
        qk = rotated_scores(q1, q2, k1, k2, cos, sin, sm_scale, LOGIT_CAP)
        qk = tl.where(mask_m[:, None] & mask_n[None, :], qk, float("-inf"))
        v = tl.load(
            V_Buffer + loc[:, None] * stride_vbt + vb_base,
            mask=mask_n[:, None] & mask_dv[None, :],
            other=0.0,
        )
        acc, e_max, e_sum = online_softmax_step(qk, v, acc, e_max, e_sum)

    # Stage 2 (the last split): the new tokens, contiguous, causal, rotated by the model at
    # pre_len + n.
    if IS_CAUSAL:
        ext_end = tl.minimum(ext_len, (block_m + 1) * BLOCK_M)
    else:
        ext_end = ext_len
    ext_end = tl.where(split == SPLITS - 1, ext_end, 0)
    ke_base = kv_head * stride_keh + offs_d[:, None]
    ve_base = kv_head * stride_veh + offs_dv[None, :]
    for n0 in range(0, ext_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ext_end
        k_mask = mask_n[None, :] & mask_d[:, None]
        k_off = (q_start + offs_n)[None, :] * stride_ket + ke_base
        k1 = tl.load(K_Ext + k_off, mask=k_mask, other=0.0)
        k2 = tl.load(K_Ext + k_off + HALF, mask=k_mask, other=0.0)
        qk = tl.dot(q1, k1.to(q1.dtype)) + tl.dot(q2, k2.to(q2.dtype))
        qk *= sm_scale
        if LOGIT_CAP > 0:
            qk = LOGIT_CAP * tanh(qk / LOGIT_CAP)
        valid = mask_m[:, None] & mask_n[None, :]
        if IS_CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        qk = tl.where(valid, qk, float("-inf"))
        v = tl.load(
            V_Ext + (q_start + offs_n)[:, None] * stride_vet + ve_base,
            mask=mask_n[:, None] & mask_dv[None, :],
            other=0.0,
        )
        acc, e_max, e_sum = online_softmax_step(qk, v, acc, e_max, e_sum)

    if SPLITS == 1:
        o_off = (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_dv[None, :]
        out = acc / e_sum[:, None] * v_scale
        tl.store(Out + o_off, out.to(Out.dtype.element_ty),
                 mask=mask_m[:, None] & mask_dv[None, :])
    else:
        # a split that saw no key (a short prefix) leaves weight zero: lse -inf, output 0
        seen = e_sum > 0
        part = tl.where(seen[:, None], acc / tl.where(seen, e_sum, 1.0)[:, None], 0.0)
        lse = tl.where(seen, e_max + tl.log(tl.where(seen, e_sum, 1.0)), float("-inf"))
        tok = q_start + offs_m
        mo = split * stride_mos + tok[:, None] * stride_mot + head * stride_moh + offs_dv[None, :]
        tl.store(Mid_O + mo, part, mask=mask_m[:, None] & mask_dv[None, :])
        tl.store(Mid_Lse + split * stride_mls + tok * stride_mlt + head, lse, mask=mask_m)


@triton.jit
def _merge_splits(
    Mid_O,
    Mid_Lse,
    Out,
    v_scale,
    stride_mos,
    stride_mot,
    stride_moh,
    stride_mls,
    stride_mlt,
    stride_ot,
    stride_oh,
    SPLITS: tl.constexpr,
    LV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Out[t, h] = the splits' partial outputs weighted by their softmax mass (log-sum-exp)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < LV
    e_max = -float("inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s in range(SPLITS):
        lse = tl.load(Mid_Lse + s * stride_mls + tok * stride_mlt + head)
        if lse > float("-inf"):
            part = tl.load(Mid_O + s * stride_mos + tok * stride_mot + head * stride_moh
                           + offs_dv, mask=mask_dv, other=0.0)
            acc, e_sum, e_max = merge_partial(acc, e_sum, e_max, part, lse)
    tl.store(Out + tok * stride_ot + head * stride_oh + offs_dv,
             (acc / e_sum * v_scale).to(Out.dtype.element_ty), mask=mask_dv)


MAX_PREFIX_SPLITS = 16


def prefix_splits(programs: int, device: torch.device) -> int:
    """How many ranges to cut the prefix in so that the grid fills about two waves of the GPU's
    SMs (1 when ``programs`` already does, and on CPU)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_PREFIX_SPLITS, (2 * sms) // max(programs, 1)))


def _block_sizes(head_dim: int, is_cuda: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps); Hopper-sized tiles as in SGLang's extend kernel."""
    if not is_cuda:
        return 16, 16, 4
    major, _ = torch.cuda.get_device_capability()
    if major >= 9 and head_dim <= 128:
        return 128, 64, 8
    if major >= 8 and head_dim <= 128:
        return 64, 64, 4 if head_dim <= 64 else 8
    return 64, 64, 8 if head_dim > 64 else 4


def rotating_extend_attention_fwd(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor | None,
    is_causal: bool,
    mask_indptr: torch.Tensor | None,
    max_len_extend: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    sliding_window_size: int = -1,
    sinks: torch.Tensor | None = None,
    window_kv_offsets: torch.Tensor | None = None,
    xai_temperature_len: int = -1,
    page_size: int = 1,
    score_mod=None,
    aux_tensors=None,
    extend_seq_lens_cpu=None,
    identity_kv_indices: bool = False,
    *,
    rope: RotaryTable,
    stored_positions: torch.Tensor,
    splits: int | None = None,
) -> None:
    """Extend attention over keys in the shifted layout; writes ``o_extend``. See the module
    docstring.

    ``rope``: the model's RoPE table (row ``p`` turns a key by ``p``). ``stored_positions``: int32
    ``[pool_slots]``, the position each slot's key was rotated at. ``splits``: ranges the prefix
    is cut in (default: :func:`prefix_splits`).

    Takes SGLang's ``extend_attention_fwd`` arguments; custom masks (speculative verify), sliding
    windows, sinks, score mods and xai temperature are refused by the backend at start. A
    prefix gathered into a dense buffer (SGLang 0.5.23's ``identity_kv_indices``) is refused
    here: its slots are the buffer's, not the pool's, so no stored position describes them.
    ``extend_seq_lens_cpu`` (0.5.23: a host copy SGLang's kernel sizes its launch with) is not
    needed.
    """
    assert custom_mask is None and sinks is None and score_mod is None, (
        "rotating extend attention: custom masks / sinks / score_mod are not supported"
    )
    assert not identity_kv_indices, (
        "rotating extend attention: a prefix in a dense buffer (identity_kv_indices) has no "
        "stored positions")
    assert (sliding_window_size is None or sliding_window_size < 0) and xai_temperature_len <= 0
    del mask_indptr, window_kv_offsets, page_size, aux_tensors, extend_seq_lens_cpu
    head_dim = q_extend.shape[-1]
    q_heads, kv_heads = q_extend.shape[1], k_extend.shape[1]
    lv = v_extend.shape[-1]
    assert head_dim == rope.head_dim and head_dim % 2 == 0, (head_dim, rope.head_dim)
    assert stored_positions.dtype == torch.int32 and stored_positions.numel() >= k_buffer.shape[0]
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    half = head_dim // 2
    half_p = max(16, next_pow2(half))
    is_cuda = q_extend.is_cuda
    block_m, block_n, num_warps = _block_sizes(head_dim, is_cuda)
    batch = qo_indptr.shape[0] - 1
    launch = {"num_warps": num_warps, "num_stages": 1} if is_cuda else {}

    m_blocks = triton.cdiv(max_len_extend, block_m)
    if splits is None:
        splits = prefix_splits(batch * q_heads * m_blocks, q_extend.device)
    if splits > 1:
        n_new = q_extend.shape[0]
        mid_o = torch.empty((splits, n_new, q_heads, lv), dtype=torch.float32,
                            device=q_extend.device)
        mid_lse = torch.empty((splits, n_new, q_heads), dtype=torch.float32,
                              device=q_extend.device)
    else:  # not read: the kernel writes o_extend itself
        mid_o = mid_lse = o_extend
    mid_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
                   mid_lse.stride(1)) if splits > 1 else (0, 0, 0, 0, 0)
    grid = (batch, q_heads, m_blocks * splits)
    _extend_kernel[grid](
        q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
        qo_indptr, kv_indptr, kv_indices, stored_positions,
        rope.cos_sin_cache, sm_scale * k_scale, v_scale,
        q_extend.stride(0), q_extend.stride(1), k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), o_extend.stride(0), o_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        rope.cos_sin_cache.stride(0), mid_o, mid_lse, *mid_strides,
        GROUP=q_heads // kv_heads, HALF=half, HALF_P=half_p, LV=lv,
        BLOCK_DV=next_pow2(lv), BLOCK_M=block_m, BLOCK_N=block_n,
        LOGIT_CAP=float(logit_cap), IS_CAUSAL=bool(is_causal), MAX_POS=rope.max_positions,
        SPLITS=splits,
        **launch,
    )
    if splits > 1:
        _merge_splits[(q_extend.shape[0], q_heads)](
            mid_o, mid_lse, o_extend, v_scale, *mid_strides,
            o_extend.stride(0), o_extend.stride(1),
            SPLITS=splits, LV=lv, BLOCK_DV=next_pow2(lv),
        )
