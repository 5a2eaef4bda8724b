"""RoPE tables shared by the rotating-attention kernels, and the torch reference rotation.

Position-free KV keeps keys un-rotated in the pool; every kernel that reads a key rotates it at
its logical position (its index in the request's KV sequence). The angle for position ``p`` and
frequency ``i`` is ``p * inv_freq[i]``; the kernels either read ``cos``/``sin`` from the model's
own ``cos_sin_cache`` (exactly the numbers SGLang rotated keys with, so outputs match vanilla),
compute them in-kernel from ``inv_freq`` (no table traffic, but accurate ``cosf`` is slow), or -
the default, ``step`` - let the decode kernel read one table row per key tile and step it to each
key of the tile by angle addition, ``cos((n0+j)f) = cos(n0 f) cos(j f) - sin(n0 f) sin(j f)``,
with the ``j`` rows loaded once per program: decode is bandwidth-bound and a full table row per
key costs twice the key's own bytes. The extend kernel reads table rows in ``step`` mode (it is
compute-bound). Measurements: ``docs/position-free-kv.md``.

Only the neox layout (``rotate_half``: dims ``[0, d/2)`` pair with ``[d/2, d)``) over the full
head dimension is supported: Llama 2/3.x, Qwen2/2.5/3 and Mistral all use it in SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROPE_FROM_CACHE = "cache"
ROPE_IN_KERNEL = "compute"
ROPE_STEP = "step"
ROPE_MODES = (ROPE_STEP, ROPE_FROM_CACHE, ROPE_IN_KERNEL)


@dataclass(frozen=True)
class RotaryTable:
    """What a kernel needs to rotate a key at any position.

    cos_sin_cache: float32 ``[max_positions, head_dim]``; row ``p`` is ``cos(p*f) ++ sin(p*f)``.
    inv_freq:      float32 ``[head_dim // 2]``, the (possibly llama3-scaled) frequencies.
    mode:          ``"step"`` (default), ``"cache"`` or ``"compute"`` (see the module docstring).
    """

    cos_sin_cache: torch.Tensor
    inv_freq: torch.Tensor
    mode: str = ROPE_STEP

    def __post_init__(self) -> None:
        if self.mode not in ROPE_MODES:
            raise ValueError(f"rope mode must be one of {ROPE_MODES}, got {self.mode!r}")
        if self.cos_sin_cache.dim() != 2 or self.cos_sin_cache.shape[1] != 2 * self.inv_freq.numel():
            raise ValueError(
                f"cos_sin_cache {tuple(self.cos_sin_cache.shape)} does not match "
                f"inv_freq of {self.inv_freq.numel()} frequencies"
            )

    @property
    def head_dim(self) -> int:
        return self.cos_sin_cache.shape[1]

    @property
    def max_positions(self) -> int:
        return self.cos_sin_cache.shape[0]

    @property
    def from_cache(self) -> bool:
        """Whether kernels read cos/sin from the table (``step`` reads it too)."""
        return self.mode in (ROPE_FROM_CACHE, ROPE_STEP)

    @property
    def step(self) -> bool:
        return self.mode == ROPE_STEP

    @classmethod
    def from_inv_freq(
        cls, inv_freq: torch.Tensor, max_positions: int, mode: str = ROPE_STEP
    ) -> RotaryTable:
        """Build the table the way SGLang's ``RotaryEmbedding._compute_cos_sin_cache`` does."""
        inv_freq = inv_freq.float()
        t = torch.arange(max_positions, dtype=torch.float, device=inv_freq.device)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return cls(cache.contiguous(), inv_freq.contiguous(), mode)

    def to(self, device: torch.device | str) -> RotaryTable:
        return RotaryTable(
            self.cos_sin_cache.to(device, torch.float32).contiguous(),
            self.inv_freq.to(device, torch.float32).contiguous(),
            self.mode,
        )


def rotate_neox(x: torch.Tensor, positions: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Reference rotation of ``x [tokens, heads, head_dim]`` at ``positions [tokens]``.

    Computed in float32 and returned in ``x.dtype``, like SGLang's rope kernels.
    """
    cos, sin = table.cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
