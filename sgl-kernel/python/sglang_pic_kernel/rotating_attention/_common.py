"""Triton helpers shared by the decode and extend rotating-attention kernels."""

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

if os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True"):
    # The CPU interpreter has no libdevice; numpy's cos/sin are accurate anyway.

    @triton.jit
    def _cos(x):
        return tl.cos(x)

    @triton.jit
    def _sin(x):
        return tl.sin(x)

else:

    @triton.jit
    def _cos(x):
        return libdevice.cos(x)

    @triton.jit
    def _sin(x):
        return libdevice.sin(x)


@triton.jit
def rope_cos_sin(
    pos,
    offs_half,
    mask,
    CosSin,
    stride_cs,
    InvFreq,
    HALF: tl.constexpr,
    FROM_CACHE: tl.constexpr,
):
    """cos/sin of ``pos * inv_freq`` broadcast over ``pos`` and ``offs_half``, in float32.

    ``FROM_CACHE`` reads the model's table (bit-identical to SGLang's own rotation); otherwise the
    angle is computed here and reduced with libdevice's accurate ``cosf``/``sinf`` (the fast
    hardware approximation is wrong for angles of tens of thousands of radians).
    """
    if FROM_CACHE:
        base = CosSin + pos.to(tl.int64) * stride_cs + offs_half
        cos = tl.load(base, mask=mask, other=1.0)
        sin = tl.load(base + HALF, mask=mask, other=0.0)
    else:
        inv = tl.load(InvFreq + offs_half, mask=offs_half < HALF, other=0.0)
        angle = pos.to(tl.float32) * inv
        cos = _cos(angle)
        sin = _sin(angle)
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
    """``q . rope(k)`` for a tile: keys rotated in fp32, then two half-width dots.

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
