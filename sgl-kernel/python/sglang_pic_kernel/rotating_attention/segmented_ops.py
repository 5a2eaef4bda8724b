"""The two per-row steps around segmented attention's FlashInfer calls, one launch each.

Segmented attention (``sglang_pic.position_free.segmented_backend``) attends each run of keys
moved by one distance as a request of its own, its query turned back by the run's shift, and
merges the runs' partial outputs by their log-sum-exp. In torch, the turn is a gather, a float32
copy and six element-wise ops over every query row, and the merge gathers ``[M, S]`` states
before FlashInfer's ``merge_states`` reads them again: per layer, several launches and temporaries
of a few times the rows' bytes. Here each is one kernel that reads its rows once:

* ``turn_rows``: ``out[r] = turn(q[rows[r]], -shift[r])`` (NeoX RoPE by the opposite of the
  shift, float32 math, the query's dtype out);
* ``merge_runs``: ``out[i] = sum_j w_ij o[index[i, j]]`` with ``w`` the softmax of the base-2
  log-sum-exps, entries ``>= len(o)`` skipped (padding).

``turn_rows`` takes its row count from a device tensor when given one (``count``): a CUDA graph
captured for a padded batch turns only the rows its replay filled in.

Shapes: ``q`` [N, H, D] (rows contiguous), ``rows``, ``shift`` int64 [R]; ``cos_sin`` float32
[positions, D] (row ``p`` = ``cos(p f) ++ sin(p f)``), distances clamped to its last row;
``o`` [N, H, D], ``lse`` float32 [N, H], ``index`` int64 [M, S].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import rotate_pair

BLOCK_ROWS = 16


@triton.jit
def _turn_rows_kernel(
    q_ptr, out_ptr, rows_ptr, shift_ptr, cos_sin_ptr, count_ptr,
    n, max_row, q_stride, out_stride,  # rows; last table row; elements per q / out row
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, HAS_COUNT: tl.constexpr,
):
    head = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if HAS_COUNT:
        n = tl.minimum(n, tl.load(count_ptr))
    live = r < n
    src = tl.load(rows_ptr + r, mask=live, other=0).to(tl.int64)
    shift = tl.load(shift_ptr + r, mask=live, other=0).to(tl.int64)
    d = tl.arange(0, HALF)
    live2 = live[:, None]
    table = cos_sin_ptr + tl.minimum(tl.abs(shift), max_row)[:, None] * (2 * HALF) + d[None, :]
    cos = tl.load(table, mask=live2, other=1.0)
    sin = tl.load(table + HALF, mask=live2, other=0.0)
    sin = tl.where(shift[:, None] > 0, -sin, sin)  # turned back: the opposite angle
    at = src[:, None] * q_stride + head * 2 * HALF + d[None, :]
    x1, x2 = rotate_pair(tl.load(q_ptr + at, mask=live2, other=0.0),
                         tl.load(q_ptr + at + HALF, mask=live2, other=0.0), cos, sin)
    to = r.to(tl.int64)[:, None] * out_stride + head * 2 * HALF + d[None, :]
    tl.store(out_ptr + to, x1.to(out_ptr.dtype.element_ty), mask=live2)
    tl.store(out_ptr + to + HALF, x2.to(out_ptr.dtype.element_ty), mask=live2)


@triton.jit
def _merge_runs_kernel(
    o_ptr, lse_ptr, index_ptr, out_ptr,
    n_states, width, heads,  # rows of o; columns of index; heads
    D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    acc = tl.zeros([D], dtype=tl.float32)
    best = -1e30  # a finite start: exp2 of (-inf) - (-inf) would be nan
    total = 0.0
    for j in range(0, width):
        state = tl.load(index_ptr + i * width + j)
        valid = state < n_states
        s = tl.load(lse_ptr + state * heads + head, mask=valid, other=-1e30)
        new_best = tl.where(valid, tl.maximum(best, s), best)
        scale = tl.exp2(best - new_best)
        w = tl.where(valid, tl.exp2(s - new_best), 0.0)
        x = tl.load(o_ptr + (state * heads + head) * D + d, mask=valid, other=0.0)
        acc = acc * scale + w * x.to(tl.float32)
        total = total * scale + w
        best = new_best
    out = tl.where(total > 0, acc / tl.maximum(total, 1e-30), 0.0)
    tl.store(out_ptr + (i * heads + head) * D + d, out.to(out_ptr.dtype.element_ty))


def _half(head_dim: int) -> int:
    half = head_dim // 2
    if head_dim % 2 or half & (half - 1):
        raise ValueError(f"segmented ops: head_dim {head_dim} is not twice a power of 2")
    return half


def turn_rows(q: torch.Tensor, rows: torch.Tensor, shift: torch.Tensor, cos_sin: torch.Tensor,
              count: torch.Tensor | None = None) -> torch.Tensor:
    """``q[rows]`` turned back by ``shift``: ``[len(rows), H, D]`` in ``q.dtype``. With ``count``
    (int32 [1] on ``q``'s device) only the first ``count`` rows are written (the rest stay
    uninitialised: no attention call reads them)."""
    if q.dim() != 3 or q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        raise ValueError(f"segmented ops: q must be [N, H, D] with contiguous rows, got "
                         f"{tuple(q.shape)} strides {q.stride()}")
    if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() \
            or cos_sin.shape[1] != q.shape[2]:
        raise ValueError("segmented ops: cos_sin must be a contiguous float32 [positions, D]")
    n = int(rows.numel())
    out = q.new_empty((n, *q.shape[1:]))
    if n == 0:
        return out
    grid = (triton.cdiv(n, BLOCK_ROWS), q.shape[1])
    _turn_rows_kernel[grid](
        q, out, rows, shift, cos_sin, count if count is not None else rows,
        n, cos_sin.shape[0] - 1, q.stride(0), out.stride(0),
        HALF=_half(q.shape[2]), BLOCK_R=BLOCK_ROWS, HAS_COUNT=count is not None,
    )
    return out


def merge_runs(o: torch.Tensor, lse: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The states of ``o`` / ``lse`` (base 2) merged along ``index`` into ``[M, H, D]`` in
    ``o.dtype``; a row with no valid entry (a padded request) is zero."""
    m, width = index.shape
    heads, d = o.shape[1], o.shape[2]
    _half(d)
    if not (o.is_contiguous() and lse.is_contiguous() and index.is_contiguous()):
        raise ValueError("segmented ops: o, lse and index must be contiguous")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (o.shape[0], heads):
        raise ValueError("segmented ops: lse must be float32 [N, H] beside o [N, H, D]")
    out = o.new_empty((m, heads, d))
    if m == 0:
        return out
    _merge_runs_kernel[(m, heads)](
        o, lse, index, out, o.shape[0], width, heads, D=d,
    )
    return out
