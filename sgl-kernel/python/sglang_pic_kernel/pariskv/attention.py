"""Sparse decode attention: sink + local window (GPU) and the retrieved keys (host memory).

    q          [batch, q_heads, D]
    k_win/v_win [batch, kv_heads, W, D]  GPU: the sink tokens and the local window (any order:
                                        keys are post-RoPE), ``win_len[batch]`` valid rows
    k_host/v_host [batch, kv_heads, N, D] the retrieval region, in **pinned host memory**: the
                                        kernel reads the selected rows itself over PCIe (mapped
                                        memory, no copy orchestrated by the CPU)
    sel        [batch, kv_heads, k] int32 selected rows of the retrieval region (-1: none)
    out        [batch, q_heads, D]

Stage 1 (grid ``batch x kv_heads x splits``): the first ``ceil(W / CHUNK)`` splits attend over
window chunks, the rest over chunks of the selected rows; each writes a partial output and its
log-sum-exp for the ``G`` query heads of its KV head (padded to 16 rows for ``tl.dot``).
Stage 2 merges the partials by log-sum-exp, which is exact: softmax over the union of disjoint
key sets.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 16


@triton.jit
def _partial_kernel(Q, KW, VW, WinLen, KH, VH, Sel, MidO, MidL, sm_scale,
                    stride_qb, stride_qh,
                    stride_wb, stride_wh, stride_wt,
                    stride_hb, stride_hh, stride_ht,
                    K_SEL, S_WIN,
                    G: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kv_heads = tl.num_programs(1)
    splits = tl.num_programs(2)
    lane = tl.arange(0, BLOCK_H)
    mask_h = lane < G
    heads = h * G + lane
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    if s < S_WIN:
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, tl.load(WinLen + b))
        kbase = KW + b * stride_wb + h * stride_wh
        vbase = VW + b * stride_wb + h * stride_wh
        stride_t = stride_wt
    else:
        start = (s - S_WIN) * CHUNK
        end = tl.minimum(start + CHUNK, K_SEL)
        kbase = KH + b * stride_hb + h * stride_hh
        vbase = VH + b * stride_hb + h * stride_hh
        stride_t = stride_ht
    for t0 in tl.range(start, end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        valid = offs_t < end
        if s < S_WIN:
            rows = offs_t.to(tl.int64)
        else:
            rows = tl.load(Sel + (b * kv_heads + h) * K_SEL + offs_t, mask=valid, other=-1)
            valid = valid & (rows >= 0)
            rows = tl.maximum(rows, 0).to(tl.int64)
        k = tl.load(kbase + rows[None, :] * stride_t + offs_d[:, None], mask=valid[None, :],
                    other=0.0)  # [D, BLOCK_T]
        qk = tl.dot(q, k.to(q.dtype)) * sm_scale  # [BLOCK_H, BLOCK_T]
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        v = tl.load(vbase + rows[:, None] * stride_t + offs_d[None, :], mask=valid[:, None],
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    lse = tl.where(denom > 0, m + tl.log(tl.maximum(denom, 1e-30)), float("-inf"))
    out = acc / tl.maximum(denom, 1e-30)[:, None]
    row = (b * kv_heads * G + heads) * splits + s
    tl.store(MidO + row[:, None] * D + offs_d[None, :], out, mask=mask_h[:, None])
    tl.store(MidL + row, lse, mask=mask_h)


@triton.jit
def _merge_kernel(MidO, MidL, Out, stride_ob, stride_oh, SPLITS: tl.constexpr,
                  SPLITS_P: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    row = b * heads + h
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, D)
    lse = tl.load(MidL + row * SPLITS + offs_s, mask=offs_s < SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m))
    o = tl.load(MidO + (row * SPLITS + offs_s[:, None]) * D + offs_d[None, :],
                mask=offs_s[:, None] < SPLITS, other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


class SparseAttention:
    """Scratch buffers and launches for fixed ``(batch, q_heads, kv_heads, D)``, window
    capacity ``W`` and ``k`` selected keys."""

    def __init__(self, batch: int, q_heads: int, kv_heads: int, d: int, w: int, k: int,
                 device: torch.device | str = "cuda", chunk: int = 256, block_t: int = 32):
        if q_heads // kv_heads > BLOCK_H:
            raise ValueError(f"at most {BLOCK_H} query heads per KV head")
        self.G, self.d, self.k, self.chunk, self.block_t = q_heads // kv_heads, d, k, chunk, block_t
        self.s_win = triton.cdiv(w, chunk)
        self.splits = self.s_win + triton.cdiv(k, chunk)
        self.mid_o = torch.empty(batch, q_heads, self.splits, d, dtype=torch.float32,
                                 device=device)
        self.mid_l = torch.empty(batch, q_heads, self.splits, dtype=torch.float32, device=device)

    def __call__(self, q, k_win, v_win, win_len, k_host, v_host, sel, out, sm_scale: float):
        bsz, hq, d = q.shape
        kv_heads = k_win.shape[1]
        if k_win.stride() != v_win.stride() or k_host.stride() != v_host.stride():
            raise ValueError("K and V buffers need the same layout")
        _partial_kernel[(bsz, kv_heads, self.splits)](
            q, k_win, v_win, win_len, k_host, v_host, sel, self.mid_o, self.mid_l, sm_scale,
            q.stride(0), q.stride(1), k_win.stride(0), k_win.stride(1), k_win.stride(2),
            k_host.stride(0), k_host.stride(1), k_host.stride(2), sel.shape[-1], self.s_win,
            G=self.G, D=d, CHUNK=self.chunk, BLOCK_T=self.block_t, BLOCK_H=BLOCK_H)
        sp = self.splits
        _merge_kernel[(bsz, hq)](self.mid_o, self.mid_l, out, out.stride(0), out.stride(1),
                                 SPLITS=sp, SPLITS_P=triton.next_power_of_2(sp), D=d)
        return out
