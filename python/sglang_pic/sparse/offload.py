"""The retrieval region's full-precision KV in host memory, and its GPU pool slots given back.

With ``--sparse-offload`` a sparse request's retrieval region leaves SGLang's GPU KV pool: when
tokens enter the region (at activation, and ``update`` at a time as the window slides), their
K/V are copied to this request slot's rows of ``HostKVRegion`` (pinned memory, read by the
attention kernel over PCIe for the ``topk`` selected rows only), and their pool slots are freed.
The GPU then holds, per sparse request, the sink, the local window and the retrieval metadata
(``index_ops``: 160 bytes per token and KV head at D = 128 instead of 512), so the pool serves
other requests with what a long context used to pin.

What that changes in SGLang, all in ``PoolSlotRelease``:

- the request's ``req_to_token`` row points the offloaded positions at slot 0, the pool's
  padding slot that is never allocated (SGLang writes padded tokens there);
- SGLang frees a finished (or retracted) request's whole row, so the allocator's ``free`` (of
  ``TokenToKVPoolAllocator``, one instance) is wrapped to drop slot 0: without it the padding slot
  would enter the free list once per offloaded token;
- nothing else may read those positions: dense attention over a sparse request never does (it is
  given a length of 1), and the settings that would (a radix tree indexing the prompt's slots,
  mixed chunked prefill running a decode token densely, pages of more than one token) are
  refused in ``backends.check_offload_settings``;
- SGLang's scheduler stops trying to admit waiting requests once one did not fit
  (``running_batch.batch_is_full``) until a running request finishes; memory freed mid-request
  would go unused, so ``around_get_new_batch_prefill`` (AROUND hook on
  ``Scheduler.get_new_batch_prefill``, registered with ``--sparse-offload`` only) clears that
  mark after a release, as SGLang itself does for sliding-window models whose pool frees
  mid-request.
"""

from __future__ import annotations

import torch

from .prefill_offload import release_finished_slots

PADDING_SLOT = 0  # SGLang's allocators never hand out slot 0 (padded tokens write there)
_freed_since_admission = False  # slots released since the scheduler last tried to admit


def around_get_new_batch_prefill(original, self, *args, **kwargs):
    """``Scheduler.get_new_batch_prefill(running_batch)``, with SGLang's "no room" mark cleared
    when pool slots were released since the last admission attempt (see module docstring), or
    when a sparse slot held by a request that finished during its prefill was given back
    (``prefill_offload.release_finished_slots``)."""
    global _freed_since_admission
    running_batch = kwargs["running_batch"] if "running_batch" in kwargs else args[0]
    if release_finished_slots(self, running_batch) or _freed_since_admission:
        _freed_since_admission = False
        running_batch.batch_is_full = False
    return original(self, *args, **kwargs)


class HostKVRegion:
    """K/V of every sparse slot's retrieval region: ``k``/``v`` ``[layers, slots, capacity,
    kv_heads, D]``, pinned when the model runs on a GPU (mapped, so kernels read it directly).

    Token-major like SGLang's pool, so the tokens entering a region are one contiguous copy;
    ``keys(layer)`` / ``values(layer)`` give the ``[slots, kv_heads, capacity, D]`` strided view
    the attention kernel reads (one ``D``-row per selected key either way)."""

    def __init__(self, layers: int, slots: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, pin: bool):
        shape = (layers, slots, capacity, kv_heads, head_dim)
        # rows past a region's length are never read (selection returns rows < n_ret)
        self.k = torch.empty(shape, dtype=dtype, pin_memory=pin)
        self.v = torch.empty(shape, dtype=dtype, pin_memory=pin)
        self.capacity = capacity

    def keys(self, layer: int) -> torch.Tensor:
        return self.k[layer].permute(0, 2, 1, 3)

    def values(self, layer: int) -> torch.Tensor:
        return self.v[layer].permute(0, 2, 1, 3)

    @staticmethod
    def bytes_needed(layers: int, slots: int, kv_heads: int, capacity: int, head_dim: int,
                     dtype: torch.dtype) -> int:
        return 2 * layers * slots * kv_heads * capacity * head_dim * dtype.itemsize

    def store(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor, offset: int) -> None:
        """Rows ``offset .. offset + n`` of ``slot`` <- ``k``/``v`` ``[n, kv_heads, D]`` (GPU or
        CPU). Asynchronous from a GPU: later kernels on the stream see the rows, and the pool
        slots they came from can be reused by kernels queued after the copy."""
        n = k.shape[0]
        if offset + n > self.capacity:
            raise ValueError(f"retrieval region of slot {slot} outgrows its host capacity "
                             f"({offset + n} > {self.capacity})")
        self.k[layer, slot, offset:offset + n].copy_(k, non_blocking=True)
        self.v[layer, slot, offset:offset + n].copy_(v, non_blocking=True)


class PoolSlotRelease:
    """Gives a request's offloaded positions back to SGLang's token allocator (see the module
    docstring). Replaces ``allocator.free`` on that one instance with a version that skips
    ``PADDING_SLOT`` once anything was offloaded (before that it is the original, untouched)."""

    def __init__(self, allocator, req_to_token: torch.Tensor):
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.released = 0  # slots given back so far
        self._free = allocator.free

        def free(free_index: torch.Tensor):  # sglang TokenToKVPoolAllocator.free, slot 0 kept out
            if self.released and free_index.numel():
                free_index = free_index[free_index != PADDING_SLOT]
            return self._free(free_index)

        allocator.free = free

    def release(self, pool_index: int, start: int, end: int) -> None:
        """Free the pool slots of positions ``[start, end)`` of request row ``pool_index``."""
        row = self.req_to_token[pool_index, start:end]
        slots = row.to(torch.int64, copy=True)
        row.fill_(PADDING_SLOT)
        self.released += end - start
        self._free(slots)
        global _freed_since_admission
        _freed_since_admission = True
