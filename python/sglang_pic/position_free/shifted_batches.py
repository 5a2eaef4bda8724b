"""Which forward batches read moved keys, and the positions of the keys every batch computes.

In the shifted layout (``stored_positions``) a request without spans reads every key at the
position it was computed at, so a batch of such requests is vanilla attention: ``pic_flashinfer``
runs it on FlashInfer, CUDA graphs included. A request whose prompt reuses a cached span at
another offset (the span cache sets ``req.pic_segments``) reads moved keys; a batch holding one
runs our Triton kernels, which turn each key by the distance it moved (which CUDA graphs such a
batch may replay: ``span_graphs``).

AFTER hook on ``ForwardBatch.init_new`` (``mark_forward_batch``, registered by
``position_free.register``): records the positions of the batch's new keys in the slot table
and sets ``forward_batch.pic_shifted``.
"""

from __future__ import annotations

from typing import Any

from . import stored_positions

ATTR = "pic_shifted"
INIT_NEW_TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"


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

