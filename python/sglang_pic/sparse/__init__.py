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

What this changes in SGLang, all registered by ``register()``: the three attention backends
(``attention_registry.register_attention_backend`` + ``add_attention_backend_choices``), two
AROUND hooks on SGLang's decode CUDA-graph runner (``graphs``: a second graph set with the sparse
part) and a BEFORE hook on ``TokenizerManager._validate_one_request`` (``admission``: with
``--sparse-offload``, a request longer than its host region is an HTTP 400); with
``--sparse-offload``, one AROUND hook on ``Scheduler.get_new_batch_prefill`` and the
allocator's ``free`` wrapped (``offload``). ``pariskv_torch_native`` answers ``support_triton`` like ``torch_native``
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
    import os

    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_attention_backend_choices

    from . import admission, backends, graphs, offload, prefill_offload

    register_attention_backend("pariskv_triton")(backends.create_pariskv_triton)
    register_attention_backend("pariskv_flashinfer")(backends.create_pariskv_flashinfer)
    register_attention_backend("pariskv_torch_native")(backends.create_pariskv_torch_native)
    add_attention_backend_choices(list(BACKEND_FOR.values()))
    graphs.register()
    HookRegistry.register(backends.INIT_NEW_HOOK, backends.record_request_rows, HookType.AFTER)
    # always registered: it reads the variables per request (SGLang's own launcher sets them
    # after this ran) and returns at once without --sparse-offload
    HookRegistry.register(admission.HOOK_TARGET, admission.check_request_length,
                          HookType.BEFORE)
    if os.environ.get("SGLANG_PIC_SPARSE_OFFLOAD") == "1":
        HookRegistry.register(offload.SCHEDULER_HOOK, offload.around_get_new_batch_prefill,
                              HookType.AROUND)
        # long prompts prefilled with their finished chunks in host memory (prefill_offload)
        HookRegistry.register(prefill_offload.WORKER_INFO_HOOK, prefill_offload.raise_input_limit,
                              HookType.AFTER)
        HookRegistry.register(prefill_offload.ADMISSION_HOOK,
                              prefill_offload.admit_offloaded_prompt, HookType.AROUND)
        HookRegistry.register(prefill_offload.NEW_TOKENS_HOOK, prefill_offload.clip_new_tokens,
                              HookType.AROUND)
        HookRegistry.register(prefill_offload.PREFILL_GRAPH_HOOK,
                              prefill_offload.keep_offloaded_prefill_eager, HookType.AROUND)
