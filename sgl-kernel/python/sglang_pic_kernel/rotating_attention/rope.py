"""The RoPE table of the rotating-attention kernels, and the torch reference rotation.

Position-free KV in the *shifted layout*: the model rotates keys as vanilla SGLang does and they
are stored rotated at the position they were computed at, ``stored_positions[slot]``. A key read
at logical position ``l`` (its index in the request's KV sequence) is turned by ``l - s`` in the
kernel. RoPE rotations compose (``rope(rope(k, s), l - s) = rope(k, l)``, llama3 frequency
scaling included: it only changes the frequencies), so one table row per distance suffices:
row ``p`` holds ``cos(p f) ++ sin(p f)``, the numbers SGLang's own ``cos_sin_cache`` holds. Keys
that did not move (``l == s``, every key of a request without spans) read no table row.

Only the neox layout (``rotate_half``: dims ``[0, d/2)`` pair with ``[d/2, d)``) over the full
head dimension is supported: Llama 2/3.x, Qwen2/2.5/3 and Mistral all use it in SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RotaryTable:
    """What a kernel needs to turn a key by any distance.

    cos_sin_cache: float32 ``[max_positions, head_dim]``; row ``p`` is ``cos(p*f) ++ sin(p*f)``
    for the model's (possibly llama3-scaled) frequencies ``f``. Distances are clamped to
    ``max_positions - 1``: size it to the context length.
    """

    cos_sin_cache: torch.Tensor

    def __post_init__(self) -> None:
        if self.cos_sin_cache.dim() != 2 or self.cos_sin_cache.shape[1] % 2:
            raise ValueError(
                f"cos_sin_cache must be [max_positions, head_dim] with an even head_dim, "
                f"got {tuple(self.cos_sin_cache.shape)}"
            )

    @property
    def head_dim(self) -> int:
        return self.cos_sin_cache.shape[1]

    @property
    def max_positions(self) -> int:
        return self.cos_sin_cache.shape[0]

    @classmethod
    def from_inv_freq(cls, inv_freq: torch.Tensor, max_positions: int) -> RotaryTable:
        """Build the table the way SGLang's ``RotaryEmbedding._compute_cos_sin_cache`` does."""
        inv_freq = inv_freq.float()
        t = torch.arange(max_positions, dtype=torch.float, device=inv_freq.device)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return cls(cache.contiguous())

    def to(self, device: torch.device | str) -> RotaryTable:
        return RotaryTable(self.cos_sin_cache.to(device, torch.float32).contiguous())


def rotate_neox(x: torch.Tensor, positions: torch.Tensor, table: RotaryTable) -> torch.Tensor:
    """Reference rotation of ``x [tokens, heads, head_dim]`` at ``positions [tokens]``.

    Computed in float32 and returned in ``x.dtype``, like SGLang's rope kernels.
    """
    cos, sin = table.cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
