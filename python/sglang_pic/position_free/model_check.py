"""What position-free KV supports, checked once at server start, and the model's RoPE table.

Everything here runs in the scheduler process when the attention backend is created (after the
model is loaded). Anything unsupported raises ``PositionFreeUnsupported`` with the reason, so
the server refuses to start instead of serving silently wrong attention.
"""

from __future__ import annotations

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class PositionFreeUnsupported(ValueError):
    """The model or server settings cannot run with position-free KV."""


def _refuse(reason: str) -> None:
    raise PositionFreeUnsupported(
        f"position-free KV (--enable-position-free-kv) does not support {reason}. "
        "Run without it, or change the setting named."
    )


def check_server_settings(model_runner) -> None:
    """Refuse settings whose attention path our kernels do not implement."""
    from sglang.srt.configs.model_config import AttentionArch

    config = model_runner.model_config
    args = model_runner.server_args
    archs = list(getattr(config.hf_config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        _refuse(f"architecture {archs} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if config.attention_arch == AttentionArch.MLA:
        _refuse("MLA attention")
    if getattr(config, "is_multimodal", False):
        _refuse("multimodal models (M-RoPE)")
    kv_dtype = getattr(model_runner, "kv_cache_dtype", None)
    if kv_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        _refuse(f"KV cache dtype {kv_dtype} (fp8 KV: keys would be quantised after rotation)")
    if getattr(model_runner, "sliding_window_size", None) is not None:
        _refuse("sliding-window attention")
    if getattr(args, "speculative_algorithm", None):
        _refuse(f"speculative decoding ({args.speculative_algorithm})")
    if getattr(args, "enable_deterministic_inference", False):
        _refuse("--enable-deterministic-inference")
    if getattr(args, "dcp_size", 1) not in (None, 1):
        _refuse("decode context parallelism")
    for flag in ("prefill_attention_backend", "decode_attention_backend"):
        chosen = getattr(args, flag, None)
        if chosen is not None and not str(chosen).startswith("pic_"):
            # a backend on one side that does not turn moved keys would read them unturned
            _refuse(f"--{flag.replace('_', '-')} {chosen} (both phases must be position-free)")


def find_rotary(model: torch.nn.Module):
    """The one RoPE module of the decoder; refuses variants the kernels would get wrong."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
    from sglang.srt.layers.rotary_embedding.rope_variant import Llama3RotaryEmbedding

    found = {id(m): m for m in model.modules() if isinstance(m, RotaryEmbedding)}
    if not found:
        _refuse("a model without RoPE")
    kinds = {(type(m), m.head_size, m.rotary_dim, m.base, m.is_neox_style) for m in found.values()}
    if len(kinds) > 1:
        _refuse(f"models with several RoPE configurations ({len(kinds)})")
    rotary = next(iter(found.values()))
    if type(rotary) not in (RotaryEmbedding, Llama3RotaryEmbedding):
        _refuse(f"RoPE variant {type(rotary).__name__} (supported: plain, llama3 scaling)")
    if not rotary.is_neox_style:
        _refuse("interleaved (GPT-J style) RoPE")
    if rotary.rotary_dim != rotary.head_size:
        _refuse(f"partial rotary (rotary_dim {rotary.rotary_dim} < head_dim {rotary.head_size})")
    return rotary


def model_rotary(model_runner):
    """The model's RoPE module, its cos/sin cache grown to the context length with SGLang's own
    ``_ensure_cos_sin_cache_length`` (keys are rotated at every position up to it)."""
    rotary = find_rotary(model_runner.model)
    context_len = int(model_runner.model_config.context_len)
    if rotary.cos_sin_cache.shape[0] <= context_len:
        rotary._ensure_cos_sin_cache_length(context_len)
    return rotary


def rotary_table(model_runner):
    """The kernels' RoPE table: SGLang's own cos/sin cache in float32 (a moved key is turned by
    the table row of the distance it moved)."""
    from sglang_pic_kernel.rotating_attention import RotaryTable

    rotary = model_rotary(model_runner)
    return RotaryTable(rotary.cos_sin_cache.float()).to(model_runner.device)
