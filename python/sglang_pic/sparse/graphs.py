"""Sets of decode CUDA graphs: without the sparse part, with it, and with it alone.

A CUDA graph replays what was captured, so a decode graph that contains the sparse part pays
for it on every step, sparse requests in the batch or not, and with several slots that is of
the order of the dense step itself. So the decode graph runner
captures every batch size twice - once as SGLang does (dense only), once with the sparse part
under the graph-key label ``pariskv`` - and a step replays the sparse graph only when a sparse
request is in its batch. SGLang's runner already keys graphs by a variant label (its LoRA /
no-LoRA graphs); we add ours to that label. A third set, ``pariskv-all``, serves batches whose
request rows are all sparse, on backends that can write the new K/V without their dense decode
(FlashInfer): it leaves that decode out (at length 1 for sparse rows it computes nothing
anyone reads, yet costs its launches in every layer). Such a batch holds at most ``--sparse-max-requests`` rows, so this
set is captured only for the batch sizes it can be padded to.

What this patches, with AROUND hooks on SGLang's ``DecodeCudaGraphRunner`` (rows of
``sglang_pic.compat.graph_runner``; the first two through ``sglang_pic.graph_sets``, which hooks
them once for this set and the span decode steps'), only when the runner's attention backend is
``pariskv_triton`` or ``pariskv_flashinfer``:

- ``_capture_one_stream``: runs the original twice, the second time with the backend's
  ``capture_sparse`` set (``forward_decode`` then records the sparse part), and a third time
  over the small batch sizes with ``capture_only_sparse`` set too;
- ``_make_graph_key``: adds ``pariskv`` (``pariskv-all``) to the variant label while capturing
  those sets, and at replay when the batch has sparse rows (only sparse rows) (``load_batch``
  makes the key after the backend's ``init_forward_metadata_out_graph``, which decided that);
- ``load_batch``: hands the batch to the backend for that metadata init (the padded view it
  gets lacks the rids and request rows), so it finds the requests' rows without reading the GPU.
"""

from __future__ import annotations

LABEL = "pariskv"
LABEL_ONLY_SPARSE = "pariskv-all"


_mixin: type | None = None


def _sparse_backend(runner):
    """The runner's backend if it is one of ours with a sparse part. ``_make_graph_key`` runs at
    every decode step of every server (sparse or not): the class is imported once."""
    global _mixin
    if _mixin is None:
        from .backends import _GpuSparseMixin

        _mixin = _GpuSparseMixin
    model_runner = getattr(runner, "model_runner", None)
    backend = getattr(model_runner, "attn_backend", None)
    return backend if isinstance(backend, _mixin) else None


def around_capture_one_stream(original, self, *args, **kwargs):
    backend = _sparse_backend(self)
    if backend is None:
        return original(self, *args, **kwargs)
    # a recapture (e.g. after a weight update) may find the last step's sparse rows still set:
    # the capture's own forwards must see none, and the first set must be the dense one
    backend.sparse.deactivate()
    backend.capturing = True
    try:
        original(self, *args, **kwargs)
        backend.capture_sparse = True
        out = original(self, *args, **kwargs)
        backend.only_sparse_sizes = frozenset()  # a recapture may drop the set
        if backend.skips_dense:
            sizes = backend.only_sparse_capture_sizes(list(self.capture_bs))
            backend.only_sparse_sizes = frozenset(sizes)
            backend.capture_only_sparse = True
            every = self.capture_bs
            self.capture_bs = sizes  # what SGLang's capture loop walks
            try:
                out = original(self, *args, **kwargs)
            finally:
                self.capture_bs = every
        return out
    finally:
        backend.capturing = backend.capture_sparse = backend.capture_only_sparse = False


def around_make_graph_key(original, self, size, stream_idx=None, variant_label=None):
    backend = _sparse_backend(self)
    if backend is not None and backend.wants_sparse_graph():
        label = LABEL_ONLY_SPARSE if backend.wants_only_sparse_graph(size) else LABEL
        variant_label = f"{variant_label}+{label}" if variant_label else label
    return original(self, size, stream_idx, variant_label)


def around_load_batch(original, self, forward_batch, *args, **kwargs):
    """The batch itself, for the backend's replay-side metadata init: the padded view SGLang
    hands it has the batch's tensors but not its host-side fields (rids, the request rows
    ``backends.record_request_rows`` left), and without them the backend would read the request
    rows from the GPU (``tolist``), waiting for the previous step to finish."""
    backend = _sparse_backend(self)
    if backend is None:
        return original(self, forward_batch, *args, **kwargs)
    backend.replay_batch = forward_batch
    try:
        return original(self, forward_batch, *args, **kwargs)
    finally:
        backend.replay_batch = None
