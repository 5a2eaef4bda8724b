"""ParisKV key encoding (prefill, and each key moved into the retrieval region during decode).

One pass over full-precision keys writes the compact metadata that stays on the GPU while the
keys themselves live in host memory:

    keys      [n, kv_heads, D]   fp16/bf16, post-RoPE (read with any row/head strides)
    centroid  [kv_heads, N, D/32] int32: per subspace of 4 rotated coordinates its sign pattern
                                 (bit j set when coordinate 4b+j > 0) = the nearest of the 16
                                 analytic centroids +-1/2, packed 8 subspaces per word: bit i of
                                 the key's D-bit string (word i // 32, bit i % 32) is the sign
                                 of rotated coordinate i, so the id of subspace b is nibble b
    codes     [kv_heads, N, D/2] uint8: 4 bits per rotated, normalised coordinate
                                 (sign << 3 | Lloyd-Max magnitude level), two per byte:
                                 byte 2b = code(4b) | code(4b+1) << 4, byte 2b+1 = code(4b+2) | ...
    weights   [kv_heads, N, B]   fp16: least-squares calibration ``<k_b, v_b> / <v_b, v_b>``
                                 (includes the key norm)
    bit_counts [kv_heads, D]     int32, optional: per rotated coordinate, how many keys of the
                                 region have its sign bit set (reset when ``offset`` is 0). The
                                 selector centres and scales its vote histogram with them: the
                                 mean vote over the region is linear in these counts.

``B = D / 4`` subspaces. The SRHT rotation ``R = H diag(s) / sqrt(D)`` is a matmul with
``Rt = R^T`` (``[D, D]`` fp32) in full fp32 products, so the signs and codes match the torch
reference's. Two ways, one kernel:

- a few keys (each decode step's key leaving the local window, inside CUDA graphs): in the
  kernel (``input_precision="ieee"``), accumulated over ``ENCODE_BLOCK_K`` rows of the head dim
  at a time so that nothing spills; the four strided column sets ``Rt[:, j::4]`` give the
  coordinates ``4b + j`` of all subspaces at once;
- a region (``n >= PREROTATE_FROM``: a request's activation, 128K keys x kv_heads per layer):
  rotated first by cuBLAS in chunks of ``PREROTATE_CHUNK_BYTES`` of fp32 (TF32 off), into the
  part-major column order (``select.part_major_rotation``), and the kernel reads the
  coordinates. The in-kernel product runs on CUDA cores through Triton's FMA path, far below
  what cuBLAS reaches, and a region's product would make each request's activation slow.

Each program encodes ``BLOCK_N`` keys of one KV head, so centroid ids and packed codes come out
without reshapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .select import part_major_rotation

SUBSPACE = 4
ENCODE_BLOCK_K = 32  # head-dim rows of the rotation per step of the encode's product
PREROTATE_FROM = 1024  # keys from which the rotation runs as a cuBLAS matmul before the kernel
PREROTATE_CHUNK_BYTES = 64 << 20  # fp32 rotated coordinates per chunk (a scratch buffer)


@triton.jit
def _rotate_chunk(x, acc, Rt, k, offs_b, J: tl.constexpr, D: tl.constexpr):
    """``acc + x @ Rt[k, 4b+J]``: rows ``k`` (a chunk of the head dim) of the columns of
    rotated coordinates ``4b + J``."""
    r = tl.load(Rt + k[:, None] * D + (offs_b * 4 + J)[None, :])  # [BLOCK_K, B]
    return tl.dot(x, r, acc, input_precision="ieee")


@triton.jit
def _code(xn, Edges, Levels):
    """4-bit code and its dequantised value of normalised coordinates ``xn``."""
    a = tl.abs(xn)
    mag = tl.zeros(xn.shape, dtype=tl.int32)
    for e in tl.static_range(7):
        mag += (a > tl.load(Edges + e)).to(tl.int32)
    neg = (xn < 0).to(tl.int32)
    value = (1.0 - 2.0 * neg.to(tl.float32)) * tl.load(Levels + mag)
    return (neg << 3) | mag, value


@triton.jit(do_not_specialize=["n", "offset"])  # one binary for every append position
def _encode_kernel(
    K, Rt, Edges, Levels, Cent, Codes, W,
    n, offset,
    stride_kn, stride_kh,
    stride_ch, stride_cn,
    stride_oh, stride_on,
    stride_wh, stride_wn, Counts, stride_th,
    D: tl.constexpr, B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COUNT: tl.constexpr, ROTATED: tl.constexpr,
):
    """``K``: the keys (``[n, kv_heads, D]`` fp16/bf16, any row/head strides), or with
    ``ROTATED`` their rotated coordinates in part-major order (fp32, coordinate ``4b + j`` at
    column ``j * B + b``; ``Rt`` is not read)."""
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rows < n
    offs_b = tl.arange(0, B)
    key_rows = K + rows[:, None].to(tl.int64) * stride_kn + h * stride_kh
    if ROTATED:
        m2k = mask[:, None]
        r0 = tl.load(key_rows + offs_b[None, :], mask=m2k, other=0.0)  # coordinate 4b
        r1 = tl.load(key_rows + B + offs_b[None, :], mask=m2k, other=0.0)
        r2 = tl.load(key_rows + 2 * B + offs_b[None, :], mask=m2k, other=0.0)
        r3 = tl.load(key_rows + 3 * B + offs_b[None, :], mask=m2k, other=0.0)
    else:
        # the rotation over chunks of the head dim: [BLOCK_N, D] keys and [D, D] of Rt at once
        # spill registers to local memory (sm_90), which costs far more than the FMAs
        r0 = tl.zeros([BLOCK_N, B], dtype=tl.float32)  # coordinate 4b
        r1 = tl.zeros([BLOCK_N, B], dtype=tl.float32)
        r2 = tl.zeros([BLOCK_N, B], dtype=tl.float32)
        r3 = tl.zeros([BLOCK_N, B], dtype=tl.float32)
        for k0 in tl.range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(key_rows + k[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
            r0 = _rotate_chunk(x, r0, Rt, k, offs_b, 0, D)
            r1 = _rotate_chunk(x, r1, Rt, k, offs_b, 1, D)
            r2 = _rotate_chunk(x, r2, Rt, k, offs_b, 2, D)
            r3 = _rotate_chunk(x, r3, Rt, k, offs_b, 3, D)
    norm2 = tl.sum(r0 * r0 + r1 * r1 + r2 * r2 + r3 * r3, axis=1)
    inv = 1.0 / tl.sqrt(tl.maximum(norm2, 1e-24))[:, None]
    n0, n1, n2, n3 = r0 * inv, r1 * inv, r2 * inv, r3 * inv
    cent = ((n0 > 0).to(tl.int32) | ((n1 > 0).to(tl.int32) << 1)
            | ((n2 > 0).to(tl.int32) << 2) | ((n3 > 0).to(tl.int32) << 3))
    if COUNT:  # set sign bits per coordinate 4b+J over this block's keys, one atomic each
        m2f = mask[:, None]
        counts = Counts + h * stride_th + offs_b * 4
        tl.atomic_add(counts, tl.sum(((n0 > 0) & m2f).to(tl.int32), axis=0))
        tl.atomic_add(counts + 1, tl.sum(((n1 > 0) & m2f).to(tl.int32), axis=0))
        tl.atomic_add(counts + 2, tl.sum(((n2 > 0) & m2f).to(tl.int32), axis=0))
        tl.atomic_add(counts + 3, tl.sum(((n3 > 0) & m2f).to(tl.int32), axis=0))
    c0, v0 = _code(n0, Edges, Levels)
    c1, v1 = _code(n1, Edges, Levels)
    c2, v2 = _code(n2, Edges, Levels)
    c3, v3 = _code(n3, Edges, Levels)
    w = (r0 * v0 + r1 * v1 + r2 * v2 + r3 * v3) / tl.maximum(
        v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3, 1e-12)
    out_rows = (rows + offset).to(tl.int64)[:, None]
    m2 = mask[:, None]
    # nibble b of the packed words holds subspace b (bit fields are disjoint: sum == or)
    shifted = cent.to(tl.int64) << (4 * (offs_b % 8)).to(tl.int64)[None, :]
    words = tl.sum(tl.reshape(shifted, [BLOCK_N, B // 8, 8]), axis=2).to(tl.int32)
    tl.store(Cent + h * stride_ch + out_rows * stride_cn + tl.arange(0, B // 8)[None, :], words,
             mask=m2)
    code_base = Codes + h * stride_oh + out_rows * stride_on + 2 * offs_b[None, :]
    tl.store(code_base, (c0 | (c1 << 4)).to(tl.uint8), mask=m2)
    tl.store(code_base + 1, (c2 | (c3 << 4)).to(tl.uint8), mask=m2)
    tl.store(W + h * stride_wh + out_rows * stride_wn + offs_b[None, :], w.to(W.dtype.element_ty),
             mask=m2)


def unpack_centroids(packed: torch.Tensor) -> torch.Tensor:
    """``[..., D/32]`` int32 packed ids -> ``[..., D/4]`` int64 centroid id per subspace."""
    shifts = torch.arange(0, 32, 4, device=packed.device)
    nibbles = (packed.long()[..., None] >> shifts) & 15
    return nibbles.flatten(-2)


def encode_keys(keys: torch.Tensor, rt: torch.Tensor, edges: torch.Tensor, levels: torch.Tensor,
                centroid: torch.Tensor, codes: torch.Tensor, weights: torch.Tensor,
                offset: int = 0, block_n: int = 32,
                bit_counts: torch.Tensor | None = None,
                prerotate_from: int = PREROTATE_FROM) -> None:
    """Encode ``keys`` ``[n, kv_heads, D]`` into rows ``offset .. offset + n`` of ``centroid`` /
    ``codes`` / ``weights`` (``[kv_heads, N, ...]`` views of one sequence's metadata), and add
    their sign bits to ``bit_counts`` ``[kv_heads, D]`` int32 if given (zeroed first when
    ``offset`` is 0: a new region).

    ``rt``: ``[D, D]`` fp32, ``R^T`` of the SRHT; ``edges`` ``[7]`` / ``levels`` ``[8]``: the
    Lloyd-Max magnitude quantiser (fp32). From ``prerotate_from`` keys on, the rotation is a
    chunked cuBLAS matmul before the kernel (module doc); fewer keys are rotated in the kernel,
    which allocates nothing (CUDA-graph safe)."""
    if centroid.dtype != torch.int32 or centroid.shape[-1] != keys.shape[-1] // 32:
        raise ValueError("centroid ids are packed: int32 [kv_heads, N, D / 32]")
    n, heads, d = keys.shape
    if d % SUBSPACE or d < 64 or d & (d - 1):
        raise ValueError(f"ParisKV kernels need a power-of-two head dim >= 64, got {d}")
    if keys.stride(-1) != 1:
        raise ValueError("keys need a contiguous last dim")
    count = bit_counts is not None
    if count:
        if bit_counts.dtype != torch.int32 or tuple(bit_counts.shape) != (heads, d) \
                or bit_counts.stride(-1) != 1:
            raise ValueError(f"bit_counts must be int32 [{heads}, {d}] with a contiguous last "
                             f"dim, got {bit_counts.dtype} {tuple(bit_counts.shape)}")
        if offset == 0:
            bit_counts.zero_()
    if n == 0:
        return

    def launch(src: torch.Tensor, rows: int, at: int, rotated: bool) -> None:
        _encode_kernel[(triton.cdiv(rows, block_n), heads)](
            src, rt, edges, levels, centroid, codes, weights, rows, at,
            src.stride(0), src.stride(1), centroid.stride(0), centroid.stride(1),
            codes.stride(0), codes.stride(1), weights.stride(0), weights.stride(1),
            bit_counts if count else centroid, bit_counts.stride(0) if count else 0,
            D=d, B=d // SUBSPACE, BLOCK_N=block_n, BLOCK_K=ENCODE_BLOCK_K, COUNT=count,
            ROTATED=rotated,
            num_warps=8,  # sm_90, head dim 128: 128 registers and no spills (4 warps: 255)
        )

    if n < prerotate_from:
        launch(keys, n, offset, False)
        return
    rtj = part_major_rotation(rt)
    chunk = max(1, PREROTATE_CHUNK_BYTES // (heads * d * 4))
    rotated = torch.empty(min(chunk, n), heads, d, dtype=torch.float32, device=keys.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # full fp32 products: the reference's signs
    try:
        for start in range(0, n, chunk):
            rows = min(chunk, n - start)
            out = rotated[:rows]
            torch.matmul(keys[start:start + rows].float(), rtj, out=out)
            launch(out, rows, offset + start, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
