"""Which CUDA graphs a batch that reads moved keys may replay, and a second decode graph set for
it on ``pic_flashinfer`` (``--position-free-span-graphs``).

``pic_triton`` runs the same (shift-aware) Triton kernels for every batch, so its graphs serve
shifted batches as they are. ``pic_flashinfer`` captures its graphs with FlashInfer, which reads
keys as stored: a shifted batch must not replay them. Without the flag it runs eagerly; that
costs every layer's kernel launches on the host, and SGLang's overlap scheduler launches one
such decode step before a request's first token is returned (the note of headline row
``spans.cached_span_ttft``). With the flag the decode graph runner captures every batch size
twice, once as SGLang does (FlashInfer) and once with the shifted backend (segmented attention
in its padded layout, ``segmented_graphs``; ``ShiftedTritonBackend`` without the span cache)
under the graph variant label ``shifted`` (SGLang keys graphs by a variant label - its LoRA / no-LoRA graphs;
the sparse decoder's second set, ``sparse/graphs.py``, uses the same mechanism), and a shifted
decode batch replays the second set. A shifted extend may replay SGLang's prefill graphs when
they leave attention out (its default ``breakable`` backend, ``attention_outside``): the captured
pieces hold no attention kernel, and the backend's eager attention call between them reaches the
shifted backend as an eager forward does; a question after cached spans then costs its dense
layers' graph replays instead of hundreds of kernel launches.

AROUND hooks (rows of ``sglang_pic.compat.graph_runner``):

* ``DecodeCudaGraphRunner.can_run_graph`` / ``PrefillCudaGraphRunner.can_run_graph``
  (``around_can_run_graph``): a shifted decode batch on ``pic_flashinfer`` replays only the
  second decode set, and only if its requests' runs fit a captured segmented step
  (``graph_fits``); a shifted extend replays a prefill graph only if attention is outside it.
  The backend is told which decode set the batch about to be replayed needs
  (``replay_shifted``, for the graph key below; the runner's view of the batch carries no
  mark, and ``shifted_batches.is_shifted`` reads it as the batch it was built from);
* ``DecodeCudaGraphRunner._capture_one_stream``: runs the original twice on ``pic_flashinfer``
  with the flag, the second time with the backend's ``capture_shifted`` set;
* ``DecodeCudaGraphRunner._make_graph_key``: adds ``shifted`` to the variant label while
  capturing the second set and when replaying for a shifted batch.

The last two are reached through ``sglang_pic.graph_sets``, which hooks each of those methods
once for this set and the sparse decoder's; without the flag they pass straight through.
"""

from __future__ import annotations

from typing import Any

from . import shifted_batches

LABEL = "shifted"


_classes: tuple[type, type] | None = None  # (PositionFreeFlashInferBackend, DecodeCudaGraphRunner)


def _types() -> tuple[type, type]:
    """The two classes the hooks test, imported once: ``can_run_graph`` and ``_make_graph_key``
    run at every decode step, where an import statement per call cost ~1 us each."""
    global _classes
    if _classes is None:
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
            DecodeCudaGraphRunner,
        )

        from .backends import PositionFreeFlashInferBackend

        _classes = (PositionFreeFlashInferBackend, DecodeCudaGraphRunner)
    return _classes


def _flashinfer_twin(runner: Any):
    """The backend this graph runner captures with, if it is ``pic_flashinfer`` (graphs that
    hold dense kernels). With different prefill and decode backends SGLang wraps them in its
    ``HybridAttnBackend``: the decode runner captures its ``decode_backend``, the prefill
    runner its ``prefill_backend``."""
    model_runner = getattr(runner, "model_runner", None)
    backend = getattr(model_runner, "attn_backend", None)
    if not isinstance(backend, _types()[0]) and hasattr(backend, "decode_backend"):
        backend = getattr(backend, "decode_backend" if _is_decode_runner(runner)
                          else "prefill_backend", None)
    return backend if isinstance(backend, _types()[0]) else None


def _is_decode_runner(runner: Any) -> bool:
    return isinstance(runner, _types()[1])


def around_can_run_graph(original, self, forward_batch: Any, *args: Any, **kwargs: Any):
    backend = _flashinfer_twin(self)
    if backend is None:
        return original(self, forward_batch, *args, **kwargs)
    shifted = shifted_batches.is_shifted(forward_batch)
    decode = _is_decode_runner(self)
    if shifted and not decode:
        # a prefill graph whose attention runs eagerly between its captured pieces calls the
        # backend (segmented attention) like an eager forward does
        if not attention_outside(self):
            return False
        replays = original(self, forward_batch, *args, **kwargs)
        if replays:
            shifted_batches.count("prefill_graph_batches")
        return replays
    if shifted and not backend.span_graphs:
        return False
    if shifted and not getattr(backend.shifted, "graph_fits", lambda: True)():
        return False  # a request with more runs than a captured segmented step holds
    if decode:
        backend.replay_shifted = shifted
    return original(self, forward_batch, *args, **kwargs)


EAGER_ATTENTION_PREFILL = ("breakable",)
"""SGLang's prefill graph backends that leave attention out of their graphs: ``breakable`` (its
default on CUDA) captures the transformer body in pieces and calls the attention backend eagerly
between them, with the batch's real tokens and metadata planned outside the graph. ``full``
captures FlashInfer's kernels; ``tc_piecewise`` (torch.compile) is not measured with spans."""


def attention_outside(runner: Any) -> bool:
    """Whether this prefill graph runner calls the attention backend eagerly at replay."""
    name = getattr(runner, "prefill_backend_name", None)
    return str(getattr(name, "value", name)) in EAGER_ATTENTION_PREFILL


def around_capture_one_stream(original, self, *args: Any, **kwargs: Any):
    backend = _flashinfer_twin(self)
    if backend is None or not backend.span_graphs:
        return original(self, *args, **kwargs)
    backend.replay_shifted = False
    try:
        original(self, *args, **kwargs)
        backend.capture_shifted = True
        return original(self, *args, **kwargs)
    finally:
        backend.capture_shifted = False


def around_make_graph_key(original, self, size, stream_idx=None, variant_label=None):
    backend = _flashinfer_twin(self)
    if backend is not None and (backend.capture_shifted or backend.replay_shifted):
        variant_label = f"{variant_label}+{LABEL}" if variant_label else LABEL
    return original(self, size, stream_idx, variant_label)
