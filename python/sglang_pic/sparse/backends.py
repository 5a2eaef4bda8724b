"""Attention backends with sparse long-context decoding: SGLang's own backend for prefill and
for short requests, ParisKV for the decode steps of long ones.

``pariskv_triton`` / ``pariskv_flashinfer`` (GPU): SGLang's ``TritonAttnBackend`` /
``FlashInferAttnBackend``. Its decode metadata is built with a length of 1 for sparse rows (so
the dense kernel skips their context), and after its decode kernel the sparse rows of the output
are overwritten by ParisKV attention over sink + retrieved + local keys (``decode_state``;
kernels in ``sglang_pic_kernel.pariskv``). The sparse part has fixed shapes and lives in static
buffers, so SGLang captures it in its decode CUDA graphs: a second set of graphs, replayed only
for batches with sparse rows (``graphs``). With ``pariskv_flashinfer`` prefill, short requests
and every batch without sparse rows run FlashInfer's kernels, as vanilla SGLang on FlashInfer.

``pariskv_torch_native`` (CPU engine): SGLang's ``TorchNativeAttnBackend``, the same split, with
the torch reference of the selection (``index_ops.TorchIndexOps``).

Prefill (extend) stays SGLang's, dense. Settings the sparse path does not implement are refused
when the backend is created, with the reason.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from sglang.srt.layers.attention.flashinfer_backend import DecodeMetadata, FlashInferAttnBackend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_pic.compat.request_state import pool_row

from . import prefill_offload
from .config import (
    HOST_MEMORY_SHARE,
    SparseDecodeConfig,
    SparseDecodeUnsupported,
    host_memory_available,
)
from .decode_state import SparseDecodeState
from .index_ops import KernelIndexOps, TorchIndexOps
from .metrics import metrics_for
from .offload import HostKVRegion, PoolSlotRelease

logger = logging.getLogger(__name__)
FLAG = "--sparse-decode pariskv"
GPU_MEMORY_MARGIN = 2 << 30  # left free for activations after the retrieval metadata


def _refuse(reason: str) -> None:
    raise SparseDecodeUnsupported(f"sparse decoding ({FLAG}) does not support {reason}.")


def check_server_settings(model_runner, backend_name: str) -> None:
    from sglang.srt.configs.model_config import AttentionArch

    config = model_runner.model_config
    args = model_runner.server_args
    if config.attention_arch == AttentionArch.MLA:
        _refuse("MLA attention")
    if getattr(config, "is_encoder_decoder", False):
        _refuse("encoder-decoder models")
    if getattr(model_runner, "sliding_window_size", None) is not None:
        _refuse("sliding-window attention")
    kv_dtype = getattr(model_runner, "kv_cache_dtype", None)
    if kv_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        _refuse(f"KV cache dtype {kv_dtype}")
    if getattr(args, "speculative_algorithm", None):
        _refuse(f"speculative decoding ({args.speculative_algorithm})")
    if getattr(args, "dcp_size", 1) not in (None, 1):
        _refuse("decode context parallelism")
    if getattr(args, "enable_dp_attention", False):
        _refuse("--enable-dp-attention")
    for flag in ("decode_attention_backend", "prefill_attention_backend"):
        chosen = getattr(args, flag, None)
        if chosen is not None and chosen != backend_name:
            # SGLang would wrap us in its hybrid backend: our graph hooks would not find us, and
            # extend batches (how a slot learns its pool index serves another request) would
            # not reach us
            _refuse(f"--{flag.replace('_', '-')} {chosen} (both phases must use {backend_name})")
    for flag in ("enable_two_batch_overlap", "enable_pdmux"):
        if getattr(args, flag, False):
            _refuse(f"--{flag.replace('_', '-')}")
    if getattr(args, "disaggregation_mode", "null") not in (None, "null"):
        # a decode instance runs no prefill, so nothing tells a slot its request has changed
        _refuse(f"--disaggregation-mode {args.disaggregation_mode}")
    layers = attention_layers(model_runner)
    if not layers:
        _refuse("a model without RadixAttention layers")
    pool = model_runner.token_to_kv_pool
    first = getattr(pool, "start_layer", 0) or 0
    if sorted(m.layer_id for m in layers) != list(range(first, first + pool.layer_num)):
        _refuse("hybrid models (attention in only some layers, or layers the KV pool renumbers)")
    if any((m.logit_cap or 0) > 0 for m in layers):
        _refuse("attention logit soft-capping")
    if any(getattr(m, "is_cross_attention", False) for m in layers):
        _refuse("cross-attention")
    shapes = {(m.tp_q_head_num, m.tp_k_head_num, m.qk_head_dim, m.v_head_dim) for m in layers}
    if len(shapes) > 1:
        _refuse(f"layers of different attention shapes ({sorted(shapes)})")
    hq, hkv, d, dv = shapes.pop()
    if hq % hkv or hq // hkv > 16:
        _refuse(f"{hq} query heads over {hkv} KV heads (at most 16 per KV head)")
    if d < 64 or d & (d - 1):
        _refuse(f"head dim {d} (a power of two >= 64 is needed by the SRHT and the 4-bit codes)")
    if dv != d:
        _refuse("a value head dim different from the key head dim")


def check_offload_settings(model_runner) -> None:
    """What ``--sparse-offload`` needs: nothing but the request itself may hold or read the pool
    slots it frees (``offload.py``)."""
    args = model_runner.server_args
    if not getattr(args, "disable_radix_cache", False):
        _refuse("--sparse-offload with a radix cache (the tree indexes the prompt's pool slots, "
                "which offloading frees; add --disable-radix-cache)")
    if getattr(args, "enable_mixed_chunk", False):
        _refuse("--sparse-offload with --enable-mixed-chunk (a decode token run in a prefill "
                "batch attends densely, over slots offloading has freed)")
    if (getattr(args, "page_size", 1) or 1) != 1:
        _refuse(f"--sparse-offload with --page-size {args.page_size} (slots are freed one token "
                "at a time)")
    if getattr(model_runner, "token_to_kv_pool_allocator", None) is None:
        _refuse("--sparse-offload before SGLang created its token allocator")


def check_offloaded_prefill_fits(model_runner, cfg: SparseDecodeConfig, max_context: int) -> None:
    """A prompt longer than the GPU pool is admitted on a credit (``prefill_offload``): it holds
    at most ``pool_need`` tokens of the pool while it is prefilled. A pool smaller than that
    could never admit it, and the request would wait for good, so the server refuses to start."""
    chunk = getattr(model_runner.server_args, "chunked_prefill_size", None)
    pool = getattr(model_runner, "max_total_num_tokens", None)
    if not chunk or chunk <= 0 or not pool or max_context <= pool:
        return
    peak = prefill_offload.pool_need(cfg, chunk, max_context)
    if peak > pool:
        _refuse(f"--sparse-offload with prompts of up to {max_context} tokens on a GPU pool of "
                f"{pool}: a prompt longer than the pool holds --sparse-threshold {cfg.threshold}"
                f" + 2 x --chunked-prefill-size {chunk} + sink {cfg.sink} + local {cfg.local} ="
                f" {peak} pool tokens while it is prefilled (lower --sparse-threshold or "
                "--chunked-prefill-size, or give the pool more memory)")


REQUEST_ROWS = "sparse_request_rows"
"""The ForwardBatch attribute ``record_request_rows`` sets: each request's ``req_to_token`` row."""


def record_request_rows(result, cls, batch, model_runner=None, *args, **kwargs) -> None:
    """AFTER ``ForwardBatch.init_new(batch, model_runner)``: the batch's request rows as host
    ints, from its requests. The ForwardBatch has them only as a GPU tensor, whose ``tolist``
    in a decode step's bookkeeping waits for the previous step, costing SGLang's overlap
    scheduler its overlap at every sparse step (servers without a sparse backend: nothing)."""
    runner = model_runner if model_runner is not None else kwargs.get("model_runner")
    if not isinstance(getattr(runner, "attn_backend", None), _SparseDecodeMixin):
        return
    reqs = getattr(batch, "reqs", None)
    if reqs:
        setattr(result, REQUEST_ROWS, [pool_row(req) for req in reqs])


def _as_list(values) -> list[int] | None:
    """SGLang's per-request CPU lengths (a list or a CPU tensor) as a list."""
    if values is None:
        return None
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _tensor_like(like: torch.Tensor | None, values: list[int]) -> torch.Tensor | None:
    """``values`` as a tensor of ``like``'s dtype and device; entries past ``values`` (rows of a
    padded batch) kept from ``like``."""
    if like is None:
        return None
    if len(values) < like.numel():
        values = values + like.tolist()[len(values):]
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def attention_layers(model_runner) -> list:
    from sglang.srt.layers.radix_attention import RadixAttention

    return [m for m in model_runner.model.modules() if isinstance(m, RadixAttention)]


def build_state(model_runner, ops_cls, cfg: SparseDecodeConfig) -> SparseDecodeState:
    config = model_runner.model_config
    pool = model_runner.token_to_kv_pool
    req_to_token = model_runner.req_to_token_pool.req_to_token
    layers = attention_layers(model_runner)  # one shape (check_server_settings)
    hq, hkv, d = layers[0].tp_q_head_num, layers[0].tp_k_head_num, layers[0].qk_head_dim
    max_context = min(cfg.max_context or config.context_len, req_to_token.shape[1])
    capacity = max_context - cfg.sink - cfg.local
    if capacity <= cfg.update or max_context <= cfg.threshold:
        _refuse(f"a context length of {max_context} with --sparse-threshold {cfg.threshold} "
                "(nothing would ever decode sparsely; raise --context-length or lower the "
                "threshold)")
    layer_ids = sorted(m.layer_id for m in layers)
    device = model_runner.device
    if torch.device(device).type == "cuda":
        need = (len(layer_ids) * cfg.max_requests * capacity * KernelIndexOps.bytes_per_token(hkv, d)
                + cfg.max_requests * hkv * capacity * 2
                + (KernelIndexOps.kept_vote_bytes(len(layer_ids), cfg.max_requests, hkv,
                                                  min(cfg.candidates, capacity))
                   if cfg.vote_interval > 1 else 0))
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if need + GPU_MEMORY_MARGIN > free:
            _refuse(f"{cfg.max_requests} sparse requests of up to {max_context} tokens: their "
                    f"retrieval metadata needs {need / 2**30:.1f} GiB and {free / 2**30:.1f} GiB "
                    "are free after the KV pool (lower --mem-fraction-static, "
                    "--sparse-max-requests or --sparse-max-context)")
    ops = ops_cls(len(layer_ids), cfg.max_requests, hq, hkv, d, capacity, cfg.topk, cfg.candidates,
                  cfg.attended, device, rerank_between=cfg.vote_interval > 1)
    args = model_runner.server_args
    graph = getattr(getattr(args, "cuda_graph_config", None), "decode", None)
    max_batch = max(req_to_token.shape[0], getattr(args, "cuda_graph_max_bs_decode", 0) or 0,
                    getattr(graph, "max_bs", 0) or 0) + 1  # rows of a (padded) decode batch
    state = SparseDecodeState(cfg, ops, layer_ids=layer_ids, q_heads=hq, kv_heads=hkv,
                              head_dim=d, capacity=capacity, max_batch=max_batch,
                              req_to_token=req_to_token, device=device,
                              dtype=model_runner.dtype)
    state.key_buffer = pool.get_key_buffer
    state.value_buffer = pool.get_value_buffer
    state.metrics = metrics_for(model_runner)
    if cfg.offload:
        _offload(state, model_runner, len(layer_ids), hkv, d, capacity,
                 pool.get_key_buffer(layer_ids[0]).dtype)
    logger.info("sparse decode (ParisKV): threshold %d, top-k %d, sink %d, local %d, "
                "%d slots of %d tokens", cfg.threshold, cfg.topk, cfg.sink, cfg.local,
                cfg.max_requests, max_context)
    return state


def _offload(state: SparseDecodeState, model_runner, layers: int, kv_heads: int, head_dim: int,
             capacity: int, kv_dtype: torch.dtype) -> None:
    check_offload_settings(model_runner)
    cfg = state.cfg
    check_offloaded_prefill_fits(model_runner, cfg, capacity + cfg.sink + cfg.local)
    need = HostKVRegion.bytes_needed(layers, cfg.max_requests, kv_heads, capacity, head_dim,
                                     kv_dtype)
    available = host_memory_available()

    def refuse_host_memory(why: str) -> None:
        _refuse(f"--sparse-offload with {cfg.max_requests} sparse requests of up to "
                f"{capacity + cfg.sink + cfg.local} tokens: their host KV needs "
                f"{need / 2**30:.1f} GiB and {why} (lower --sparse-max-requests or "
                "--sparse-max-context)")

    if need > HOST_MEMORY_SHARE * available:
        refuse_host_memory(f"{available / 2**30:.1f} GiB of host memory are available")
    pin = torch.device(model_runner.device).type == "cuda"
    try:
        host = HostKVRegion(layers, cfg.max_requests, kv_heads, capacity, head_dim, kv_dtype, pin)
    except (RuntimeError, MemoryError) as e:  # e.g. pinning refused by the driver or a limit
        refuse_host_memory(f"allocating it failed ({str(e).splitlines()[0]})")
    release = PoolSlotRelease(model_runner.token_to_kv_pool_allocator,
                              model_runner.req_to_token_pool.req_to_token)
    state.enable_offload(host, release, kv_dtype)
    prefill_offload.bind(state)
    logger.info("sparse decode: retrieval regions offloaded to %s host memory (%.1f GiB for %d "
                "slots of %d tokens); their GPU pool slots are freed", "pinned" if pin else "",
                need / 2**30, cfg.max_requests, capacity)


class _SparseDecodeMixin:
    """What both backends add: bookkeeping in the metadata init, the sparse rows after the
    dense decode."""

    sparse: SparseDecodeState

    def _note_batch(self, fb) -> torch.Tensor | None:
        """Per step bookkeeping; for a decode batch, the lengths the dense kernel should see."""
        mode = fb.forward_mode
        # graph runners hand a padded view: only the first `raw` rows are requests
        raw = fb.batch_size - (getattr(fb, "num_padding", 0) or 0)
        if mode.is_decode():
            lens_cpu = getattr(fb, "seq_lens_cpu", None)
            if lens_cpu is not None and (raw == 0 or int(lens_cpu[:raw].max())
                                         <= self.sparse.cfg.threshold):
                # no request of this batch can be sparse: skip the GPU reads (they would wait
                # for the previous step and cost the overlap scheduler its overlap)
                return self.sparse.skip_decode()
            lens = lens_cpu if lens_cpu is not None else fb.seq_lens
            # a graph runner's view lacks the batch's host-side fields: load_batch left it here
            batch = fb if hasattr(fb, "rids") else (self.replay_batch or fb)
            rids = getattr(batch, "rids", None)
            return self.sparse.prepare_decode(self._request_rows(batch, fb, raw),
                                              lens[:raw].tolist(), fb.seq_lens,
                                              rids=rids[:raw] if rids is not None else None)
        if mode.is_extend():
            self.sparse.note_extend(self._request_rows(fb, fb, raw), getattr(fb, "rids", None),
                                    _as_list(getattr(fb, "extend_prefix_lens_cpu", None)),
                                    _as_list(getattr(fb, "extend_seq_lens_cpu", None)))
        return None

    @staticmethod
    def _request_rows(batch, fb, raw: int) -> list[int]:
        """The first ``raw`` rows' ``req_to_token`` rows: as ``record_request_rows`` left them
        on ``batch``, else read from ``fb``'s GPU tensor (which waits for the previous step)."""
        rows = getattr(batch, REQUEST_ROWS, None)
        if rows is None or len(rows) < raw or None in rows[:raw]:
            return fb.req_pool_indices[:raw].tolist()
        return list(rows[:raw])

    @contextlib.contextmanager
    def _extend_view(self, fb):
        """``fb`` as the dense extend kernel should see it while SGLang's metadata init reads it:
        no prefix for the rows whose prefix is partly in host memory (``attend_prefill``
        computes them)."""
        prefix = _as_list(getattr(fb, "extend_prefix_lens_cpu", None))
        view = None
        if prefix is not None and fb.forward_mode.is_extend():
            lens = fb.seq_lens_cpu if getattr(fb, "seq_lens_cpu", None) is not None \
                else fb.seq_lens
            view = self.sparse.extend_view(prefix, lens.tolist())
        if view is None:
            yield
            return
        names = ("extend_prefix_lens", "extend_prefix_lens_cpu", "seq_lens", "seq_lens_cpu",
                 "seq_lens_sum")
        saved = {n: getattr(fb, n, None) for n in names}
        new_prefix, new_lens = view
        fb.extend_prefix_lens = _tensor_like(saved["extend_prefix_lens"], new_prefix)
        fb.extend_prefix_lens_cpu = new_prefix if isinstance(saved["extend_prefix_lens_cpu"],
                                                             list) \
            else _tensor_like(saved["extend_prefix_lens_cpu"], new_prefix)
        fb.seq_lens = _tensor_like(saved["seq_lens"], new_lens)
        fb.seq_lens_cpu = _tensor_like(saved["seq_lens_cpu"], new_lens)
        if saved["seq_lens_sum"] is not None:
            fb.seq_lens_sum = sum(new_lens)
        try:
            yield
        finally:
            for n, value in saved.items():
                setattr(fb, n, value)

    @contextlib.contextmanager
    def _dense_view(self, fb, dense_lens: torch.Tensor | None):
        """``fb`` with the dense lengths while SGLang's metadata init reads it."""
        if dense_lens is None or not self.sparse.active:
            yield
            return
        saved = fb.seq_lens, getattr(fb, "seq_lens_cpu", None), getattr(fb, "seq_lens_sum", None)
        fb.seq_lens = dense_lens
        if saved[1] is not None:
            cpu = saved[1].clone()
            cpu[self.sparse.rows] = 1
            fb.seq_lens_cpu = cpu
            if saved[2] is not None:  # sizes the dense kernel's index buffers
                fb.seq_lens_sum = int(cpu.sum())
        try:
            yield
        finally:
            fb.seq_lens, fb.seq_lens_cpu, fb.seq_lens_sum = saved

    replay_batch = None  # the ForwardBatch a decode graph replays (graphs.around_load_batch)
    capturing = False  # set by graphs.py while SGLang captures decode graphs
    capture_sparse = False  # ... and while it captures the sets with the sparse part
    capture_only_sparse = False  # ... and the set without the dense attention
    only_sparse_sizes: frozenset[int] = frozenset()  # batch sizes captured in that set
    skips_dense = False  # the backend can write the new K/V without its dense decode

    def wants_sparse_graph(self) -> bool:
        """Whether the decode graph to capture or replay is one with the sparse part."""
        return self.capture_sparse if self.capturing else self.sparse.active

    def wants_only_sparse_graph(self, size: int) -> bool:
        """Whether the decode graph of batch size ``size`` to capture or replay is the one
        without the dense attention (every request row sparse)."""
        if self.capturing:
            return self.capture_only_sparse
        return size in self.only_sparse_sizes and self.sparse.all_rows

    def only_sparse_capture_sizes(self, capture_bs: list[int]) -> list[int]:
        """The batch sizes of ``capture_bs`` a batch whose rows are all sparse can be padded
        to: at most ``max_requests`` rows are sparse, so the sizes up to the first that holds
        them."""
        limit = min((b for b in capture_bs if b >= self.sparse.cfg.max_requests),
                    default=max(capture_bs, default=0))
        return sorted(b for b in capture_bs if b <= limit)

    def _save_decode_kv(self, layer, forward_batch, k, v) -> None:
        """The new tokens' K/V into the pool, as the backend's dense decode writes them."""
        raise NotImplementedError

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """SGLang's extend, then the rows of prompts with an offloaded prefix overwritten."""
        o = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if self.sparse.prefill_rows:
            hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
            self.sparse.attend_prefill(layer.layer_id, q.reshape(-1, hq, d),
                                       k.reshape(-1, hkv, d), v.reshape(-1, hkv, d),
                                       o.view(-1, hq, d), layer.scaling)
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """SGLang's decode (the backend this mixes into), then the sparse rows overwritten.
        When every request row is sparse, the dense decode has nothing to compute (its sparse
        rows see a length of 1, so only its launches cost): a backend that
        ``skips_dense`` only writes the new K/V, and the sparse part writes every row."""
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        sparse = self.capture_sparse if capturing else self.sparse.active
        only_sparse = self.skips_dense and (
            self.capture_only_sparse if capturing else self.sparse.all_rows)
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        if only_sparse and k is not None and layer.v_head_dim == d:
            if save_kv_cache:
                self._save_decode_kv(layer, forward_batch, k, v)
            # graph padding rows are left unwritten: their outputs are never read
            o = q.new_empty(q.numel() // (hq * d), hq * d)
        else:
            o = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if sparse:
            self.sparse.attend(layer.layer_id, q.reshape(-1, hq, d), o.view(-1, hq, d),
                               layer.scaling)
        return o


class _GpuSparseMixin(_SparseDecodeMixin):
    """The GPU backends: SGLang's backend (the class this mixes into) refused for settings the
    sparse path lacks, with the kernel selection, and its metadata calls on the dense view of the
    batch."""

    NAME: str

    def __init__(self, model_runner, *args, **kwargs):
        cfg = SparseDecodeConfig.from_env()
        check_server_settings(model_runner, self.NAME)
        super().__init__(model_runner, *args, **kwargs)
        self.sparse = build_state(model_runner, KernelIndexOps, cfg)

    def init_forward_metadata(self, forward_batch):
        dense = self._note_batch(forward_batch)
        with self._dense_view(forward_batch, dense), self._extend_view(forward_batch):
            super().init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        super().init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
        # SGLang's warm-up runs before capture are not sparse (no request is), so compile the
        # sparse kernels here: a first Triton launch inside a stream capture would fail
        self.sparse.warm_up()

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if in_capture:  # capture: no requests; the sparse part is recorded as is
            return super().init_forward_metadata_out_graph(forward_batch, in_capture=True)
        dense = self._note_batch(forward_batch)
        with self._dense_view(forward_batch, dense):
            return super().init_forward_metadata_out_graph(forward_batch)


class ParisKVTritonBackend(_GpuSparseMixin, TritonAttnBackend):
    NAME = "pariskv_triton"


class ParisKVFlashInferBackend(_GpuSparseMixin, FlashInferAttnBackend):
    NAME = "pariskv_flashinfer"
    skips_dense = True

    def _save_decode_kv(self, layer, forward_batch, k, v) -> None:
        """What ``FlashInferAttnBackend.forward_decode`` writes before attending."""
        self.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, self.forward_metadata.swa_out_cache_loc),
            k, v, *self._kv_write_scales(layer))

    def _prepare_cuda_graph_metadata(self, bs, num_tokens, forward_mode, spec_info):
        """The sparse capture of a batch size reuses the decode wrappers its dense capture made.

        SGLang's FlashInfer backend makes new wrappers at every decode capture and keeps the
        last ones per batch size, the ones a replay plans. Each wrapper has its own device
        workspace (plan tables, KV lengths), so with new wrappers for the second (sparse) set
        the dense graphs would replay on the first set's workspace, never planned again, kept
        alive by nothing: stale lengths, or freed memory. Shared, one plan per step serves the
        graph that replays, whichever set it is from."""
        wrappers = self.decode_cuda_graph_metadata.get(bs)
        if self.capture_sparse and forward_mode.is_decode_or_idle() and wrappers is not None:
            self.forward_metadata = DecodeMetadata(wrappers)
            return
        super()._prepare_cuda_graph_metadata(bs, num_tokens, forward_mode, spec_info)


class ParisKVTorchNativeBackend(_SparseDecodeMixin, TorchNativeAttnBackend):
    NAME = "pariskv_torch_native"
    skips_dense = True

    def _save_decode_kv(self, layer, forward_batch, k, v) -> None:
        """What ``TorchNativeAttnBackend.forward_decode`` writes before attending."""
        self.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)

    def __init__(self, model_runner):
        cfg = SparseDecodeConfig.from_env()
        check_server_settings(model_runner, self.NAME)
        if torch.device(model_runner.device).type == "cuda" and not getattr(
                model_runner.server_args, "disable_cuda_graph", False):
            _refuse(f"{self.NAME} with CUDA graphs (it is the CPU engine's; use pariskv_triton "
                    "on a GPU)")
        super().__init__(model_runner)
        self.sparse = build_state(model_runner, TorchIndexOps, cfg)
        self._dense_lens: torch.Tensor | None = None

    def init_forward_metadata(self, forward_batch):
        self._dense_lens = self._note_batch(forward_batch)
        super().init_forward_metadata(forward_batch)

    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token,
                                 req_pool_indices, seq_lens, extend_prefix_lens,
                                 extend_seq_lens, *args, **kwargs):
        """SGLang's extend with the rows of offloaded prefixes seen without a prefix (it reads
        the batch's lengths here, not in a metadata init)."""
        view = self.sparse.extend_view(extend_prefix_lens.tolist(), seq_lens.tolist())
        if view is not None:
            extend_prefix_lens = _tensor_like(extend_prefix_lens, view[0])
            seq_lens = _tensor_like(seq_lens, view[1])
        return super()._run_sdpa_forward_extend(query, output, k_cache, v_cache, req_to_token,
                                                req_pool_indices, seq_lens, extend_prefix_lens,
                                                extend_seq_lens, *args, **kwargs)

    def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token,
                                 req_pool_indices, seq_lens, *args, **kwargs):
        if self.sparse.active and self._dense_lens is not None:
            seq_lens = self._dense_lens
        return super()._run_sdpa_forward_decode(query, output, k_cache, v_cache, req_to_token,
                                                req_pool_indices, seq_lens, *args, **kwargs)


def create_pariskv_triton(model_runner):
    return ParisKVTritonBackend(model_runner)


def create_pariskv_flashinfer(model_runner):
    # as SGLang's own "flashinfer" factory builds it
    return ParisKVFlashInferBackend(
        model_runner, init_new_workspace=getattr(model_runner, "init_new_workspace", False))


def create_pariskv_torch_native(model_runner):
    return ParisKVTorchNativeBackend(model_runner)
