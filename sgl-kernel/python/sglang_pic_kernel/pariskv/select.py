"""ParisKV top-k selection for one decode step: query tables, collision votes, candidate pruning,
RSQ-IP rerank. All launches have fixed grids and write preallocated buffers (CUDA-graph safe).

Shapes (``G = q_heads / kv_heads`` query heads share one KV head and vote together):

    q          [batch, q_heads, D]
    table      [batch, q_heads, B, 16]  fp32  vote of each of the 16 centroids per subspace
    qt         [batch, q_heads, 4 * B]  fp32  rotated normalised query, coordinate 4b+j at j*B+b
    qnorm      [batch, q_heads]         fp32
    centroid / codes / weights: [batch, kv_heads, N, ...]  (``encode``)
    n_ret      [batch] int32            keys in each sequence's retrieval region
    bins       [batch, kv_heads, N] int32, hist [batch, kv_heads, NBINS] int32
    cand       [batch, kv_heads, C] int32 candidate key ids (-1 = none), C = candidate budget
    est        [batch, kv_heads, C] fp32  RSQ-IP estimate of q.k (max over the group)

Pruning keeps the ``need = min(C, n_ret)`` best keys by vote without sorting: votes are binned
(tiered votes are small integers, their bin is the vote; similarity votes are binned over their
range), a per-block histogram is added up with atomics, one program per head finds the threshold
bin from the cumulative histogram, and a compaction pass writes every key above it and the first
keys at it (atomic counters; which keys *at* the threshold bin are kept is unspecified).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

NBINS = 1024


@triton.jit
def _rotated_part(q, Rt, offs_d, offs_b, J: tl.constexpr, D: tl.constexpr):
    r = tl.load(Rt + offs_d[:, None] * D + (offs_b * 4 + J)[None, :])
    return tl.sum(q[:, None] * r, axis=0)  # [B]: rotated coordinate 4b+J


@triton.jit
def _centroid_sim(qj, c, J: tl.constexpr):
    """[B, 16]: part J of the similarity of each subspace to each centroid (+-1/2 per bit)."""
    sign = (((c >> J) & 1) * 2 - 1).to(tl.float32)
    return 0.5 * qj[:, None] * sign[None, :]


@triton.jit
def _query_kernel(Q, Rt, Tiers, Table, Qt, Qnorm, stride_qb, stride_qh,
                  D: tl.constexpr, B: tl.constexpr, SIMILARITY: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    offs_d = tl.arange(0, D)
    offs_b = tl.arange(0, B)
    c = tl.arange(0, 16)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d).to(tl.float32)
    row = b * heads + h
    q0 = _rotated_part(q, Rt, offs_d, offs_b, 0, D)
    q1 = _rotated_part(q, Rt, offs_d, offs_b, 1, D)
    q2 = _rotated_part(q, Rt, offs_d, offs_b, 2, D)
    q3 = _rotated_part(q, Rt, offs_d, offs_b, 3, D)
    norm = tl.sqrt(tl.maximum(tl.sum(q0 * q0 + q1 * q1 + q2 * q2 + q3 * q3, axis=0), 1e-24))
    tl.store(Qnorm + row, norm)
    q0, q1, q2, q3 = q0 / norm, q1 / norm, q2 / norm, q3 / norm
    out = Qt + row * 4 * B + offs_b
    tl.store(out, q0)
    tl.store(out + B, q1)
    tl.store(out + 2 * B, q2)
    tl.store(out + 3 * B, q3)
    sim = (_centroid_sim(q0, c, 0) + _centroid_sim(q1, c, 1) + _centroid_sim(q2, c, 2)
           + _centroid_sim(q3, c, 3))
    if SIMILARITY:
        table = sim
    else:
        # rank of each centroid among the 16 of its subspace (ties: lower id first)
        other = sim[:, None, :]
        mine = sim[:, :, None]
        beats = (other > mine) | ((other == mine) & (c[None, None, :] < c[None, :, None]))
        rank = tl.sum(beats.to(tl.int32), axis=2)
        table = tl.load(Tiers + rank)
    tl.store(Table + row * B * 16 + offs_b[:, None] * 16 + c[None, :], table)


@triton.jit
def _vote_kernel(Cent, Table, Qs, NRet, Bins, Hist,
                 stride_cb, stride_ch, stride_cn, N, SPAN,
                 lo, scale,
                 B: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr,
                 SIMILARITY: tl.constexpr):
    """Votes of the keys ``[pid * SPAN, (pid + 1) * SPAN)`` of one KV head. The histogram is
    accumulated in registers over the whole span and added to the global one once, so the
    atomics per key stay far below one (``NB`` per ``SPAN`` keys)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    kv_heads = tl.num_programs(1)
    n_ret = tl.load(NRet + b)
    start = pid * SPAN
    if start < n_ret:
        end = tl.minimum(start + SPAN, n_ret)
        offs_b = tl.arange(0, B)
        local = tl.zeros([NB], dtype=tl.int32)
        pad = 0
        if SIMILARITY:
            # sum_g table[g, b, cent_b] is linear in the key's sign bits: with qs = sum_g q~_g
            # it is sum_{b,j} qs[4b+j] * bit_j(cent_b) - sum(qs) / 2, four multiply-adds per
            # subspace instead of G table gathers
            qrow = Qs + (b * kv_heads + h) * 4 * B + offs_b
            qs0 = tl.load(qrow)[None, :]
            qs1 = tl.load(qrow + B)[None, :]
            qs2 = tl.load(qrow + 2 * B)[None, :]
            qs3 = tl.load(qrow + 3 * B)[None, :]
            half_sum = 0.5 * tl.sum(qs0 + qs1 + qs2 + qs3)
        for n0 in tl.range(start, end, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            mask = rows < end
            cent = tl.load(Cent + b * stride_cb + h * stride_ch
                           + rows[:, None].to(tl.int64) * stride_cn + offs_b[None, :],
                           mask=mask[:, None], other=0).to(tl.int32)
            if SIMILARITY:
                score = tl.sum((cent & 1).to(tl.float32) * qs0
                               + ((cent >> 1) & 1).to(tl.float32) * qs1
                               + ((cent >> 2) & 1).to(tl.float32) * qs2
                               + ((cent >> 3) & 1).to(tl.float32) * qs3, axis=1) - half_sum
                bins = ((score - lo) * scale).to(tl.int32)
            else:
                score = tl.zeros([BLOCK_N], dtype=tl.float32)
                for g in tl.static_range(G):
                    row = (b * kv_heads + h) * G + g
                    t = tl.load(Table + row * B * 16 + offs_b[None, :] * 16 + cent)
                    score += tl.sum(t, axis=1)
                bins = score.to(tl.int32)
            bins = tl.minimum(tl.maximum(bins, 0), NB - 1)
            bins = tl.where(mask, bins, 0)
            tl.store(Bins + (b * kv_heads + h) * N + rows, bins, mask=mask)
            local += tl.histogram(bins, NB)
            pad += tl.sum((~mask).to(tl.int32), axis=0)
        offs = tl.arange(0, NB)
        local -= tl.where(offs == 0, pad, 0)  # padding rows were counted in bin 0
        tl.atomic_add(Hist + (b * kv_heads + h) * NB + offs, local, mask=local > 0)


@triton.jit
def _threshold_kernel(Hist, NRet, Thresh, Quota, Need, Counters, C,
                      NB: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kv_heads = tl.num_programs(1)
    r = b * kv_heads + h
    need = tl.minimum(tl.load(NRet + b), C)
    i = tl.arange(0, NB)
    rev = tl.load(Hist + r * NB + NB - 1 - i)  # rev[i]: keys in bin NB-1-i
    cum = tl.cumsum(rev, axis=0)  # keys in bins >= NB-1-i
    first = tl.min(tl.where(cum >= need, i, NB - 1), axis=0)
    above = tl.sum(tl.where(i < first, rev, 0), axis=0)
    tl.store(Thresh + r, NB - 1 - first)
    tl.store(Quota + r, need - above)
    tl.store(Need + r, need)
    tl.store(Counters + 2 * r, 0)
    tl.store(Counters + 2 * r + 1, 0)


@triton.jit
def _compact_kernel(Bins, NRet, Thresh, Quota, Need, Counters, Cand, N, C,
                    BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    kv_heads = tl.num_programs(1)
    r = b * kv_heads + h
    n_ret = tl.load(NRet + b)
    if pid * BLOCK_N < n_ret:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = rows < n_ret
        bins = tl.load(Bins + r * N + rows, mask=mask, other=-1)
        t = tl.load(Thresh + r)
        quota = tl.load(Quota + r)
        first_eq = tl.load(Need + r) - quota
        above = (bins > t) & mask
        equal = (bins == t) & mask
        n_above = tl.sum(above.to(tl.int32), axis=0)
        n_equal = tl.sum(equal.to(tl.int32), axis=0)
        base_a = tl.atomic_add(Counters + 2 * r, n_above)
        base_e = tl.atomic_add(Counters + 2 * r + 1, n_equal)
        pos_a = base_a + tl.cumsum(above.to(tl.int32), axis=0) - 1
        pos_e = base_e + tl.cumsum(equal.to(tl.int32), axis=0) - 1
        tl.store(Cand + r * C + pos_a, rows, mask=above)
        tl.store(Cand + r * C + first_eq + pos_e, rows, mask=equal & (pos_e < quota))


@triton.jit
def _rerank_kernel(Cand, Need, Codes, W, Qt, Qnorm, Levels, Est,
                   stride_ob, stride_oh, stride_on, stride_wb, stride_wh, stride_wn, C,
                   B: tl.constexpr, G: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    kv_heads = tl.num_programs(1)
    r = b * kv_heads + h
    slots = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    need = tl.load(Need + r)
    valid = slots < need
    idx = tl.load(Cand + r * C + slots, mask=valid, other=0).to(tl.int64)
    offs_b = tl.arange(0, B)
    base = Codes + b * stride_ob + h * stride_oh + idx[:, None] * stride_on + 2 * offs_b[None, :]
    byte0 = tl.load(base, mask=valid[:, None], other=0).to(tl.int32)
    byte1 = tl.load(base + 1, mask=valid[:, None], other=0).to(tl.int32)
    w = tl.load(W + b * stride_wb + h * stride_wh + idx[:, None] * stride_wn + offs_b[None, :],
                mask=valid[:, None], other=0.0).to(tl.float32)
    v0 = (1.0 - 2.0 * ((byte0 >> 3) & 1).to(tl.float32)) * tl.load(Levels + (byte0 & 7))
    v1 = (1.0 - 2.0 * ((byte0 >> 7) & 1).to(tl.float32)) * tl.load(Levels + ((byte0 >> 4) & 7))
    v2 = (1.0 - 2.0 * ((byte1 >> 3) & 1).to(tl.float32)) * tl.load(Levels + (byte1 & 7))
    v3 = (1.0 - 2.0 * ((byte1 >> 7) & 1).to(tl.float32)) * tl.load(Levels + ((byte1 >> 4) & 7))
    best = tl.full([BLOCK_C], float("-inf"), dtype=tl.float32)
    for g in tl.static_range(G):
        qrow = r * G + g
        q_base = Qt + qrow * 4 * B + offs_b
        inner = (v0 * tl.load(q_base)[None, :] + v1 * tl.load(q_base + B)[None, :]
                 + v2 * tl.load(q_base + 2 * B)[None, :] + v3 * tl.load(q_base + 3 * B)[None, :])
        est = tl.load(Qnorm + qrow) * tl.sum(w * inner, axis=1)
        best = tl.maximum(best, est)
    tl.store(Est + r * C + slots, tl.where(valid, best, float("-inf")), mask=slots < C)


class Selector:
    """Buffers and launches of one decode step's selection, for fixed
    ``(batch, q_heads, kv_heads, D)``, key capacity ``N``, candidate budget ``C`` and ``k``.

    ``similarity=True`` votes every key its centroid's similarity to the query (measured better
    recall on real heads); otherwise the paper's tiered integer votes (``tiers``: weight of the
    query's 1st, 2nd, ... centroid; up to 16)."""

    def __init__(self, batch: int, q_heads: int, kv_heads: int, d: int, n: int, c: int, k: int,
                 tiers: tuple[int, ...] = (4, 3, 3, 2, 2, 2, 1, 1), similarity: bool = True,
                 device: torch.device | str = "cuda", block_n: int = 256, block_c: int = 64,
                 span: int | None = None):
        if q_heads % kv_heads:
            raise ValueError("q_heads must be a multiple of kv_heads")
        if len(tiers) > 16:
            raise ValueError("at most 16 tiers (one per centroid)")
        self.batch, self.q_heads, self.kv_heads, self.d = batch, q_heads, kv_heads, d
        self.B, self.G, self.N, self.C, self.k = d // 4, q_heads // kv_heads, n, c, min(k, c)
        self.similarity, self.block_n, self.block_c = similarity, block_n, block_c
        # keys per vote program: about 64 programs per KV head and sequence, whatever N is
        self.span = span or max(block_n, triton.next_power_of_2(triton.cdiv(n, 64)))
        self.compact_block = max(block_n, min(1024, triton.next_power_of_2(triton.cdiv(n, 64))))
        dev = device
        self.tiers = torch.zeros(16, dtype=torch.float32, device=dev)
        self.tiers[: len(tiers)] = torch.tensor(tiers, dtype=torch.float32)
        if not similarity and self.G * self.B * max(tiers) >= NBINS:
            raise ValueError("tiered votes exceed the histogram range")
        f32, i32 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int32, device=dev)
        self.table = torch.empty(batch, q_heads, self.B, 16, **f32)
        self.qt = torch.empty(batch, q_heads, d, **f32)
        self.qs = torch.empty(batch, kv_heads, d, **f32)  # sum of qt over each group
        self.qnorm = torch.empty(batch, q_heads, **f32)
        self.bins = torch.empty(batch, kv_heads, n, **i32)
        self.hist = torch.zeros(batch, kv_heads, NBINS, **i32)
        self.thresh = torch.empty(batch, kv_heads, **i32)
        self.quota = torch.empty(batch, kv_heads, **i32)
        self.need = torch.empty(batch, kv_heads, **i32)
        self.counters = torch.empty(batch, kv_heads, 2, **i32)
        self.cand = torch.empty(batch, kv_heads, c, **i32)
        self.est = torch.empty(batch, kv_heads, c, **f32)
        # similarity votes of a KV head lie in [-R, R], R = 0.5 * G * ||q~||_1 <= 0.5 G sqrt(D);
        # binned over the typical extreme 0.5 * G * E||q~||_1 = 0.5 G sqrt(2 D / pi)
        r = 0.5 * self.G * math.sqrt(2 * d / math.pi)
        self.lo, self.scale = -r, NBINS / (2 * r)

    def __call__(self, q: torch.Tensor, rt: torch.Tensor, levels: torch.Tensor,
                 centroid: torch.Tensor, codes: torch.Tensor, weights: torch.Tensor,
                 n_ret: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, k]`` int32 ids of the selected keys in each sequence's retrieval
        region (-1 where it holds fewer than ``k`` keys)."""
        bsz, hq, d = q.shape
        B, G, N, C = self.B, self.G, self.N, self.C
        _query_kernel[(bsz, hq)](q, rt, self.tiers, self.table, self.qt, self.qnorm,
                                 q.stride(0), q.stride(1), D=d, B=B,
                                 SIMILARITY=self.similarity)
        torch.sum(self.qt.view(bsz, self.kv_heads, G, d), dim=2, out=self.qs)
        self.hist.zero_()
        _vote_kernel[(triton.cdiv(N, self.span), self.kv_heads, bsz)](
            centroid, self.table, self.qs, n_ret, self.bins, self.hist,
            centroid.stride(0), centroid.stride(1), centroid.stride(2), N, self.span,
            self.lo, self.scale, B=B, G=G, NB=NBINS, BLOCK_N=self.block_n,
            SIMILARITY=self.similarity)
        grid_n = (triton.cdiv(N, self.compact_block), self.kv_heads, bsz)
        _threshold_kernel[(bsz, self.kv_heads)](self.hist, n_ret, self.thresh, self.quota,
                                                self.need, self.counters, C, NB=NBINS)
        self.cand.fill_(-1)
        _compact_kernel[grid_n](self.bins, n_ret, self.thresh, self.quota, self.need,
                                self.counters, self.cand, N, C, BLOCK_N=self.compact_block)
        _rerank_kernel[(triton.cdiv(C, self.block_c), self.kv_heads, bsz)](
            self.cand, self.need, codes, weights, self.qt, self.qnorm, levels, self.est,
            codes.stride(0), codes.stride(1), codes.stride(2),
            weights.stride(0), weights.stride(1), weights.stride(2), C,
            B=B, G=G, BLOCK_C=self.block_c)
        top = self.est.topk(self.k, dim=-1)
        sel = self.cand.gather(2, top.indices)
        return torch.where(torch.isfinite(top.values), sel, -1)
