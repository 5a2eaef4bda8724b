"""Seams in SGLang's CUDA graph runners: which graphs a batch may replay, and the graph sets we
capture besides SGLang's (keyed by the runner's variant label)."""

from __future__ import annotations

from .seam import Seam

TITLE = "CUDA graph runners"

_DECODE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
_PREFILL = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
_SPAN_GRAPHS = "sglang_pic.position_free.span_graphs"
_SPARSE_GRAPHS = "sglang_pic.sparse.graphs"

ROWS: tuple[Seam, ...] = (
    Seam(f"{_DECODE}.can_run_graph", f"{_SPAN_GRAPHS}:around_can_run_graph", "AROUND",
         "position-free-kv",
         why="on `pic_flashinfer`, batches that read moved keys keep off FlashInfer's graphs "
             "(with `--position-free-span-graphs` they replay the second set)"),
    Seam(f"{_PREFILL}.can_run_graph", f"{_SPAN_GRAPHS}:around_can_run_graph", "AROUND",
         "position-free-kv", why="likewise for prefill graphs"),
    Seam(f"{_DECODE}._capture_one_stream", f"{_SPAN_GRAPHS}:around_capture_one_stream",
         "AROUND", "position-free-kv", "span_graphs",
         why="a second decode graph set with the shift-aware kernels"),
    Seam(f"{_DECODE}._make_graph_key", f"{_SPAN_GRAPHS}:around_make_graph_key", "AROUND",
         "position-free-kv", "span_graphs", why="its variant label, `shifted`"),
    Seam(f"{_DECODE}._capture_one_stream", f"{_SPARSE_GRAPHS}:around_capture_one_stream",
         "AROUND", "sparse-decode",
         why="a second graph set with the sparse part, and on `pariskv_flashinfer` a third for "
             "batches of only sparse rows, without the dense decode"),
    Seam(f"{_DECODE}._make_graph_key", f"{_SPARSE_GRAPHS}:around_make_graph_key", "AROUND",
         "sparse-decode", why="their variant labels, `pariskv` and `pariskv-all`"),
    Seam(f"{_DECODE}.load_batch", f"{_SPARSE_GRAPHS}:around_load_batch", "AROUND",
         "sparse-decode", why="the batch for the replay-side metadata (the padded view lacks "
                              "its request rows)"),
    Seam(f"{_PREFILL}.can_run_graph",
         "sglang_pic.sparse.prefill_offload:keep_offloaded_prefill_eager", "AROUND",
         "sparse-decode", "sparse_offload",
         why="batches that may attend an offloaded prefix run eagerly"),
)
