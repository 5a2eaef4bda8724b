"""Seams in SGLang's CUDA graph runners: which graphs a batch may replay, and the graph sets we
capture besides SGLang's (keyed by the runner's variant label)."""

from __future__ import annotations

from .seam import Seam

TITLE = "CUDA graph runners"

_DECODE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
_PREFILL = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
_SPAN_GRAPHS = "sglang_pic.position_free.span_graphs"
_SPARSE_GRAPHS = "sglang_pic.sparse.graphs"
_GRAPH_SETS = "sglang_pic.graph_sets"

ROWS: tuple[Seam, ...] = (
    Seam(f"{_DECODE}.can_run_graph", f"{_SPAN_GRAPHS}:around_can_run_graph", "AROUND",
         "position-free-kv",
         why="on `pic_flashinfer`, batches that read moved keys keep off FlashInfer's graphs "
             "(with `--position-free-span-graphs` they replay the second set)"),
    Seam(f"{_PREFILL}.can_run_graph", f"{_SPAN_GRAPHS}:around_can_run_graph", "AROUND",
         "position-free-kv", why="likewise for prefill graphs"),
    # one hook per target for both features' graph sets (sglang_pic.graph_sets): two AROUND
    # hooks of ours on one target make SGLang warn at every start
    Seam(f"{_DECODE}._capture_one_stream", f"{_GRAPH_SETS}:around_capture_one_stream",
         "AROUND", "position-free-kv",
         why="our second decode graph sets: span decode steps by segmented attention "
             "(`--position-free-span-graphs`); for sparse decoding the sparse part, and on "
             "`pariskv_flashinfer` a third set for batches of only sparse rows"),
    Seam(f"{_DECODE}._make_graph_key", f"{_GRAPH_SETS}:around_make_graph_key", "AROUND",
         "position-free-kv", why="their variant labels: `shifted`, `pariskv`, `pariskv-all`"),
    Seam(f"{_DECODE}.load_batch", f"{_SPARSE_GRAPHS}:around_load_batch", "AROUND",
         "sparse-decode", why="the batch for the replay-side metadata (the padded view lacks "
                              "its request rows)"),
    Seam(f"{_PREFILL}.can_run_graph",
         "sglang_pic.sparse.prefill_offload:keep_offloaded_prefill_eager", "AROUND",
         "sparse-decode", "sparse_offload",
         why="batches that may attend an offloaded prefix run eagerly"),
)
