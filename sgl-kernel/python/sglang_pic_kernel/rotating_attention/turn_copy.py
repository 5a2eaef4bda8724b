"""Turned copy of KV slots across every layer in one launch (copy on reuse).

A request that reuses a cached span at another offset reads a copy of the span's pages with each
key turned by the distance it moved (``sglang_pic.position_free.moved_copies``). Done with
torch ops, that is a gather, a float32 turn (six element-wise ops) and a scatter for K and a
gather / scatter for V per layer: ~15 launches and ~8x the bytes of the copy in float32
temporaries, per layer. This kernel reads each source row once and writes its turned copy, for
all layers, in one launch: the traffic is the copy itself (``2 * n * heads * D`` elements in
each direction per layer).

The turn is NeoX RoPE (dims ``[0, D/2)`` pair with ``[D/2, D)``) by ``shift[t]`` positions,
either sign, math in float32, stored in the buffer's dtype, as ``rotate_neox`` /
``moved_copies.turn_keys`` compute it. Layers are reached through a table of per-layer buffer
addresses (as SGLang's own ``copy_all_layer_kv_cache`` does), so the pool's buffers stay
separate tensors.

Shapes: per-layer K and V buffers ``[slots, heads, D]``, contiguous, one dtype (bf16, fp16 or
fp32); ``src``, ``dst``, ``shift`` ``[n]`` integers; ``cos_sin`` float32 ``[positions, D]``
(row ``p`` = ``cos(p f) ++ sin(p f)``), distances clamped to its last row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import rotate_pair

_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
BLOCK_TOKENS = 32


@triton.jit
def _turn_copy_kernel(
    k_ptrs, v_ptrs,  # uint64 [layers]: address of each layer's K / V buffer
    src_ptr, dst_ptr, shift_ptr,  # [n]
    cos_sin_ptr,  # float32 [positions, 2 * HALF]
    n, max_row, row_stride,  # tokens; last table row; elements per slot (heads * D)
    HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr, DTYPE: tl.constexpr,
):
    layer = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < n
    src = tl.load(src_ptr + t, mask=live, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + t, mask=live, other=0).to(tl.int64)
    shift = tl.load(shift_ptr + t, mask=live, other=0).to(tl.int64)
    row = tl.minimum(tl.abs(shift), max_row)
    d = tl.arange(0, HALF)
    live2 = live[:, None]
    table = cos_sin_ptr + row[:, None] * (2 * HALF) + d[None, :]
    cos = tl.load(table, mask=live2, other=1.0)
    sin = tl.load(table + HALF, mask=live2, other=0.0)
    sin = tl.where(shift[:, None] < 0, -sin, sin)  # a turn back is the opposite angle
    k_base = tl.load(k_ptrs + layer).to(tl.pointer_type(DTYPE))
    v_base = tl.load(v_ptrs + layer).to(tl.pointer_type(DTYPE))
    src_row = src[:, None] * row_stride + d[None, :]
    dst_row = dst[:, None] * row_stride + d[None, :]
    for h in tl.static_range(HEADS):
        at_src = src_row + h * 2 * HALF
        at_dst = dst_row + h * 2 * HALF
        r1, r2 = rotate_pair(tl.load(k_base + at_src, mask=live2, other=0.0),
                             tl.load(k_base + at_src + HALF, mask=live2, other=0.0), cos, sin)
        tl.store(k_base + at_dst, r1.to(DTYPE), mask=live2)
        tl.store(k_base + at_dst + HALF, r2.to(DTYPE), mask=live2)
        v1 = tl.load(v_base + at_src, mask=live2, other=0.0)
        v2 = tl.load(v_base + at_src + HALF, mask=live2, other=0.0)
        tl.store(v_base + at_dst, v1, mask=live2)
        tl.store(v_base + at_dst + HALF, v2, mask=live2)


class LayerBuffers:
    """The per-layer K and V buffers of a KV pool, as the kernel addresses them.

    ``k`` / ``v``: one tensor per layer, each ``[slots, heads, D]``, contiguous, one dtype and
    device. Raises ValueError for a layout the kernel does not handle (the caller then uses the
    torch path)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        first = k[0]
        if first.dtype not in _DTYPES:
            raise ValueError(f"turned copy: KV dtype {first.dtype} is not bf16, fp16 or fp32")
        if first.dim() != 3 or first.shape[-1] % 2:
            raise ValueError(f"turned copy: KV buffers must be [slots, heads, D] with an even D, "
                             f"got {tuple(first.shape)}")
        half = first.shape[-1] // 2
        if half & (half - 1):
            raise ValueError(f"turned copy: head_dim {first.shape[-1]} is not twice a power of 2")
        for buf in (*k, *v):
            if (buf.shape != first.shape or buf.dtype != first.dtype
                    or buf.device != first.device or not buf.is_contiguous()):
                raise ValueError("turned copy: every layer's K and V buffer must share one "
                                 "contiguous shape, dtype and device")
        self.heads, self.head_dim = first.shape[1], first.shape[2]
        self.dtype = first.dtype
        self.layers = len(k)
        self.k_ptrs = torch.tensor([b.data_ptr() for b in k], dtype=torch.uint64,
                                   device=first.device)
        self.v_ptrs = torch.tensor([b.data_ptr() for b in v], dtype=torch.uint64,
                                   device=first.device)
        self._keep = (k, v)  # the addresses are valid while the tensors live


def turn_copy_kv(buffers: LayerBuffers, src: torch.Tensor, dst: torch.Tensor,
                 shift: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """For every layer: ``K[dst] = turn(K[src], shift)`` and ``V[dst] = V[src]`` (see the module
    docstring). ``dst`` slots must not overlap ``src``. ``cos_sin``: float32 contiguous."""
    n = int(src.numel())
    if n == 0:
        return
    if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
        raise ValueError("turned copy: cos_sin must be a contiguous float32 table")
    if cos_sin.shape[1] != buffers.head_dim:
        raise ValueError(f"turned copy: cos_sin rows have {cos_sin.shape[1]} values, the heads "
                         f"{buffers.head_dim}")
    grid = (triton.cdiv(n, BLOCK_TOKENS), buffers.layers)
    _turn_copy_kernel[grid](
        buffers.k_ptrs, buffers.v_ptrs, src.contiguous(), dst.contiguous(), shift.contiguous(),
        cos_sin, n, cos_sin.shape[0] - 1, buffers.heads * buffers.head_dim,
        HEADS=buffers.heads, HALF=buffers.head_dim // 2, BLOCK_T=BLOCK_TOKENS,
        DTYPE=_DTYPES[buffers.dtype],
    )
