"""Attention backends that read un-rotated keys and rotate them at their logical position.

``pic_triton``: SGLang's ``TritonAttnBackend`` with its two kernel entry points
(``decode_attention_fwd``, ``extend_attention_fwd`` - instance attributes it calls for every
layer) swapped for our rotating kernels from ``sglang_pic_kernel.rotating_attention``. Metadata,
CUDA graphs, paging and KV writes stay SGLang's.

``pic_torch_native``: SGLang's ``TorchNativeAttnBackend`` (the CPU engine's backend) with the
key buffer wrapped so that the per-request key gather ``k_cache[req_to_token[r, :len]]`` returns
keys rotated at ``0..len-1`` with SGLang's own rotation code: on CPU, outputs are bit-identical
to vanilla.
"""

from __future__ import annotations

import functools

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

from . import model_check, rope_hook


class PositionFreeTritonBackend(TritonAttnBackend):
    def __init__(self, model_runner, skip_prefill: bool = False, kv_indptr_buf=None):
        model_check.check_server_settings(model_runner)
        table = model_check.rotary_table(model_runner)
        super().__init__(model_runner, skip_prefill=skip_prefill, kv_indptr_buf=kv_indptr_buf)
        from sglang_pic_kernel.rotating_attention import (
            rotating_decode_attention_fwd,
            rotating_extend_attention_fwd,
        )

        self.decode_attention_fwd = torch.compiler.disable(
            functools.partial(rotating_decode_attention_fwd, rope=table)
        )
        self.extend_attention_fwd = torch.compiler.disable(
            functools.partial(
                rotating_extend_attention_fwd, rope=table, new_keys=model_check.new_keys_mode()
            )
        )
        rope_hook.activate()


class _KeysRotatedOnRead:
    """Stands in for a layer's key buffer inside ``TorchNativeAttnBackend._run_sdpa_forward_*``.

    Those methods only index it with one request's slots in sequence order
    (``req_to_token[r, 0:seq_len]``), so key ``i`` of the result belongs at position ``i``.
    """

    def __init__(self, buffer: torch.Tensor, rotary) -> None:
        self.buffer = buffer
        self.rotary = rotary

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        keys = self.buffer[slots]
        positions = torch.arange(keys.shape[0], device=keys.device)
        cos, sin = self.rotary.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return self.rotary._apply_rotary_emb_wrapped(keys, cos, sin, self.rotary.is_neox_style)


class PositionFreeTorchNativeBackend(TorchNativeAttnBackend):
    def __init__(self, model_runner):
        model_check.check_server_settings(model_runner)
        super().__init__(model_runner)
        self.rotary = model_check.model_rotary(model_runner)
        rope_hook.activate()

    def _run_sdpa_forward_extend(self, query, output, k_cache, *args, **kwargs):
        return super()._run_sdpa_forward_extend(
            query, output, _KeysRotatedOnRead(k_cache, self.rotary), *args, **kwargs
        )

    def _run_sdpa_forward_decode(self, query, output, k_cache, *args, **kwargs):
        return super()._run_sdpa_forward_decode(
            query, output, _KeysRotatedOnRead(k_cache, self.rotary), *args, **kwargs
        )


def create_pic_triton(model_runner):
    return PositionFreeTritonBackend(model_runner)


def create_pic_torch_native(model_runner):
    return PositionFreeTorchNativeBackend(model_runner)
