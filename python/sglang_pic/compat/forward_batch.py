"""Seams in SGLang's ``ForwardBatch``: what the model runner gets for each batch."""

from __future__ import annotations

from .seam import Seam

TITLE = "Forward batch"

_FB = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"

ROWS: tuple[Seam, ...] = (
    Seam(f"{_FB}.init_new", "sglang_pic.position_free.shifted_batches:mark_forward_batch",
         "AFTER", "position-free-kv",
         why="each computed key's position per slot; span requests' turned copies of moved "
             "pages (`--span-copy-on-reuse`); batches that read moved keys marked"),
    Seam(f"{_FB}.pic_shifted", "sglang_pic.position_free.shifted_batches:mark_forward_batch",
         "attribute", "position-free-kv", why="the batch reads moved keys"),
    Seam(f"{_FB}.init_new", "sglang_pic.sparse.backends:record_request_rows", "AFTER",
         "sparse-decode",
         why="each request's row as host ints: a sparse step's bookkeeping reads no GPU tensor"),
    Seam(f"{_FB}.sparse_request_rows", "sglang_pic.sparse.backends:record_request_rows",
         "attribute", "sparse-decode", why="those rows"),
)
