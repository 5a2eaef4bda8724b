"""Triton helpers shared by the decode and extend rotating-attention kernels."""

import triton
import triton.language as tl


@triton.jit
def shift_cos_sin(offs_n, loc, mask_n, offs_d, mask_d, StoredPos, CosSin, stride_cs,
                  HALF: tl.constexpr, MAX_POS: tl.constexpr):
    """cos/sin ``[HALF_P, BLOCK_N]`` turning each key of a tile by the distance it moved.

    Key ``n`` (at pool slot ``loc``) was rotated at ``stored_positions[loc]`` when computed and
    is read at ``n``; the table row of ``n - stored`` is loaded only for keys that moved (a masked
    load: keys with a zero shift get ``cos = 1, sin = 0`` and cost no table traffic).
    """
    stored = tl.load(StoredPos + loc, mask=mask_n, other=0)
    delta = tl.minimum(tl.maximum(offs_n - stored, 0), MAX_POS - 1)
    moved = mask_d[:, None] & ((delta != 0) & mask_n)[None, :]
    row = CosSin + delta.to(tl.int64)[None, :] * stride_cs + offs_d[:, None]
    cos = tl.load(row, mask=moved, other=1.0)
    sin = tl.load(row + HALF, mask=moved, other=0.0)
    return cos, sin


@triton.jit
def rotate_pair(x1, x2, cos, sin):
    """neox RoPE on the two halves of a head: ``(x1 cos - x2 sin, x2 cos + x1 sin)`` in fp32."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1


@triton.jit
def rotated_scores(q1, q2, k1, k2, cos, sin, sm_scale, LOGIT_CAP: tl.constexpr):
    """``q . rope(k)`` for a tile: keys turned in fp32, then two half-width dots.

    q1/q2: ``[M, HALF]`` query halves; k1/k2, cos/sin: ``[HALF, N]``. Returns ``[M, N]`` fp32.
    """
    r1, r2 = rotate_pair(k1, k2, cos, sin)
    qk = tl.dot(q1, r1.to(q1.dtype)) + tl.dot(q2, r2.to(q2.dtype))
    qk *= sm_scale
    if LOGIT_CAP > 0:
        qk = LOGIT_CAP * tanh(qk / LOGIT_CAP)
    return qk


@triton.jit
def online_softmax_step(qk, v, acc, e_max, e_sum):
    """One tile of the streaming softmax: rescale the running sums, add ``softmax(qk) @ v``."""
    n_max = tl.maximum(tl.max(qk, 1), e_max)
    rescale = tl.exp(e_max - n_max)
    p = tl.exp(qk - n_max[:, None])
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
    e_sum = e_sum * rescale + tl.sum(p, 1)
    return acc, n_max, e_sum


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(n)


@triton.jit
def merge_partial(acc, e_sum, e_max, part, lse):
    """Add one split's normalised partial output ``part`` with log-sum-exp ``lse`` to the
    running ``(acc, e_sum, e_max)`` of a log-sum-exp merge; returns the new three."""
    n_max = tl.maximum(lse, e_max)
    rescale = tl.exp(e_max - n_max)
    w = tl.exp(lse - n_max)
    return acc * rescale + w * part, e_sum * rescale + w, n_max
