"""ParisKV top-k selection for one decode step: query tables, collision votes, candidate pruning,
RSQ-IP rerank. All launches have fixed grids and write preallocated buffers (CUDA-graph safe).

Shapes (``G = q_heads / kv_heads`` query heads share one KV head and vote together, ``W = D/32``):

    q          [batch, q_heads, D]
    table      [batch, q_heads, B, 16]  fp32  tiered vote of each of the 16 centroids per subspace
    qt         [batch, q_heads, 4 * B]  fp32  rotated normalised query, coordinate 4b+j at j*B+b
    qnorm      [batch, q_heads]         fp32
    planes     [batch, kv_heads, P, W]  int32 bit planes of the group's summed query, quantised
    params     [batch, kv_heads, 3]     fp32  (step, half sum + histogram floor,
                                              bins per vote unit)
    centroid / codes / weights: [batch, kv_heads, N, ...]  (``encode``; ids packed, D bits/key)
    bit_counts [batch, kv_heads, D]     int32 keys with each rotated coordinate's sign bit set
    n_ret      [batch] int32            keys in each sequence's retrieval region
    bins       [batch, kv_heads, N] int16, hist [batch, kv_heads, nbins] int32
    cand       [batch, kv_heads, C] int32 candidate key ids (-1 = none), C = candidate budget
    est        [batch, kv_heads, C] fp32  RSQ-IP estimate of q.k (max over the group)

Similarity votes (the default) give each key the sum over the group of its centroids'
similarity to the query, which is linear in the key's D sign bits: ``sum_i bit_i qs_i - sum(qs)/2``
with ``qs`` the group's summed rotated query. ``qs`` is quantised to signed ``P``-bit levels
(``PLANES = 6``: ``step = max|qs| / 31``, two's complement planes), so the vote is ``step *
(sum_{p<P-1} 2^p popc(K & plane_p) - 2^(P-1) popc(K & plane_{P-1})) - sum(qs)/2``: 24 popcounts
per key of head dim 128 instead of 128 multiply-adds (error below ``step / 2`` per set bit;
signed levels need no zero point, whose term would cost a popcount of the key itself). Six bits
because the vote passes are popcount-bound and six select about as well as eight on real keys
(``benchmark/sparse/bench_selector_recall.py`` compares plane counts against the reference).
Tiered votes (the paper's) look up each subspace's centroid in the query's tier table.

Pruning keeps the ``need = min(C, n_ret)`` best keys by vote without sorting: votes are binned
(tiered votes are small integers, their bin is the vote; similarity votes as below), a
per-program histogram in registers is added up with atomics, one program per head finds the
threshold bin from the cumulative histogram, and a compaction pass writes every key above it
and the first keys at it (atomic counters; which keys *at* the threshold bin are kept is
unspecified). Fewer bins make the in-register histogram cheaper (Triton's warp histogram costs
~``nbins / 32`` operations per key) at the price of a wider threshold bin.

Similarity votes are binned over ``[mean - 3 sd, sum|qs|/2]``: from 3 sd below the region's mean
vote to the highest vote a key can have, both known before any key is read. The mean is
``sum_i p_i qs_i - sum(qs)/2`` with ``p_i`` the share of keys whose coordinate ``i`` is positive
(``bit_counts``, kept by the encoder), and ``sd^2 ~ sum_i p_i (1 - p_i) qs_i^2`` as if the bits
were independent (an estimate: clustered keys can spread wider, so the top edge is the bound,
not a multiple of ``sd``). The range follows the region's votes because real keys share a
direction, so their votes sit far from 0: over a fixed range such as ``[0, max vote]`` all the
votes of a head can land in one bin, and pruning would keep the first ``C`` keys by position.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

NBINS = 1024  # tiered votes: up to G * B * max(tiers) must fit
SIMILARITY_BINS = 256
PLANES = 6  # bits per coordinate of the quantised group query (module doc)
VOTE_FLOOR_SD = 3.0  # similarity votes: the histogram spans [mean - 3 sd, max vote]
SAMPLE_FILL = 0.85  # sampled threshold: expected share of the budget filled by keys above it
# the sampled path's merge done by the rerank's programs (``_gather_rerank_kernel``, one launch
# fewer a layer) or by a launch of its own. Off: in the server, whose selector holds the engine's
# whole context, the gathering rerank's search over the vote programs' counts costs more than
# the launch it saves (``bench_decode.py --gather-in-rerank`` times both)
GATHER_IN_RERANK = False
# the top-k's search: thresholds counted per reduction (1 = bisection); set from
# benchmark/kernels/bench_topk.py's table, as is ``topk_warps``
TOPK_THRESHOLDS = 1
# the largest candidate block whose counts fit a 16-bit field (T > 1 packs them); the kernel
# reads it as a constexpr global
TOPK_PACKED_MAX_CP = 32768
_TOPK_PACKED_MAX_CP = tl.constexpr(TOPK_PACKED_MAX_CP)


@triton.jit
def _rotated_part(q, RtJ, offs_d, offs_b, J: tl.constexpr, D: tl.constexpr, B: tl.constexpr):
    # RtJ (``part_major_rotation``) holds column 4b+J of the rotation at J*B+b: part J's [D, B]
    # block is read in whole cache lines (the rotation's own columns 4b+J are 16 bytes apart)
    r = tl.load(RtJ + offs_d[:, None] * D + (J * B + offs_b)[None, :])
    return tl.sum(q[:, None] * r, axis=0)  # [B]: rotated coordinate 4b+J


def signed_levels(levels: torch.Tensor) -> torch.Tensor:
    """``[16]`` fp32: the value of each 4-bit code (``sign << 3 | magnitude level``) for the
    magnitude ``levels`` ``[8]``."""
    return torch.cat([levels, -levels]).float().contiguous()


def part_major_rotation(rt: torch.Tensor) -> torch.Tensor:
    """``[D, D]`` rotation with column ``4b + j`` moved to ``j * B + b`` (``B = D / 4``): the
    layout of ``qt``, so that ``_query_kernel`` reads each part's columns contiguously."""
    d = rt.shape[0]
    return rt.view(d, d // 4, 4).transpose(1, 2).reshape(d, d).contiguous()


@triton.jit
def _centroid_sim(qj, c, J: tl.constexpr):
    """[B, 16]: part J of the similarity of each subspace to each centroid (+-1/2 per bit)."""
    sign = (((c >> J) & 1) * 2 - 1).to(tl.float32)
    return 0.5 * qj[:, None] * sign[None, :]


@triton.jit
def _query_one(Q, q_row, b, RtJ, Tiers, Table, Qt, Qnorm, stride_qb, stride_qh,
               D: tl.constexpr, B: tl.constexpr, SIMILARITY: tl.constexpr):
    """Query tables of query head ``program_id(1)`` of slot ``b`` from row ``q_row`` of ``Q``."""
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    offs_d = tl.arange(0, D)
    offs_b = tl.arange(0, B)
    c = tl.arange(0, 16)
    q = tl.load(Q + q_row * stride_qb + h * stride_qh + offs_d).to(tl.float32)
    row = b * heads + h
    q0 = _rotated_part(q, RtJ, offs_d, offs_b, 0, D, B)
    q1 = _rotated_part(q, RtJ, offs_d, offs_b, 1, D, B)
    q2 = _rotated_part(q, RtJ, offs_d, offs_b, 2, D, B)
    q3 = _rotated_part(q, RtJ, offs_d, offs_b, 3, D, B)
    norm = tl.sqrt(tl.maximum(tl.sum(q0 * q0 + q1 * q1 + q2 * q2 + q3 * q3, axis=0), 1e-24))
    tl.store(Qnorm + row, norm)
    q0, q1, q2, q3 = q0 / norm, q1 / norm, q2 / norm, q3 / norm
    out = Qt + row * 4 * B + offs_b
    tl.store(out, q0)
    tl.store(out + B, q1)
    tl.store(out + 2 * B, q2)
    tl.store(out + 3 * B, q3)
    if not SIMILARITY:
        sim = (_centroid_sim(q0, c, 0) + _centroid_sim(q1, c, 1) + _centroid_sim(q2, c, 2)
               + _centroid_sim(q3, c, 3))
        # rank of each centroid among the 16 of its subspace (ties: lower id first)
        other = sim[:, None, :]
        mine = sim[:, :, None]
        beats = (other > mine) | ((other == mine) & (c[None, None, :] < c[None, :, None]))
        rank = tl.sum(beats.to(tl.int32), axis=2)
        table = tl.load(Tiers + rank)
        tl.store(Table + row * B * 16 + offs_b[:, None] * 16 + c[None, :], table)


@triton.jit(do_not_specialize=["N_ROWS"])  # the batch size: one compiled kernel for all
def _query_kernel(Q, RowOfSlot, NSel, RtJ, Tiers, Table, Qt, Qnorm, stride_qb, stride_qh,
                  N_ROWS, D: tl.constexpr, B: tl.constexpr, SIMILARITY: tl.constexpr,
                  Q_ROWS: tl.constexpr):
    """Query tables of slot ``program_id(0)``: with ``Q_ROWS`` from its row of the decode batch,
    and nothing for an idle slot (row -1, whose region the caller gives ``n_ret`` 0: nothing
    after this kernel reads its tables) or any slot that selects nothing (``NSel`` 0).
    At batch 1 of 4 slots that is 3/4 of the programs, each reading the 64 KB rotation, beside
    the window's attention on the other graph branch."""
    b = tl.program_id(0).to(tl.int64)
    if Q_ROWS:
        slot_row = tl.load(RowOfSlot + b)
        if (slot_row >= 0) & (tl.load(NSel + b) > 0):
            _query_one(Q, tl.minimum(slot_row, N_ROWS - 1), b, RtJ, Tiers, Table, Qt, Qnorm,
                       stride_qb, stride_qh, D, B, SIMILARITY)
    elif tl.load(NSel + b) > 0:
        _query_one(Q, b, b, RtJ, Tiers, Table, Qt, Qnorm, stride_qb, stride_qh, D, B,
                   SIMILARITY)


@triton.jit
def _plane_kernel(Qt, Planes, Params, Counts, NRet, Hist, G: tl.constexpr, D: tl.constexpr,
                   B: tl.constexpr, NB: tl.constexpr, P: tl.constexpr, FLOOR_SD: tl.constexpr):
    """Bit planes of one KV head's summed query ``qs`` (coordinate order: bit ``i % 32`` of word
    ``i // 32`` of plane ``p`` is bit ``p`` of coordinate ``i``'s ``P``-bit level), and the vote
    histogram's range from the region's sign-bit counts; the head's histogram is zeroed here
    (one launch fewer than a memset). A slot with no keys this step is skipped: nothing reads
    its planes or histogram."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kv_heads = tl.num_programs(1)
    r = b * kv_heads + h
    if tl.load(NRet + b) > 0:  # an idle slot (no keys this step) votes on nothing
        tl.store(Hist + r * NB + tl.arange(0, NB), tl.zeros([NB], dtype=tl.int32))
        i = tl.arange(0, D)
        src = (i % 4) * B + i // 4  # qt keeps coordinate 4b+j at j*B+b
        qs = tl.zeros([D], dtype=tl.float32)
        for g in tl.static_range(G):
            qs += tl.load(Qt + (r * G + g) * D + src)
        # signed levels in [-(2^(P-1) - 1), 2^(P-1) - 1], as P-bit two's complement: a vote needs
        # no zero-point term (the key's own popcount)
        step = tl.maximum(tl.max(tl.abs(qs), axis=0) / (2 ** (P - 1) - 1), 1e-30)
        level = tl.floor(qs / step + 0.5).to(tl.int32)
        level = tl.minimum(tl.maximum(level, -(2 ** (P - 1) - 1)), 2 ** (P - 1) - 1) & (2**P - 1)
        level = tl.reshape(level, [D // 32, 32]).to(tl.int64)
        bit = tl.arange(0, 32).to(tl.int64)[None, :]
        words = tl.arange(0, D // 32)
        for p in tl.static_range(P):
            plane = tl.sum(((level >> p) & 1) << bit, axis=1).to(tl.int32)
            tl.store(Planes + (r * P + p) * (D // 32) + words, plane)
        half = 0.5 * tl.sum(qs, axis=0)
        max_vote = 0.5 * tl.sum(tl.abs(qs), axis=0)  # the highest vote any key can have
        # clamped: counts of a longer region than n_ret (a slot being refilled) stay a share
        p = tl.minimum(tl.load(Counts + r * D + i).to(tl.float32)
                       / tl.maximum(tl.load(NRet + b), 1).to(tl.float32), 1.0)
        mean = tl.sum(p * qs, axis=0) - half
        # floor: a region of identical sign patterns has sd 0 (every vote equal: any scale works)
        sd = tl.maximum(tl.sqrt(tl.sum(p * (1.0 - p) * qs * qs, axis=0)), 2e-6 * max_vote + 1e-30)
        tl.store(Params + r * 3, step)
        floor = mean - FLOOR_SD * sd
        tl.store(Params + r * 3 + 1, half + floor)  # the vote at bin 0's floor
        # the top edge is max_vote: nothing clamps at the top, even when a cluster of keys the
        # query favours votes far above the spread the counts suggest
        tl.store(Params + r * 3 + 2, NB / (max_vote - floor))


@triton.jit
def _program_head():
    """``(block, KV head, sequence, row)`` of a program in a ``[blocks, kv_heads, batch]`` grid;
    ``row = sequence * kv_heads + head`` indexes the per-head buffers."""
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    return tl.program_id(0), h, b, b * tl.num_programs(1) + h


@triton.jit
def _popc(x, ASM: tl.constexpr):
    """Set bits of each int32 (``popc.b32`` on NVIDIA; SWAR where inline PTX is unavailable)."""
    if ASM:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        # arithmetic shifts are safe: each mask clears the bits a sign fill could set
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        x = x + (x >> 8)
        x = x + (x >> 16)
        return x & 0x3F


@triton.jit
def _key_bins(base, rows, mask, stride_cn, Table, Planes, r, step, half, scale,
              B: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, P: tl.constexpr,
              BLOCK_N: tl.constexpr, SIMILARITY: tl.constexpr, ASM: tl.constexpr):
    """``[BLOCK_N]`` histogram bins of the votes of keys ``rows`` of one KV head (``r``).

    Similarity votes take a key's ``D / 32`` sign words one at a time, each as a ``[BLOCK_N]``
    vector ANDed with the planes' scalar words, so every value has the layout of the rows; a
    ``[BLOCK_N, P, D / 32]`` broadcast with two reductions changes layout inside the loop and
    is slower (``results/sparse_decode_h200_sweep_by_word.json``)."""
    if SIMILARITY:
        row_ptr = base + rows.to(tl.int64) * stride_cn
        dot = tl.zeros([BLOCK_N], dtype=tl.int32)
        for w in tl.static_range(B // 8):
            word = tl.load(row_ptr + w, mask=mask, other=0)
            for j in tl.static_range(P):  # bit plane j; the top one weighs -2^(P-1)
                plane = tl.load(Planes + (r * P + j) * (B // 8) + w)
                if j == P - 1:
                    dot -= _popc(word & plane, ASM) << j
                else:
                    dot += _popc(word & plane, ASM) << j
        # ``half`` holds sum(qs)/2 plus the histogram's floor: the score is the vote above it
        score = step * dot.to(tl.float32) - half
        bins = (score * scale).to(tl.int32)
    else:
        offs_b = tl.arange(0, B)
        row_base = base + rows[:, None].to(tl.int64) * stride_cn
        words = tl.load(row_base + (offs_b // 8)[None, :], mask=mask[:, None], other=0)
        cent = (words >> (4 * (offs_b % 8))[None, :]) & 15
        score = tl.zeros([BLOCK_N], dtype=tl.float32)
        for g in tl.static_range(G):
            t = tl.load(Table + (r * G + g) * B * 16 + offs_b[None, :] * 16 + cent)
            score += tl.sum(t, axis=1)
        bins = score.to(tl.int32)
    bins = tl.minimum(tl.maximum(bins, 0), NB - 1)
    return tl.where(mask, bins, 0)


@triton.jit
def _vote_params(Params, r, SIMILARITY: tl.constexpr):
    if SIMILARITY:
        return (tl.load(Params + r * 3), tl.load(Params + r * 3 + 1),
                tl.load(Params + r * 3 + 2))
    else:
        return 0.0, 0.0, 0.0


@triton.jit
def _vote_kernel(Cent, Table, Planes, Params, NRet, Bins, Hist,
                 stride_cb, stride_ch, stride_cn, N, SPAN,
                 B: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, P: tl.constexpr,
                 BLOCK_N: tl.constexpr, SIMILARITY: tl.constexpr, ASM: tl.constexpr,
                 STRIDE: tl.constexpr, STORE_BINS: tl.constexpr):
    """Histogram of the votes of keys ``STRIDE * [pid * SPAN, (pid + 1) * SPAN)`` of one KV
    head (every key with ``STRIDE = 1``, else the strided sample that sets a sampled threshold),
    and with ``STORE_BINS`` each key's bin. The histogram is accumulated in registers over the
    whole span and added to the global one once (``NB`` atomics per ``SPAN`` keys)."""
    pid, h, b, r = _program_head()
    n_rows = tl.cdiv(tl.load(NRet + b), STRIDE)
    start = pid * SPAN
    if start < n_rows:
        end = tl.minimum(start + SPAN, n_rows)
        local = tl.zeros([NB], dtype=tl.int32)
        pad = 0
        base = Cent + b * stride_cb + h * stride_ch
        step, half, scale = _vote_params(Params, r, SIMILARITY)
        for n0 in tl.range(start, end, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            mask = rows < end
            bins = _key_bins(base, rows * STRIDE, mask, stride_cn, Table, Planes, r, step,
                             half, scale, B, G, NB, P, BLOCK_N, SIMILARITY, ASM)
            if STORE_BINS:
                tl.store(Bins + r * N + rows, bins.to(tl.int16), mask=mask)
            local += tl.histogram(bins, NB)
            pad += tl.sum((~mask).to(tl.int32), axis=0)
        offs = tl.arange(0, NB)
        local -= tl.where(offs == 0, pad, 0)  # padding rows were counted in bin 0
        tl.atomic_add(Hist + r * NB + offs, local, mask=local > 0)


@triton.jit
def _vote_select_kernel(Cent, Table, Planes, Params, NRet, Hist, Thresh, Need, Kept, CountA,
                        CountE, stride_cb, stride_ch, stride_cn, N, SPAN, C, TARGET,
                        B: tl.constexpr, G: tl.constexpr, NB: tl.constexpr, P: tl.constexpr,
                        BLOCK_N: tl.constexpr, SIMILARITY: tl.constexpr, ASM: tl.constexpr):
    """Votes of the keys ``[pid * SPAN, (pid + 1) * SPAN)`` of one KV head, compared with the
    head's sampled threshold bin as they are computed: ids of keys above it are written from
    the start of the program's own region of ``Kept`` (``[pid * SPAN, min((pid+1) * SPAN, N))``),
    ids of keys at it from the region's end, with counters kept in registers - no atomics and no
    bins written. A block's two positions come from one prefix sum (above in the low 16 bits,
    at the threshold in the high ones).

    Each program reads the threshold from the sampled histogram itself (``_sampled_threshold``:
    one prefix sum over the histogram's bins, its load overlapping the first keys' loads)
    instead of a kernel of its own before this one, which at batch 1 would put a launch and
    its gap on the step's critical path in every layer. Program 0 of each head stores the threshold and the
    head's budget ``Need = min(n_ret, C)`` for the kernels after it."""
    pid, h, b, r = _program_head()
    n_ret = tl.load(NRet + b)
    start = pid * SPAN
    cnt_a = 0
    cnt_e = 0
    if (pid == 0) | (start < n_ret):
        t = _sampled_threshold(Hist, r, n_ret, C, TARGET, NB)
        if pid == 0:
            tl.store(Thresh + r, t)
            tl.store(Need + r, tl.minimum(n_ret, C))
        if start < n_ret:
            end = tl.minimum(start + SPAN, n_ret)
            top = Kept + r * N + start  # above: top[0], top[1], ...
            # at: bottom[0], bottom[-1], ...
            bottom = Kept + r * N + tl.minimum(start + SPAN, N) - 1
            base = Cent + b * stride_cb + h * stride_ch
            step, half, scale = _vote_params(Params, r, SIMILARITY)
            for n0 in tl.range(start, end, BLOCK_N):
                rows = n0 + tl.arange(0, BLOCK_N)
                mask = rows < end
                bins = _key_bins(base, rows, mask, stride_cn, Table, Planes, r, step, half,
                                 scale, B, G, NB, P, BLOCK_N, SIMILARITY, ASM)
                above = (bins > t) & mask
                equal = (bins == t) & mask
                packed = tl.cumsum(above.to(tl.int32) + (equal.to(tl.int32) << 16), axis=0)
                tl.store(top + cnt_a + (packed & 0xFFFF) - 1, rows, mask=above)
                tl.store(bottom - cnt_e - (packed >> 16) + 1, rows, mask=equal)
                last = tl.max(packed, axis=0)  # the prefix sums only grow: the block's totals
                cnt_a += last & 0xFFFF
                cnt_e += last >> 16
    tl.store(CountA + r * tl.num_programs(0) + pid, cnt_a)
    tl.store(CountE + r * tl.num_programs(0) + pid, cnt_e)


@triton.jit
def _bins_from_top(Hist, r, NB: tl.constexpr):
    """Head row ``r``'s histogram read from the top bin down: ``(i, rev, cum)`` with ``rev[i]``
    keys in bin ``NB-1-i`` and ``cum[i]`` keys in bins ``>= NB-1-i``."""
    i = tl.arange(0, NB)
    rev = tl.load(Hist + r * NB + NB - 1 - i)
    return i, rev, tl.cumsum(rev, axis=0)


@triton.jit
def _threshold_kernel(Hist, NRet, Thresh, Quota, Need, Counters, C,
                      NB: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # a [batch, kv_heads] grid
    r = b * tl.num_programs(1) + tl.program_id(1)
    n_ret = tl.load(NRet + b)
    i, rev, cum = _bins_from_top(Hist, r, NB)
    need = tl.minimum(n_ret, C)
    first = tl.min(tl.where(cum >= need, i, NB - 1), axis=0)
    above = tl.sum(tl.where(i < first, rev, 0), axis=0)
    tl.store(Thresh + r, NB - 1 - first)
    tl.store(Quota + r, need - above)
    tl.store(Need + r, need)
    tl.store(Counters + 2 * r, 0)
    tl.store(Counters + 2 * r + 1, 0)


@triton.jit
def _sampled_threshold(Hist, r, n_ret, C, TARGET, NB: tl.constexpr):
    """Threshold bin of head row ``r`` from the strided sample's histogram: the highest bin with
    at least ``TARGET`` sampled keys at or above it (``TARGET ~ SAMPLE_FILL * C / stride``, so
    the keys above it are expected to fill less than the budget and keys at it fill the rest);
    -1 (every key) when the region holds at most ``C`` keys."""
    i, _, cum = _bins_from_top(Hist, r, NB)
    first = tl.min(tl.where(cum >= TARGET, i, NB - 1), axis=0)
    return tl.where(n_ret <= C, -1, NB - 1 - first)


@triton.jit
def _kept_counts(CountA, CountE, r, nprog, C, NPROG: tl.constexpr):
    """The vote programs' kept counts of head row ``r`` as the candidate list takes them:
    ``(i, qa, ce, total_a, total_e)`` with ``i`` the programs (``NPROG`` lanes, ``nprog``
    real), ``ce`` their keys at the threshold and ``qa`` their keys above it that the list
    keeps. If the keys above overflow ``C`` (the sampled threshold was too low), each program
    keeps its share ``floor(count * C / total)``, plus one for the first programs that have
    more until the budget is full, so what is dropped is spread over the whole context."""
    i = tl.arange(0, NPROG)
    ca = tl.load(CountA + r * nprog + i, mask=i < nprog, other=0)
    ce = tl.load(CountE + r * nprog + i, mask=i < nprog, other=0)
    # block-wide sums are the latency here: pairs of counts go through one int64 sum (keys
    # above in the low 32 bits, keys at the threshold in the high ones)
    totals = tl.sum(ca.to(tl.int64) + (ce.to(tl.int64) << 32), axis=0)
    total_a = (totals & 0xFFFFFFFF).to(tl.int32)
    total_e = (totals >> 32).to(tl.int32)
    qa = ca
    if total_a > C:
        share = (ca.to(tl.int64) * C // total_a).to(tl.int32)
        # the shares' rounding left C - sum(share) places (fewer than the programs with a
        # remainder): one more key each for the first of those, in program order; the shares
        # then add up to exactly C
        short = share < ca
        rank = tl.cumsum(short.to(tl.int32), axis=0) - 1
        qa = share + (short & (rank < C - tl.sum(share, axis=0))).to(tl.int32)
    return i, qa, ce, total_a, total_e


@triton.jit
def _merge_kernel(Kept, CountA, CountE, Cand, NRet, N, C, SPAN,
                  NPROG: tl.constexpr, BLOCK: tl.constexpr, REUSE: tl.constexpr = False):
    """Candidate list of one head from the vote programs' regions of ``Kept``: every program's
    keys above the threshold in program order, then keys at it up to the budget ``C``. If the
    keys above overflow ``C`` (the sampled threshold was too low), each program keeps its share
    ``floor(count * C / total)``, plus one for the first programs that have more until the
    budget is full, so what is dropped is spread over the whole context (``_kept_counts``).

    ``REUSE`` (``--sparse-vote-interval``): ``Cand`` is the layer's own list, which a slot not
    voting this step (``NRet`` 0) reranks again, so nothing of it is written."""
    p, h, b, r = _program_head()
    n_ret = tl.load(NRet + b)
    # programs past the region hold no keys; an idle slot (no keys this step) keeps only
    # program 0, which writes its empty list (-1), so the top-k selects nothing there
    first = p == 0
    if REUSE:
        first = first & (n_ret > 0)
    if first | (p * SPAN < n_ret):
        nprog = tl.num_programs(0)
        i, qa, ce, total_a, total_e = _kept_counts(CountA, CountE, r, nprog, C, NPROG)
        my_a = tl.load(CountA + r * nprog + p)  # its own count, unless the budget overflows
        if total_a > C:
            my_a = tl.sum(tl.where(i == p, qa, 0), axis=0)
        kept_a = tl.minimum(total_a, C)
        before = tl.sum(tl.where(i < p, qa.to(tl.int64) + (ce.to(tl.int64) << 32), 0), axis=0)
        pre_a = (before & 0xFFFFFFFF).to(tl.int32)
        pre_e = (before >> 32).to(tl.int32)
        my_e = tl.minimum(tl.load(CountE + r * nprog + p), tl.maximum(C - kept_a - pre_e, 0))
        top = Kept + r * N + p * SPAN
        bottom = Kept + r * N + tl.minimum(p * SPAN + SPAN, N) - 1
        for j0 in tl.range(0, my_a, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            ids = tl.load(top + j, mask=j < my_a)
            tl.store(Cand + r * C + pre_a + j, ids, mask=j < my_a)
        for j0 in tl.range(0, my_e, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            ids = tl.load(bottom - j, mask=j < my_e)
            tl.store(Cand + r * C + kept_a + pre_e + j, ids, mask=j < my_e)
        if p == 0:  # the list's unfilled tail: no key (instead of a memset before the merge)
            filled = kept_a + tl.minimum(total_e, tl.maximum(C - kept_a, 0))
            for j0 in tl.range(filled, C, BLOCK):
                j = j0 + tl.arange(0, BLOCK)
                tl.store(Cand + r * C + j, tl.full([BLOCK], -1, tl.int32), mask=j < C)


@triton.jit
def _compact_kernel(Bins, NRet, Thresh, Quota, Need, Counters, Cand, N, C,
                    BLOCK_N: tl.constexpr):
    """Candidate ids of one block of keys: every key binned above the head's threshold and up to
    ``quota`` keys at it, placed by one atomic per block and a prefix sum: one atomic per kept
    key would put ``C`` atomics on one counter per head, which serialise at large budgets."""
    pid, h, b, r = _program_head()
    n_ret = tl.load(NRet + b)
    if pid * BLOCK_N < n_ret:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = rows < n_ret
        bins = tl.load(Bins + r * N + rows, mask=mask, other=-1).to(tl.int32)
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
        # by construction pos_a < first_eq and first_eq + pos_e < need <= C; the bounds are
        # checked anyway, so a histogram that disagreed with the bins could never write outside
        tl.store(Cand + r * C + pos_a, rows, mask=above & (pos_a < first_eq))
        tl.store(Cand + r * C + first_eq + pos_e, rows, mask=equal & (pos_e < quota))


@triton.jit
def _estimates(idx, valid, Codes, W, Qt, Qnorm, SignedLevels, b, h, r,
               stride_ob, stride_oh, stride_on, stride_wb, stride_wh, stride_wn,
               B: tl.constexpr, G: tl.constexpr):
    """RSQ-IP estimates ``[BLOCK]`` of keys ``idx`` (int64; rows with ``valid`` false read
    nothing and get -inf) of KV head ``h`` of sequence ``b``: the best over the head's ``G``
    query heads. A key's codes are read as ``B`` 16-bit pairs (the two bytes of subspace ``b``:
    four 4-bit codes) in one contiguous load per row; ``SignedLevels[c]`` is code ``c``'s
    dequantised value, sign included (``signed_levels``). ``stride_on`` is the codes' row stride
    in bytes (even)."""
    offs_b = tl.arange(0, B)
    pairs = (Codes + b * stride_ob + h * stride_oh).to(tl.pointer_type(tl.uint16))
    pair = tl.load(pairs + idx[:, None] * (stride_on // 2) + offs_b[None, :],
                   mask=valid[:, None], other=0).to(tl.int32)  # byte 2b | byte 2b+1 << 8
    weights = W + b * stride_wb + h * stride_wh + offs_b[None, :]
    w = tl.load(weights + idx[:, None] * stride_wn, mask=valid[:, None],
                other=0.0).to(tl.float32)
    v0 = tl.load(SignedLevels + (pair & 15))  # coordinate 4b
    v1 = tl.load(SignedLevels + ((pair >> 4) & 15))
    v2 = tl.load(SignedLevels + ((pair >> 8) & 15))
    v3 = tl.load(SignedLevels + ((pair >> 12) & 15))
    best = tl.full(idx.shape, float("-inf"), dtype=tl.float32)
    for g in tl.static_range(G):
        qrow = r * G + g
        q_base = Qt + qrow * 4 * B + offs_b
        inner = (v0 * tl.load(q_base)[None, :] + v1 * tl.load(q_base + B)[None, :]
                 + v2 * tl.load(q_base + 2 * B)[None, :]
                 + v3 * tl.load(q_base + 3 * B)[None, :])
        est = tl.load(Qnorm + qrow) * tl.sum(w * inner, axis=1)
        best = tl.maximum(best, est)
    return tl.where(valid, best, float("-inf"))


@triton.jit
def _rerank_kernel(Cand, Need, Codes, W, Qt, Qnorm, SignedLevels, Est, NKeys, NSel, Shift,
                   stride_ob, stride_oh, stride_on, stride_wb, stride_wh, stride_wn, C,
                   B: tl.constexpr, G: tl.constexpr, BLOCK_C: tl.constexpr,
                   REUSE: tl.constexpr = False):
    """RSQ-IP estimates (``_estimates``) of the candidates in a block of one KV head's list.

    ``REUSE`` (``--sparse-vote-interval``): a slot that did not vote this step (``NSel`` 0,
    ``NKeys`` > 0) reranks its last vote's whole list, each id moved on by ``Shift`` rows (the
    steps since the vote, as a copying head reads on); ids moved past ``NKeys`` (into the dense
    window) get -inf."""
    pid, h, b, r = _program_head()
    slots = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    need = tl.load(Need + r)
    shift = 0
    n_keys = 0
    if REUSE:
        n_keys = tl.load(NKeys + b)
        reuse = (tl.load(NSel + b) == 0) & (n_keys > 0)
        need = tl.where(reuse, C, need)  # Need is this step's, written for voting slots only
        shift = tl.where(reuse, tl.load(Shift + b), 0)
    # a block past the list's end holds no candidate (-1: never selected), so nothing is read
    # or written: most blocks of an idle slot (no keys this step) or of a short region
    if pid * BLOCK_C < need:
        idx = tl.load(Cand + r * C + slots, mask=slots < need, other=-1).to(tl.int64)
        valid = idx >= 0  # an unfilled slot is never read through
        if REUSE:
            idx = idx + shift
            valid = valid & (idx < n_keys)
        best = _estimates(idx, valid, Codes, W, Qt, Qnorm, SignedLevels, b, h, r,
                          stride_ob, stride_oh, stride_on, stride_wb, stride_wh, stride_wn,
                          B, G)
        tl.store(Est + r * C + slots, best, mask=slots < C)


@triton.jit
def _upper_bound(sorted_vals, x, N: tl.constexpr, STEPS: tl.constexpr):
    """For each ``x``, the first index of the nondecreasing ``sorted_vals [N]`` whose value is
    above it (``N`` if none): a bisection of ``STEPS = log2(N) + 1`` rounds, each one
    ``tl.gather`` from the register tensor (a ``[len(x), N]`` comparison spilled ~6 KB a thread
    on sm_90)."""
    lo = tl.zeros(x.shape, dtype=tl.int32)
    hi = tl.full(x.shape, N, dtype=tl.int32)
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        v = tl.gather(sorted_vals, tl.minimum(mid, N - 1), 0)
        open_ = lo < hi
        lo = tl.where(open_ & (v <= x), mid + 1, lo)
        hi = tl.where(open_ & (v > x), mid, hi)
    return lo


@triton.jit
def _gather_rerank_kernel(Kept, CountA, CountE, Cand, Est, NRet, Codes, W, Qt, Qnorm,
                          SignedLevels, stride_ob, stride_oh, stride_on, stride_wb, stride_wh,
                          stride_wn, N, C, SPAN, NPROGS, B: tl.constexpr, G: tl.constexpr,
                          NPROG: tl.constexpr, STEPS: tl.constexpr, BLOCK_C: tl.constexpr):
    """The candidates' merge and the rerank in one launch, with the rerank's even spread of
    work (``GATHER_IN_RERANK``): each program takes ``BLOCK_C`` places of its head's list, finds
    which vote program's kept key lands at each (``_merge_kernel``'s layout, from the
    ``NPROGS`` programs' counts and their prefix sums), reads those ids from ``Kept``, writes
    them to ``Cand`` and their estimates to ``Est`` (-1 and -inf past the filled places). The
    places are shared out evenly: letting each merge program rerank its own keys would give the
    programs very different amounts of work."""
    pid, h, b, r = _program_head()
    x = pid * BLOCK_C + tl.arange(0, BLOCK_C)  # this program's places in the list
    idx = tl.full([BLOCK_C], -1, dtype=tl.int32)
    if pid * BLOCK_C < tl.minimum(tl.load(NRet + b), C):
        _, qa, ce, total_a, total_e = _kept_counts(CountA, CountE, r, NPROGS, C, NPROG)
        kept_a = tl.minimum(total_a, C)
        filled = kept_a + tl.minimum(total_e, tl.maximum(C - kept_a, 0))
        # inclusive prefix sums of the kept counts above and at the threshold, as pairs
        incl = tl.cumsum(qa.to(tl.int64) + (ce.to(tl.int64) << 32), axis=0)
        incl_a = (incl & 0xFFFFFFFF).to(tl.int32)
        incl_e = (incl >> 32).to(tl.int32)
        # place x holds key j of vote program p: p is the first program whose prefix sum
        # passes x, and its keys start at the prefix sum before it
        y = x - kept_a  # place among the keys at the threshold
        is_a = x < kept_a
        p_a = _upper_bound(incl_a, x, NPROG, STEPS)
        p_e = _upper_bound(incl_e, y, NPROG, STEPS)
        j_a = x - tl.where(p_a > 0, tl.gather(incl_a, tl.maximum(p_a - 1, 0), 0), 0)
        j_e = y - tl.where(p_e > 0, tl.gather(incl_e, tl.maximum(p_e - 1, 0), 0), 0)
        region = Kept + r * N
        src = tl.where(is_a, region + p_a.to(tl.int64) * SPAN + j_a,
                       region + tl.minimum(p_e.to(tl.int64) * SPAN + SPAN, N) - 1 - j_e)
        idx = tl.load(src, mask=x < filled, other=-1)
    valid = idx >= 0
    est = _estimates(idx.to(tl.int64), valid, Codes, W, Qt, Qnorm, SignedLevels, b, h, r,
                     stride_ob, stride_oh, stride_on, stride_wb, stride_wh, stride_wn, B, G)
    tl.store(Cand + r * C + x, idx, mask=x < C)
    tl.store(Est + r * C + x, est, mask=x < C)


@triton.jit
def _packed_count(counts, J: tl.constexpr, T: tl.constexpr):
    """Count ``J`` of a top-k round's int64 sum: 16 bits each when ``T > 1``, the whole sum
    for a bisection (more than 65535 candidates run ``T = 1``)."""
    if T == 1:
        return counts.to(tl.int32)
    else:
        return ((counts >> (16 * J)) & 0xFFFF).to(tl.int32)


def topk_warps(cp: int) -> int:
    """Warps of the top-k program holding ``cp`` candidates: 8 from 4096 on (the fastest at 4096
    in ``benchmark/kernels/bench_topk.py``), 16 from 16384 (no spills), 4 for smaller lists."""
    return 4 if cp < 4096 else min(16, max(8, cp // 1024))


@triton.jit
def _store_selection(dst, ids, above, equal, pos_a, pos_e, need, K, KP: tl.constexpr):
    """The top-k's output: the ids above the threshold, the ties at it, then -1."""
    tl.store(dst + pos_a, ids, mask=above & (pos_a < need))
    tl.store(dst + pos_e, ids, mask=equal & (pos_e < need))
    j = tl.arange(0, KP)
    tl.store(dst + j, tl.full([KP], -1, tl.int32), mask=(j >= need) & (j < K))


@triton.jit
def _topk_kernel(Est, Cand, Sel, NRet, NSel, Last, Shift, C, K, CP: tl.constexpr,
                 KP: tl.constexpr, T: tl.constexpr = 1, KEEP: tl.constexpr = False,
                 REUSE: tl.constexpr = False):
    """The ids of the ``K`` best candidates of one KV head by rerank estimate, replacing
    ``torch.topk`` + ``gather`` + the validity mask (4-5 launches). The ``K``-th best estimate is
    found by a search over the estimates' bit patterns, mapped to int32 keys that order like the
    floats: each round counts the keys at or above ``T`` thresholds spread over the interval
    left (``T = 1``: a bisection), the ``T`` counts packed 16 bits apart into one int64 sum, so
    a round is one block-wide reduction that narrows the interval ``T + 1``-fold (``CP <=
    TOPK_PACKED_MAX_CP`` for ``T > 1``: a count must fit 16 bits). Output order: the
    candidates above it in candidate order, then the ties at it (the first by position), then
    -1 past the valid ones (not sorted by estimate, as ``torch.topk`` was: attention does not
    care). NaN and -inf estimates and empty candidates (-1) are never selected. A sequence
    with no keys (``NRet`` 0: an idle slot) gets -1 everywhere.

    ``KEEP``: a selection is also written to ``Last`` (the layer's own), and a sequence that
    selects nothing this step (``NSel`` 0, ``NRet`` > 0) gets its last selection moved on by
    ``Shift`` rows (the steps since it was made), rows that move into the window dropped.

    ``REUSE`` (not with ``KEEP``): a sequence that did not vote this step (``NSel`` 0) takes
    its top-k of the list its rerank moved on by ``Shift`` rows (``_rerank_kernel``), so its
    ids are moved on the same way."""
    tl.static_assert(T == 1 or CP <= _TOPK_PACKED_MAX_CP)
    _, h, b, r = _program_head()
    n_ret = tl.load(NRet + b)
    reuse = n_ret < 0  # False (a tensor: both branches of a runtime ``if`` must agree in type)
    if KEEP:
        reuse = tl.load(NSel + b) == 0
    if n_ret == 0:
        j = tl.arange(0, KP)
        tl.store(Sel + r * K + j, tl.full([KP], -1, tl.int32), mask=j < K)
    elif reuse:
        j = tl.arange(0, KP)
        last = tl.load(Last + r * K + j, mask=j < K, other=-1)
        moved = last + tl.load(Shift + b)
        tl.store(Sel + r * K + j, tl.where((last >= 0) & (moved < n_ret), moved, -1),
                 mask=j < K)
    else:
        i = tl.arange(0, CP)
        est = tl.load(Est + r * C + i, mask=i < C, other=float("-inf"))
        ids = tl.load(Cand + r * C + i, mask=i < C, other=-1)
        if REUSE:
            shift = tl.where(tl.load(NSel + b) == 0, tl.load(Shift + b), 0)
            ids = tl.where(ids >= 0, ids + shift, -1)
        valid = (est > float("-inf")) & (ids >= 0)  # NaN compares false: never selected
        bits = est.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32; negatives reversed
        need = tl.minimum(tl.sum(valid.to(tl.int32), axis=0), K)
        # int64 scalars (the interval's width needs 33 bits); each threshold fits int32
        lo = tl.min(tl.where(valid, key, 2**31 - 1), axis=0).to(tl.int64)  # count(>= lo) >= need
        hi = tl.max(tl.where(valid, key, -(2**31)), axis=0).to(tl.int64)
        while lo < hi:  # a t with count(valid & key >= t) == need, else the largest with >= need
            width = hi - lo + 1  # >= 2, so the last threshold is above lo and none above hi
            packed = tl.zeros([CP], dtype=tl.int64)
            for j in tl.static_range(T):
                t = (lo + width * (j + 1) // (T + 1)).to(tl.int32)
                packed += (valid & (key >= t)).to(tl.int64) << (16 * j)
            counts = tl.sum(packed, axis=0)
            new_lo, new_hi, at_lo = lo, hi, need + 1
            for j in tl.static_range(T):  # thresholds ascend, their counts descend
                t = lo + width * (j + 1) // (T + 1)
                count = _packed_count(counts, j, T)
                new_lo = tl.where(count >= need, t, new_lo)  # the highest with enough at or above
                at_lo = tl.where(count >= need, count, at_lo)
            for j in tl.static_range(T):  # descending: the lowest threshold with too few wins
                t = lo + width * (T - j) // (T + 1)
                count = _packed_count(counts, T - 1 - j, T)
                new_hi = tl.where(count < need, t - 1, new_hi)
            lo = new_lo
            hi = tl.where(at_lo == need, new_lo, new_hi)
        lo32 = lo.to(tl.int32)
        above = valid & (key > lo32)
        equal = valid & (key == lo32)
        n_above = tl.sum(above.to(tl.int32), axis=0)
        pos_a = tl.cumsum(above.to(tl.int32), axis=0) - 1
        pos_e = n_above + tl.cumsum(equal.to(tl.int32), axis=0) - 1
        _store_selection(Sel + r * K, ids, above, equal, pos_a, pos_e, need, K, KP)
        if KEEP:
            _store_selection(Last + r * K, ids, above, equal, pos_a, pos_e, need, K, KP)


class Selector:
    """Buffers and launches of one decode step's selection, for fixed
    ``(batch, q_heads, kv_heads, D)``, key capacity ``N``, candidate budget ``C`` and ``k``.

    ``similarity=True`` votes every key its centroids' similarity to the query (the better
    recall on real heads); otherwise the paper's tiered integer votes (``tiers``: weight of the
    query's 1st, 2nd, ... centroid; up to 16). ``nbins``: histogram bins of the pruning pass
    (default 256 for similarity votes, 1024 for tiered votes, which need one bin per vote).

    ``sample_stride``: 1 prunes exactly (histogram of every key's vote, then a compaction pass
    over the stored bins); ``s > 1`` sets the threshold bin from a histogram of every ``s``-th
    key and compacts inside the vote pass itself (``_vote_select_kernel``), which saves the
    full pass's histogram, the bins' round trip through memory and the compaction launch, at
    the price of a candidate set that holds about ``SAMPLE_FILL * C`` keys above the threshold
    plus keys at it. Default: 16 for ``N >= 65536`` keys, else 1.

    ``gather_in_rerank`` (sampled path only; default ``GATHER_IN_RERANK``): the rerank's programs
    read the kept ids from the vote programs' regions themselves (``_gather_rerank_kernel``)
    instead of a merge launch before them."""

    def __init__(self, batch: int, q_heads: int, kv_heads: int, d: int, n: int, c: int, k: int,
                 tiers: tuple[int, ...] = (4, 3, 3, 2, 2, 2, 1, 1), similarity: bool = True,
                 device: torch.device | str = "cuda", block_n: int = 256, block_c: int = 64,
                 span: int | None = None, nbins: int | None = None,
                 sample_stride: int | None = None, gather_in_rerank: bool | None = None):
        if q_heads % kv_heads:
            raise ValueError("q_heads must be a multiple of kv_heads")
        if len(tiers) > 16:
            raise ValueError("at most 16 tiers (one per centroid)")
        self.batch, self.q_heads, self.kv_heads, self.d = batch, q_heads, kv_heads, d
        self.B, self.G, self.N, self.C, self.k = d // 4, q_heads // kv_heads, n, c, min(k, c)
        self.similarity, self.block_n, self.block_c = similarity, block_n, block_c
        self.nbins = nbins or (SIMILARITY_BINS if similarity else NBINS)
        if block_n < 128:
            # a block needs at least as many keys as the warp histogram has threads (64-key
            # blocks read out of bounds), and smaller blocks are no faster
            raise ValueError(f"block_n must be >= 128, got {block_n}")
        if self.nbins & (self.nbins - 1) or not 32 <= self.nbins <= 32768:
            raise ValueError(f"nbins must be a power of two in [32, 32768], got {self.nbins}")
        # keys per vote program: about 256 programs per KV head and sequence, whatever N is, so
        # that one sequence's keys are spread over the GPU (few programs would each walk many
        # blocks in turn: latency, not bandwidth, at batch 1)
        self.span = span or max(block_n, triton.next_power_of_2(triton.cdiv(n, 256)))
        self.compact_block = max(block_n, min(1024, triton.next_power_of_2(triton.cdiv(n, 64))))
        self.stride = (16 if n >= 65536 else 1) if sample_stride is None else sample_stride
        if self.stride < 1:
            raise ValueError(f"sample_stride must be >= 1, got {sample_stride}")
        self.span_sample = max(block_n, triton.next_power_of_2(triton.cdiv(n, 64 * self.stride)))
        self.programs = triton.cdiv(n, self.span)  # vote programs per KV head and sequence
        self.nprog = triton.next_power_of_2(self.programs)  # their counts' vector width
        # exact pruning (stride 1) compacts into the list directly: no merge to fold in
        self.gather_in_rerank = self.stride > 1 and (GATHER_IN_RERANK if gather_in_rerank is None
                                                     else gather_in_rerank)
        self.target = max(1, int(SAMPLE_FILL * c / self.stride))
        dev = torch.device(device)
        # inline PTX popcount on NVIDIA GPUs; the interpreter and other targets use bit tricks
        self.asm = (dev.type == "cuda" and torch.version.hip is None
                    and os.environ.get("TRITON_INTERPRET", "0") != "1")
        self.tiers = torch.zeros(16, dtype=torch.float32, device=dev)
        self.tiers[: len(tiers)] = torch.tensor(tiers, dtype=torch.float32)
        if not similarity and self.G * self.B * max(tiers) >= self.nbins:
            raise ValueError("tiered votes exceed the histogram range")
        f32, i32 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int32, device=dev)
        self.table = torch.empty(batch, q_heads, self.B, 16, **f32)
        self.qt = torch.empty(batch, q_heads, d, **f32)
        self.qnorm = torch.empty(batch, q_heads, **f32)
        self.planes = torch.empty(batch, kv_heads, PLANES, d // 32, **i32)
        self.params = torch.empty(batch, kv_heads, 3, **f32)
        if self.stride == 1:
            self.bins = torch.empty(batch, kv_heads, n, dtype=torch.int16, device=dev)
        else:  # each vote program's kept ids, in its own span of keys; kept per program
            self.kept = torch.empty(batch, kv_heads, n, **i32)
            self.count_above = torch.empty(batch, kv_heads, self.programs, **i32)
            self.count_at = torch.empty(batch, kv_heads, self.programs, **i32)
        self.hist = torch.zeros(batch, kv_heads, self.nbins, **i32)
        self.thresh = torch.empty(batch, kv_heads, **i32)
        self.quota = torch.empty(batch, kv_heads, **i32)
        self.need = torch.empty(batch, kv_heads, **i32)
        self.counters = torch.empty(batch, kv_heads, 2, **i32)
        self.cand = torch.empty(batch, kv_heads, c, **i32)
        self.est = torch.empty(batch, kv_heads, c, **f32)
        self.sel = torch.empty(batch, kv_heads, self.k, **i32)
        # fn -> (source tensor, fn(source)): see ``_derived``
        self._derived_cache: dict[Callable, tuple[torch.Tensor, torch.Tensor]] = {}

    def _derived(self, fn: Callable[[torch.Tensor], torch.Tensor],
                 source: torch.Tensor) -> torch.Tensor:
        """``fn(source)``, computed again only for another ``source`` tensor: the index's
        rotation and quantiser levels are fixed, so their kernel layouts are made once, before
        graph capture (no allocation inside a graph)."""
        hit = self._derived_cache.get(fn)
        if hit is None or hit[0] is not source:
            hit = self._derived_cache[fn] = (source, fn(source))
        return hit[1]

    def __call__(self, q: torch.Tensor, rt: torch.Tensor, levels: torch.Tensor,
                 centroid: torch.Tensor, codes: torch.Tensor, weights: torch.Tensor,
                 n_ret: torch.Tensor, bit_counts: torch.Tensor | None = None,
                 row_of_slot: torch.Tensor | None = None, n_sel: torch.Tensor | None = None,
                 last: torch.Tensor | None = None,
                 shift: torch.Tensor | None = None,
                 cand: torch.Tensor | None = None) -> torch.Tensor:
        """``[batch, kv_heads, k]`` int32 ids of the selected keys in each sequence's retrieval
        region (-1 where it holds fewer than ``k`` keys; a view of a buffer rewritten by the
        next call). ``centroid``: packed int32 ids ``[batch, kv_heads, N, D / 32]``,
        ``bit_counts`` ``[batch, kv_heads, D]`` int32 (both from ``encode_keys``; the counts are
        needed by similarity votes). ``q``: ``[batch, q_heads, D]``, or with ``row_of_slot``
        (``[batch]``, -1 for an idle sequence, whose ``n_ret`` must be 0: nothing is computed
        for it) a decode batch whose row ``row_of_slot[b]`` is sequence ``b``'s query.

        A selection serving several steps (``--sparse-reselect-interval``): ``n_sel``
        (``[batch]`` int32) is ``n_ret[b]`` for a sequence that selects this call, 0 for one
        that does not (every launch skips it); ``last`` (``[batch, kv_heads, k]`` int32, the
        caller's per layer) keeps each sequence's last selection, and a sequence not selecting
        gets it moved on by ``shift[b]`` rows (``[batch]`` int32, the steps since it was made:
        a head that copies from the context reads the rows after those it read then).

        A vote serving several steps (``--sparse-vote-interval``): ``cand`` (``[batch,
        kv_heads, C]`` int32, the caller's per layer, in place of ``last``) keeps each
        sequence's last candidate list; a sequence not voting (``n_sel`` 0) skips the votes
        only: its query tables are made, its list moved on by ``shift[b]`` rows is reranked
        with them and its top-k taken."""
        bsz = self.batch if row_of_slot is not None else q.shape[0]
        hq, d = q.shape[1:]
        if self.similarity and (bit_counts is None or tuple(bit_counts.shape) != (
                bsz, self.kv_heads, d) or not bit_counts.is_contiguous()):
            raise ValueError(f"similarity votes need bit_counts, int32 [{bsz}, {self.kv_heads}, "
                             f"{d}] contiguous (encode_keys(..., bit_counts=...))")
        B, G, N, C, NB = self.B, self.G, self.N, self.C, self.nbins
        q_rows = row_of_slot is not None
        reuse = cand is not None  # reranks a kept vote (vote interval), else keeps a selection
        keep = n_sel is not None and not reuse
        if n_sel is None:
            if reuse:
                raise ValueError("cand (a kept vote) needs n_sel and shift")
            n_sel = last = shift = n_ret
        elif any(t is None or t.shape != n_ret.shape or t.dtype != n_ret.dtype
                 for t in (n_sel, shift)):
            raise ValueError(f"n_sel and shift must be like n_ret ({tuple(n_ret.shape)} "
                             f"{n_ret.dtype})")
        elif reuse:
            if tuple(cand.shape) != (bsz, self.kv_heads, C) or (
                    cand.dtype != torch.int32 or not cand.is_contiguous()):
                raise ValueError(f"cand must be int32 [{bsz}, {self.kv_heads}, {C}] contiguous")
            if self.gather_in_rerank:
                raise ValueError("a kept vote (cand) is reranked from the merged list: not with "
                                 "gather_in_rerank")
            last = n_ret  # not read
        elif last is None or tuple(last.shape) != (bsz, self.kv_heads, self.k) or (
                last.dtype != torch.int32 or not last.is_contiguous()):
            raise ValueError(f"last must be int32 [{bsz}, {self.kv_heads}, {self.k}] "
                             "contiguous")
        cand = self.cand if cand is None else cand
        # the selection's launches read the keys to select from: 0 skips a sequence
        n_keys, n_ret = n_ret, n_sel
        rtj = self._derived(part_major_rotation, rt)
        # a sequence reranking its kept vote needs its query tables too
        _query_kernel[(bsz, hq)](q, row_of_slot if q_rows else n_ret,
                                 n_keys if reuse else n_sel, rtj, self.tiers,
                                 self.table, self.qt, self.qnorm, q.stride(0), q.stride(1),
                                 q.shape[0], D=d, B=B, SIMILARITY=self.similarity, Q_ROWS=q_rows)
        if self.similarity:
            _plane_kernel[(bsz, self.kv_heads)](self.qt, self.planes, self.params, bit_counts,
                                                n_ret, self.hist, G=G, D=d, B=B, NB=NB,
                                                P=PLANES, FLOOR_SD=VOTE_FLOOR_SD)
        else:
            self.hist.zero_()
        cent_strides = (centroid.stride(0), centroid.stride(1), centroid.stride(2))
        if self.stride == 1:
            _vote_kernel[(self.programs, self.kv_heads, bsz)](
                centroid, self.table, self.planes, self.params, n_ret, self.bins, self.hist,
                *cent_strides, N, self.span, B=B, G=G, NB=NB, P=PLANES, BLOCK_N=self.block_n,
                SIMILARITY=self.similarity, ASM=self.asm, STRIDE=1, STORE_BINS=True)
            grid_n = (triton.cdiv(N, self.compact_block), self.kv_heads, bsz)
            _threshold_kernel[(bsz, self.kv_heads)](self.hist, n_ret, self.thresh, self.quota,
                                                    self.need, self.counters, C, NB=NB)
            if reuse:  # the lists of the sequences voting now; the others are reranked again
                cand.masked_fill_((n_ret > 0)[:, None, None], -1)
            else:
                cand.fill_(-1)
            _compact_kernel[grid_n](self.bins, n_ret, self.thresh, self.quota, self.need,
                                    self.counters, cand, N, C, BLOCK_N=self.compact_block)
        else:
            rows = triton.cdiv(N, self.stride)
            _vote_kernel[(triton.cdiv(rows, self.span_sample), self.kv_heads, bsz)](
                centroid, self.table, self.planes, self.params, n_ret, self.hist, self.hist,
                *cent_strides, N, self.span_sample, B=B, G=G, NB=NB, P=PLANES,
                BLOCK_N=self.block_n, SIMILARITY=self.similarity, ASM=self.asm,
                STRIDE=self.stride, STORE_BINS=False)
            grid_n = (self.programs, self.kv_heads, bsz)
            _vote_select_kernel[grid_n](
                centroid, self.table, self.planes, self.params, n_ret, self.hist, self.thresh,
                self.need, self.kept, self.count_above, self.count_at, *cent_strides, N,
                self.span, C, self.target, B=B, G=G, NB=NB, P=PLANES, BLOCK_N=self.block_n,
                SIMILARITY=self.similarity, ASM=self.asm)
            if not self.gather_in_rerank:
                _merge_kernel[grid_n](self.kept, self.count_above, self.count_at, cand,
                                      n_ret, N, C, self.span, NPROG=self.nprog, BLOCK=256,
                                      REUSE=reuse)
        if codes.stride(2) % 2 or codes.storage_offset() % 2:
            raise ValueError("codes rows must start at even bytes (read as 16-bit pairs)")
        code_strides = (codes.stride(0), codes.stride(1), codes.stride(2),
                        weights.stride(0), weights.stride(1), weights.stride(2))
        grid_c = (triton.cdiv(C, self.block_c), self.kv_heads, bsz)
        if self.gather_in_rerank:
            _gather_rerank_kernel[grid_c](
                self.kept, self.count_above, self.count_at, self.cand, self.est, n_ret, codes,
                weights, self.qt, self.qnorm, self._derived(signed_levels, levels),
                *code_strides, N, C, self.span, self.programs, B=B, G=G, NPROG=self.nprog,
                STEPS=self.nprog.bit_length(), BLOCK_C=self.block_c)
        else:
            _rerank_kernel[grid_c](cand, self.need, codes, weights, self.qt, self.qnorm,
                                   self._derived(signed_levels, levels), self.est, n_keys,
                                   n_sel, shift, *code_strides, C, B=B, G=G,
                                   BLOCK_C=self.block_c, REUSE=reuse)
        sel = self.sel[:bsz]
        cp = triton.next_power_of_2(C)
        t = TOPK_THRESHOLDS if cp <= TOPK_PACKED_MAX_CP else 1
        _topk_kernel[(1, self.kv_heads, bsz)](self.est, cand, sel, n_keys, n_sel, last,
                                              shift, C, self.k, CP=cp,
                                              KP=triton.next_power_of_2(self.k), T=t, KEEP=keep,
                                              REUSE=reuse,
                                              num_warps=topk_warps(cp))
        return sel
