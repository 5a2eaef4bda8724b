"""Which forward batches read moved keys, and keeping those batches off the dense CUDA graphs.

In the shifted layout (``stored_positions``) a request without spans reads every key at the
position it was computed at, so a batch of such requests is vanilla attention: ``pic_flashinfer``
runs it on FlashInfer, CUDA graphs included. A request whose prompt reuses a cached span at
another offset (the span cache sets ``req.pic_segments``) reads moved keys; a batch holding one
runs our Triton kernels, which turn each key by the distance it moved, and runs without CUDA
graphs (the graphs hold the dense kernels).

Hooks (registered by ``position_free.register``):

* AFTER ``ForwardBatch.init_new`` (``mark_forward_batch``): records the positions of the batch's
  new keys in the slot table and sets ``forward_batch.pic_shifted``;
* AROUND ``DecodeCudaGraphRunner.can_run_graph`` / ``PrefillCudaGraphRunner.can_run_graph``
  (``no_graph_for_shifted``): False for a shifted batch.
"""

from __future__ import annotations

from typing import Any

from . import stored_positions

ATTR = "pic_shifted"
INIT_NEW_TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
GRAPH_TARGETS = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner."
    "can_run_graph",
)


def reads_moved_keys(req: Any) -> bool:
    """A request whose KV holds cached spans placed at an offset other than where they were
    computed (the span cache's segment layout)."""
    return getattr(req, "pic_segments", None) is not None


def is_shifted(forward_batch: Any) -> bool:
    return bool(getattr(forward_batch, ATTR, False))


def mark_forward_batch(result: Any, cls: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook for ``ForwardBatch.init_new(batch, model_runner, ...)``."""
    if stored_positions.table() is None:
        return
    stored_positions.record(result.out_cache_loc, result.positions)
    reqs = getattr(batch, "reqs", None) or ()
    setattr(result, ATTR, any(reads_moved_keys(r) for r in reqs))


def no_graph_for_shifted(original, self: Any, forward_batch: Any, *args: Any, **kwargs: Any):
    """AROUND hook for the CUDA graph runners' ``can_run_graph``."""
    if is_shifted(forward_batch):
        return False
    return original(self, forward_batch, *args, **kwargs)
