"""Segmented attention's per-row kernels against the torch path they replace
(``run_kernels.turn`` / ``TorchRunKernels.merge``): turns of both signs, zero and beyond the
table, a row count read from the device, merges with padding and requests with no state. On CPU
under TRITON_INTERPRET=1 at tiny shapes; with a GPU also at the Llama-3-8B query shape."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from sglang_pic.position_free.run_kernels import TorchRunKernels, turn, turn_table
from sglang_pic_kernel.rotating_attention import RotaryTable
from sglang_pic_kernel.rotating_attention.segmented_ops import merge_runs, turn_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_SHAPES = [(3, 16, 9, torch.float32), (4, 8, 21, torch.bfloat16)]
GPU_SHAPES = [(32, 128, 2048, torch.bfloat16)]
SHAPES = CPU_SHAPES + (GPU_SHAPES if DEVICE == "cuda" else [])


def _table(head_dim: int, positions: int = 256) -> torch.Tensor:
    inv = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return RotaryTable.from_inv_freq(inv, positions).to(DEVICE).cos_sin_cache


@pytest.mark.parametrize("heads,head_dim,rows,dtype", SHAPES)
def test_turn_rows_equals_the_torch_turn(heads, head_dim, rows, dtype):
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(7, heads, head_dim, generator=g).to(DEVICE, dtype)
    index = torch.randint(0, 7, (rows,), generator=g).to(DEVICE)
    shift = torch.randint(-400, 400, (rows,), generator=g)  # beyond the 256-row table both ways
    shift[:3] = torch.tensor([0, 5, -5])
    shift = shift.to(DEVICE)
    cos_sin = _table(head_dim)
    # the torch path clamps nothing: give it the clamped distances the kernel reads
    clamped = shift.clamp(-(cos_sin.shape[0] - 1), cos_sin.shape[0] - 1)
    want = turn(q, index, turn_table(clamped, cos_sin))
    got = turn_rows(q, index, shift, cos_sin)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_turn_rows_writes_only_the_rows_the_device_count_names():
    q = torch.randn(4, 2, 16).to(DEVICE)
    index = torch.tensor([3, 2, 1, 0, 0, 0], device=DEVICE)
    shift = torch.tensor([7, -7, 0, 1, 1, 1], device=DEVICE)
    cos_sin = _table(16)
    full = turn_rows(q, index, shift, cos_sin)
    out = turn_rows(q, index, shift, cos_sin, count=torch.tensor([3], dtype=torch.int32,
                                                                  device=DEVICE))
    torch.testing.assert_close(out[:3], full[:3])
    assert out.shape == full.shape


@pytest.mark.parametrize("heads,head_dim,rows,dtype", SHAPES)
def test_merge_runs_equals_the_torch_merge(heads, head_dim, rows, dtype):
    g = torch.Generator().manual_seed(heads * rows)
    n = rows
    o = torch.randn(n, heads, head_dim, generator=g).to(DEVICE, dtype)
    lse = (torch.randn(n, heads, generator=g) * 4).to(DEVICE)
    m, width = max(n // 3, 2), 4
    index = torch.randint(0, n, (m, width), generator=g)
    index[0, 1:] = n  # padding after one state
    index[1, :] = n  # a padded request: no state at all
    index[-1, -1] = n + 50  # past the states: padding too
    index = index.to(DEVICE)
    got = merge_runs(o.contiguous(), lse.contiguous(), index.contiguous())
    want = TorchRunKernels.merge(o, lse, index.clamp(max=n))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert not got[1].any()  # no state: zero
    torch.testing.assert_close(got[0].float(), o[index[0, 0]].float(), atol=tol, rtol=tol)


def test_bad_shapes_are_refused():
    q = torch.randn(4, 2, 12).to(DEVICE)
    with pytest.raises(ValueError, match="power of 2"):
        turn_rows(q, torch.zeros(1, dtype=torch.int64, device=DEVICE),
                  torch.zeros(1, dtype=torch.int64, device=DEVICE), _table(12))
    with pytest.raises(ValueError, match="lse"):
        merge_runs(torch.randn(3, 2, 16).to(DEVICE), torch.randn(3, 2).to(DEVICE).half(),
                   torch.zeros(1, 1, dtype=torch.int64, device=DEVICE))
