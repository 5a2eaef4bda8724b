"""The *shifted* KV layout: keys are stored rotated where they were computed, and each pool slot
records that position.

The model applies RoPE exactly as vanilla SGLang does, so a pool written by requests without
spans holds exactly what vanilla's pool holds and is read by FlashInfer's kernels unchanged.
A span computed alone (at positions ``0..L-1``) and reused at offset ``o`` keeps its pages;
attention turns each of its keys by ``o``, the distance between the slot's recorded position
and the key's index in the request (``sglang_pic_kernel.rotating_attention``, ``stored_positions``
argument). Only batches holding such a request need that kernel (``shifted_batches``).

One table per scheduler process (one KV pool), int32 ``[pool_slots]``, on the pool's device:
4 bytes a slot, 2 MB for a 500K-token pool. It is written

* for every token a forward computes: ``table[out_cache_loc] = positions`` (one scatter per batch,
  ``shifted_batches.mark_forward_batch``);
* for pages filled without a forward (span pages loaded from PTStore, ``spans/store_tier.py``):
  ``record_run``.

A slot's entry is read only while some request holds the slot, and every way a slot gets its
KV writes the entry first, so an entry is never stale when read.
"""

from __future__ import annotations

import torch

_table: torch.Tensor | None = None


def allocate(slots: int, device: torch.device | str) -> torch.Tensor:
    """Create (once per process) the table for a pool of ``slots`` token slots."""
    global _table
    want = torch.device(device)
    same_device = _table is not None and _table.device.type == want.type and (
        want.index is None or _table.device.index == want.index)
    if not same_device or _table.numel() < slots:
        _table = torch.zeros(slots, dtype=torch.int32, device=want)
    return _table


def table() -> torch.Tensor | None:
    """The process's table, or None when no shifted-layout backend runs here."""
    return _table


def record(slots: torch.Tensor, positions: torch.Tensor) -> None:
    """``table[slots] = positions`` for keys just computed (``slots``/``positions`` ``[tokens]``).

    Every forward batch calls this (decode steps too, outside the CUDA graph): ``index_copy_``
    rather than ``table[slots] = ...`` skips the advanced-indexing path's Python overhead (about
    half the host time of the call); the slots of one batch are distinct. No sync."""
    if _table is not None and slots is not None and slots.numel():
        _table.index_copy_(0, slots.to(torch.int64), positions.to(torch.int32))


def record_run(slots: torch.Tensor, first_position: int) -> None:
    """Slots holding keys computed at consecutive positions from ``first_position`` on."""
    if _table is not None and slots.numel():
        start = int(first_position)
        positions = torch.arange(
            start, start + slots.numel(), dtype=torch.int32, device=_table.device
        )
        _table[slots.to(device=_table.device, dtype=torch.int64)] = positions


def reset() -> None:
    """Forget the table (tests that build several pools in one process)."""
    global _table
    _table = None
