"""Position-free KV cache (MiniPIC section 2.1): keys stored un-rotated, rotated on read.

A physical KV page then carries no position, so one copy of a span can serve requests that
place it at different offsets. What this changes in SGLang, all registered by ``register()``:

1. attention backends ``pic_triton`` (GPU, our Triton kernels) and ``pic_torch_native`` (CPU),
   through ``attention_registry.register_attention_backend`` and
   ``server_args.add_attention_backend_choices``; ``sglang-pic serve --enable-position-free-kv``
   picks the one matching the chosen ``--attention-backend``;
2. an AROUND hook on ``RotaryEmbedding.forward`` that rotates only the query once such a backend
   is active in the process (``rope_hook``);
3. ``pic_torch_native`` must answer ``sglang.srt.utils.common.support_triton`` (which decides by
   backend *name* whether SGLang's Triton bookkeeping kernels may run) like ``torch_native``
   (False): ``CPU_BACKENDS``, answered by the plugin's one AROUND hook on it.
"""

from __future__ import annotations

BACKEND_FOR = {"triton": "pic_triton", "torch_native": "pic_torch_native"}
CPU_BACKENDS = ("pic_torch_native",)  # answer support_triton like torch_native
FLAG = "--enable-position-free-kv"


def register() -> None:
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_attention_backend_choices

    from . import backends, rope_hook

    register_attention_backend("pic_triton")(backends.create_pic_triton)
    register_attention_backend("pic_torch_native")(backends.create_pic_torch_native)
    add_attention_backend_choices(list(BACKEND_FOR.values()))
    HookRegistry.register(rope_hook.HOOK_TARGET, rope_hook.rotate_query_only, HookType.AROUND)
