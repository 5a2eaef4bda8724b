"""Position-free KV cache (MiniPIC section 2.1): a cached span's keys serve it at any offset.

Layout (``stored_positions``): the model rotates keys as vanilla SGLang does and the pool keeps
them where they were computed, with that position per slot; a span reused at another offset is
turned by the distance it moved when read. A pool without spans in use is vanilla's pool. What
this changes in SGLang (the ``position-free-kv`` rows of the seam table, ``sglang_pic.compat``):

1. attention backends ``pic_flashinfer`` (GPU default: FlashInfer for every batch without moved
   keys, our Triton kernels for the others), ``pic_triton`` (our Triton kernels for every batch)
   and ``pic_torch_native`` (CPU), through ``attention_registry.register_attention_backend`` and
   ``server_args.add_attention_backend_choices``; ``sglang-pic serve --enable-position-free-kv``
   picks the one matching the chosen ``--attention-backend``;
2. an AFTER hook on ``ForwardBatch.init_new`` that records the positions of every batch's new
   keys and marks batches that read moved keys (``shifted_batches``), and AROUND hooks on the
   CUDA graph runners that keep those batches off ``pic_flashinfer``'s FlashInfer graphs and,
   with ``--position-free-span-graphs``, capture and replay a second decode graph set for them
   (``span_graphs``, hooked through ``sglang_pic.graph_sets``);
3. ``pic_torch_native`` must answer ``sglang.srt.utils.common.support_triton`` (which decides by
   backend *name* whether SGLang's Triton bookkeeping kernels may run) like ``torch_native``
   (False): ``CPU_BACKENDS``, answered by the plugin's one AROUND hook on it.
"""

from __future__ import annotations

BACKEND_FOR = {
    "flashinfer": "pic_flashinfer",
    "triton": "pic_triton",
    "torch_native": "pic_torch_native",
}
GPU_DEFAULT = "flashinfer"  # what --enable-position-free-kv picks on a GPU without --attention-backend
CPU_BACKENDS = ("pic_torch_native",)  # answer support_triton like torch_native
FLAG = "--enable-position-free-kv"


def register() -> None:
    """The feature's set-up: our attention backends in SGLang's registry and choices (its hooks
    are rows of ``sglang_pic.compat``, registered by the plugin)."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.server_args import add_attention_backend_choices

    from . import backends

    register_attention_backend("pic_flashinfer")(backends.create_pic_flashinfer)
    register_attention_backend("pic_triton")(backends.create_pic_triton)
    register_attention_backend("pic_torch_native")(backends.create_pic_torch_native)
    add_attention_backend_choices(list(BACKEND_FOR.values()))
