"""Attention backends for position-free KV in the shifted layout (``stored_positions``).

Keys are rotated by the model, as in vanilla SGLang, and stored where they were computed; a
span reused at another offset is turned by the distance it moved when read. So:

``pic_flashinfer`` (GPU default): SGLang's ``FlashInferAttnBackend`` for every batch that reads
no moved key (plain prompts, span prefills: what vanilla runs, CUDA graphs included), and
segmented attention on FlashInfer's batch kernels (``segmented_backend``) for batches that do
(``shifted_batches``): eagerly, or its decode steps as a second CUDA graph set with
``--position-free-span-graphs``; ``ShiftedTritonBackend`` instead without the span radix cache
(no key runs to plan from). The choice is per forward batch, and a batch's metadata and forward
calls all go to the backend chosen.

``pic_triton``: ``ShiftedTritonBackend`` for every batch: SGLang's ``TritonAttnBackend`` with its
two kernel entry points (``decode_attention_fwd``, ``extend_attention_fwd`` - instance attributes
it calls for every layer) swapped for ``sglang_pic_kernel.rotating_attention``'s kernels given
the slot table. Metadata, CUDA graphs, paging and KV writes stay SGLang's. For a batch without
moved keys the kernels read no RoPE table (every key's shift is zero).

``pic_torch_native`` (CPU): SGLang's ``TorchNativeAttnBackend``; with the span radix cache a
batch with moved keys runs segmented attention on torch kernels (the GPU path's logic), else the
key buffer is wrapped so that the per-request key gather ``k_cache[req_to_token[r, :len]]`` turns
moved keys by the distance they moved; requests without spans are bit-identical to vanilla.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

from . import model_check, moved_copies, shifted_batches, stored_positions
from .moved_copies import turn_keys
from .run_kernels import FlashInferRunKernels, TorchRunKernels
from .segmented_backend import SegmentedAttention


def _slot_table(model_runner) -> torch.Tensor:
    """The process's stored-position table, sized to the KV pool's slots."""
    pool = model_runner.token_to_kv_pool
    buffers = getattr(pool, "k_buffer", None)
    if buffers:
        slots = int(buffers[0].shape[0])
    else:
        slots = int(pool.size) + int(getattr(pool, "page_size", 1)) + 1
    return stored_positions.allocate(slots, model_runner.device)


class ShiftedTritonBackend(TritonAttnBackend):
    def __init__(self, model_runner, skip_prefill: bool = False, kv_indptr_buf=None):
        model_check.check_server_settings(model_runner)
        rope = model_check.rotary_table(model_runner)
        table = _slot_table(model_runner)
        super().__init__(model_runner, skip_prefill=skip_prefill, kv_indptr_buf=kv_indptr_buf)
        if hasattr(self, "enable_lean_attention"):
            # SGLang 0.5.23's lean decode splits the KV over a persistent grid with its own
            # partial-result buffers; our decode kernel splits it its own way
            self.enable_lean_attention = False
        from sglang_pic_kernel.rotating_attention import (
            rotating_decode_attention_fwd,
            rotating_extend_attention_fwd,
        )

        from sglang_pic.launcher.server_flags import setting

        # the kernel takes its launch configuration as an argument: --position-free-decode-config
        self.decode_attention_fwd = torch.compiler.disable(
            functools.partial(rotating_decode_attention_fwd, rope=rope, stored_positions=table,
                              config=setting("--position-free-decode-config"))
        )
        self.extend_attention_fwd = torch.compiler.disable(
            functools.partial(rotating_extend_attention_fwd, rope=rope, stored_positions=table)
        )


class PositionFreeFlashInferBackend(AttentionBackend):
    """FlashInfer for batches without moved keys, segmented attention (or
    ``ShiftedTritonBackend``, see the module docstring) for the others.

    CUDA graphs are captured with FlashInfer; with ``--position-free-span-graphs`` (``span_graphs``)
    the decode graphs are captured a second time with the shifted backend for shifted batches,
    which otherwise run eagerly. Attributes SGLang reads from its backend (workspace,
    wrappers, flags) are FlashInfer's.
    """

    def __init__(self, model_runner):
        from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

        from sglang_pic.launcher.server_flags import setting

        model_check.check_server_settings(model_runner)
        # built as SGLang's own "flashinfer" factory builds it (attention_registry), workspace
        # choice included, so batches without moved keys run exactly vanilla's backend
        self.dense = FlashInferAttnBackend(
            model_runner, init_new_workspace=getattr(model_runner, "init_new_workspace", False)
        )
        self.span_graphs = bool(setting("--position-free-span-graphs"))
        # the positions every batch's new keys were computed at: without the table no batch is
        # marked as reading moved keys (shifted_batches), whichever backend reads them
        _slot_table(model_runner)
        if moved_copies.wanted(model_runner):
            self.shifted = SegmentedAttention(model_runner, _flashinfer_run_kernels(
                model_runner, self.dense))
        else:  # the shift-aware kernels: no span cache to find runs
            self.shifted = ShiftedTritonBackend(model_runner)
        self.needs_cpu_seq_lens = self.dense.needs_cpu_seq_lens or self.shifted.needs_cpu_seq_lens
        self.capture_shifted = False  # capturing the second decode graph set (span_graphs)
        self.replay_shifted = False  # the decode graph about to be replayed is a shifted one

    def _pick(self, forward_batch) -> AttentionBackend:
        if self.capture_shifted:
            return self.shifted
        # the batch, or a runner's copy of it, the one a graph replays included (is_shifted);
        # the dense graphs are captured before any batch exists, so with FlashInfer
        return self.shifted if shifted_batches.is_shifted(forward_batch) else self.dense

    def __getattr__(self, name: str) -> Any:
        # only called for names this object lacks: SGLang reading FlashInfer's attributes
        if name in ("dense", "shifted"):
            raise AttributeError(name)
        return getattr(self.dense, name)

    def init_forward_metadata(self, forward_batch):
        self._pick(forward_batch).init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        self._pick(forward_batch).init_forward_metadata_out_graph(
            forward_batch, in_capture=in_capture
        )

    def init_forward_metadata_in_graph(self, forward_batch):
        self._pick(forward_batch).init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.dense.init_cuda_graph_state(max_bs, max_num_tokens)
        if self.span_graphs:
            self.shifted.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.dense.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        return self.dense.on_after_cuda_graph_warmup()

    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None,
                save_kv_cache: bool = True, **kwargs):
        return self._pick(forward_batch).forward(
            q, k, v, layer, forward_batch, save_kv_cache, **kwargs
        )

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._pick(forward_batch).forward_decode(
            q, k, v, layer, forward_batch, save_kv_cache, **kwargs
        )

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._pick(forward_batch).forward_extend(
            q, k, v, layer, forward_batch, save_kv_cache, **kwargs
        )


def _flashinfer_run_kernels(model_runner, dense) -> FlashInferRunKernels:
    """Segmented attention's FlashInfer kernels, shaped and configured as ``dense``'s (heads per
    attention-TP rank, query and pool dtypes, tensor-core decode)."""
    from sglang.srt.runtime_context import get_parallel

    cfg = model_runner.model_config
    tp = get_parallel().attn_tp_size
    return FlashInferRunKernels(
        dense.workspace_buffer, cfg.num_attention_heads // tp, cfg.get_num_kv_heads(tp),
        cfg.head_dim, model_runner.dtype, dense.flashinfer_kv_cache_dtype, cfg.head_dim ** -0.5,
        dense.decode_use_tensor_cores)


class _KeysTurnedOnRead:
    """Stands in for a layer's key buffer inside ``TorchNativeAttnBackend._run_sdpa_forward_*``.

    Those methods only index it with one request's slots in sequence order
    (``req_to_token[r, 0:seq_len]``), so key ``i`` of the result belongs at position ``i``; a key
    stored at another position is turned by the difference.
    """

    def __init__(self, buffer: torch.Tensor, table: torch.Tensor, rotary) -> None:
        self.buffer = buffer
        self.table = table
        self.rotary = rotary

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        keys = self.buffer[slots]
        index = torch.arange(keys.shape[0], device=keys.device)
        shift = index - self.table[slots].to(index.dtype)
        moved = shift != 0
        if not bool(moved.any()):
            return keys
        keys = keys.clone()
        keys[moved] = turn_keys(keys[moved], shift[moved], self.rotary.cos_sin_cache)
        return keys


class PositionFreeTorchNativeBackend(TorchNativeAttnBackend):
    def __init__(self, model_runner):
        model_check.check_server_settings(model_runner)
        super().__init__(model_runner)
        self.rotary = model_check.model_rotary(model_runner)
        self.table = _slot_table(model_runner)
        self.segmented = None  # with the span cache: batches with moved keys run segmented
        if moved_copies.wanted(model_runner):
            cfg = model_runner.model_config
            self.segmented = SegmentedAttention(model_runner, TorchRunKernels(
                cfg.head_dim ** -0.5))

    def _segmented(self, forward_batch):
        if self.segmented is not None and shifted_batches.is_shifted(forward_batch):
            return self.segmented
        return None

    def init_forward_metadata(self, forward_batch):
        (self._segmented(forward_batch) or super()).init_forward_metadata(forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        seg = self._segmented(forward_batch)
        if seg is not None:
            return seg.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        seg = self._segmented(forward_batch)
        if seg is not None:
            return seg.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _keys(self, k_cache):
        """A batch without moved keys is read as vanilla torch_native reads it, as pic_flashinfer
        hands such a batch to FlashInfer: the CPU engine runs the same split. The batch being
        run is the one ``init_new`` built last (``shifted_batches.current``)."""
        if shifted_batches.current():
            return _KeysTurnedOnRead(k_cache, self.table, self.rotary)
        return k_cache

    def _run_sdpa_forward_extend(self, query, output, k_cache, *args, **kwargs):
        return super()._run_sdpa_forward_extend(query, output, self._keys(k_cache), *args,
                                                **kwargs)

    def _run_sdpa_forward_decode(self, query, output, k_cache, *args, **kwargs):
        return super()._run_sdpa_forward_decode(query, output, self._keys(k_cache), *args,
                                                **kwargs)


def create_pic_flashinfer(model_runner):
    return PositionFreeFlashInferBackend(model_runner)


def create_pic_triton(model_runner):
    return ShiftedTritonBackend(model_runner)


def create_pic_torch_native(model_runner):
    return PositionFreeTorchNativeBackend(model_runner)
