"""The turned-copy kernel (copy on reuse) against an independent float64 rotation and against
the torch path it replaces (``moved_copies.turn_keys``): every layer's K turned by each slot's
shift (both signs, zero, beyond the table), V copied, nothing else written. On CPU under
TRITON_INTERPRET=1 at tiny shapes; with a GPU also at the Llama-3-8B KV shape in bf16."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from sglang_pic.position_free.moved_copies import turn_keys
from sglang_pic_kernel.rotating_attention import (
    LayerBuffers,
    RotaryTable,
    turn_copy_kv,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_SHAPES = [(2, 2, 16, 40, torch.float32), (3, 1, 8, 70, torch.bfloat16)]
GPU_SHAPES = [(32, 8, 128, 4096, torch.bfloat16), (28, 4, 128, 1000, torch.float16)]
SHAPES = CPU_SHAPES + (GPU_SHAPES if DEVICE == "cuda" else [])


def _inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def _turned(keys: torch.Tensor, shift: torch.Tensor, max_pos: int) -> torch.Tensor:
    """Reference turn in float64 (angles from the frequencies, not the table)."""
    d = keys.shape[-1]
    angle = shift.clamp(-(max_pos - 1), max_pos - 1).double()[:, None] * _inv_freq(d).to(
        keys.device)[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = keys.double().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("layers,heads,head_dim,n,dtype", SHAPES)
def test_turned_copy_matches_the_rotation_and_the_torch_path(layers, heads, head_dim, n, dtype):
    g = torch.Generator().manual_seed(n)
    max_pos = 512
    slots = 3 * n + 5
    k = [torch.randn(slots, heads, head_dim, generator=g).to(DEVICE, dtype) for _ in range(layers)]
    v = [torch.randn(slots, heads, head_dim, generator=g).to(DEVICE, dtype) for _ in range(layers)]
    before_k, before_v = [b.clone() for b in k], [b.clone() for b in v]
    perm = torch.randperm(slots, generator=g)
    src, dst = perm[:n].to(DEVICE), perm[n : 2 * n].to(DEVICE)
    shift = torch.randint(-700, 700, (n,), generator=g)  # beyond the table both ways
    shift[:3] = torch.tensor([0, 1, -1])
    shift = shift.to(DEVICE)
    table = RotaryTable.from_inv_freq(_inv_freq(head_dim).float(), max_pos).to(DEVICE)

    turn_copy_kv(LayerBuffers(k, v), src, dst, shift, table.cos_sin_cache)

    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[dst] = False
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # the table is float32 (angles to ~511)
    for layer in range(layers):
        ref = _turned(before_k[layer][src], shift, max_pos)
        torch.testing.assert_close(k[layer][dst].double(), ref, atol=tol, rtol=tol)
        torch_path = turn_keys(before_k[layer][src], shift, table.cos_sin_cache)
        ulp = 0 if dtype == torch.float32 else 1e-2  # a bf16 / fp16 rounding apart at most
        torch.testing.assert_close(k[layer][dst].float(), torch_path.float(), atol=ulp + 1e-6,
                                   rtol=ulp)
        assert torch.equal(v[layer][dst], before_v[layer][src])
        assert torch.equal(k[layer][untouched], before_k[layer][untouched])
        assert torch.equal(v[layer][untouched], before_v[layer][untouched])


def test_layouts_the_kernel_cannot_address_are_refused():
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        with pytest.raises(ValueError, match="dtype"):
            LayerBuffers([torch.zeros(4, 1, 8, dtype=fp8)], [torch.zeros(4, 1, 8, dtype=fp8)])
    with pytest.raises(ValueError, match="contiguous"):
        LayerBuffers([torch.zeros(4, 1, 8)], [torch.zeros(8, 1, 8)[::2]])
    with pytest.raises(ValueError, match="power of 2"):
        LayerBuffers([torch.zeros(4, 1, 12)], [torch.zeros(4, 1, 12)])
