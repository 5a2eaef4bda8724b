"""Sparse long-context decoding (ParisKV, arXiv:2602.07721).

- ``retrieval``: the torch reference of ParisKV's top-k key retrieval (SRHT rotation, analytic
  sign-pattern centroids, collision voting, 4-bit RSQ-IP rerank) and of sparse attention over
  sink + local window + retrieved tokens merged by log-sum-exp; the Triton kernels
  (``sglang_pic_kernel.pariskv``) are tested against it;
- ``kv_layout``: the standalone per-layer layout with the retrieval region's KV in pinned host
  memory (what the kernel benchmark times);
- ``offload``: the same layout inside SGLang (``--sparse-offload``): retrieval-region KV in
  pinned host memory, its GPU pool slots freed (the one place that touches SGLang's allocator);
- in SGLang: ``backends`` (attention backends ``pariskv_triton`` / ``pariskv_flashinfer`` /
  ``pariskv_torch_native``, picked by ``sglang-pic serve --sparse-decode pariskv``), ``decode_state`` (which requests
  decode sparsely and what they attend), ``index_ops`` (kernels or torch), ``config`` (knobs).

What this changes in SGLang (the ``sparse-decode`` rows of the seam table, ``sglang_pic.compat``):
the three attention backends (``attention_registry.register_attention_backend`` +
``add_attention_backend_choices``, by ``register()``), AROUND hooks on SGLang's decode CUDA-graph
runner (``graphs``: a second graph set with the sparse part), an AFTER hook on
``ForwardBatch.init_new`` (``backends.record_request_rows``) and a BEFORE hook on
``TokenizerManager._validate_one_request`` (``admission``: with ``--sparse-offload``, a request
longer than its host region is an HTTP 400); with ``--sparse-offload``, an AROUND hook on
``Scheduler.get_new_batch_prefill`` and the allocator's ``free`` wrapped (``offload``), and the
hooks of ``prefill_offload`` for prompts longer than the pool. ``pariskv_torch_native`` answers ``support_triton`` like ``torch_native``
(``CPU_BACKENDS``, in the plugin's one hook on it).
"""

from __future__ import annotations

BACKEND_FOR = {
    "triton": "pariskv_triton",
    "flashinfer": "pariskv_flashinfer",
    "torch_native": "pariskv_torch_native",
}
CPU_BACKENDS = ("pariskv_torch_native",)  # answer support_triton like torch_native
FLAG = "--sparse-decode"
OFFLOAD_FLAG = "--sparse-offload"  # no value: sets SparseDecodeConfig.offload
OPTIONS = {  # sglang-pic serve flag -> SparseDecodeConfig field
    "--sparse-threshold": "threshold",
    "--sparse-topk": "topk",
    "--sparse-candidates": "candidates",
    "--sparse-sink": "sink",
    "--sparse-local": "local",
    "--sparse-update": "update",
    "--sparse-max-requests": "max_requests",
    "--sparse-max-context": "max_context",
}


def register() -> None:
    """The feature's set-up: our attention backends in SGLang's registry and choices."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.server_args import add_attention_backend_choices

    from . import backends

    register_attention_backend("pariskv_triton")(backends.create_pariskv_triton)
    register_attention_backend("pariskv_flashinfer")(backends.create_pariskv_flashinfer)
    register_attention_backend("pariskv_torch_native")(backends.create_pariskv_torch_native)
    add_attention_backend_choices(list(BACKEND_FOR.values()))
