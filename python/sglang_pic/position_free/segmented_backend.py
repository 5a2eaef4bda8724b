"""Segmented attention: batches that read moved keys, on vanilla's kernels and shared pages.

A span reused at another offset is read from the one shared copy of its pages, without copying
and without a shift-aware kernel: each run of keys moved by one distance (``key_runs``) is
attended as a request of its own with the query turned back by the run's shift, and the runs'
partial outputs are merged by log-sum-exp (``run_kernels``). On a GPU the three calls are
FlashInfer's batch kernels, the ones vanilla SGLang runs; on the CPU they are torch.

Compared with the alternatives (docs/position-free-kv.md):
* copy on reuse gives each request its own turned copy of what it moved, so the pool holds a
  request's whole prompt again when documents land at offsets no other request shares;
* the shift-aware Triton kernels turn every moved key on each read, at Triton's speed.
Segmented attention keeps the KV of a shared document once, whatever its offset, and reads it
at FlashInfer's speed; the price is a wider batch (one row per run instead of per request),
the query turns and the merge.

Decode steps run eagerly, or with ``--position-free-span-graphs`` replay CUDA graphs captured in
a padded layout (``segmented_graphs``: a second graph set beside vanilla's, ``span_graphs``);
extends always run eagerly.

A decode step whose runs read the same slots (``KeyRuns.shared_groups``: requests holding the
same document or system prompt) attends each such group as one request of the paged prefill
kernel, a query row per run, so the shared keys are read once per step rather than once per
request: a burst over a few popular documents is bound by the distinct keys it reads, where
vanilla (and one run per call) read every request's whole sequence.

The batch's runs come from the ``ForwardBatch.init_new`` hook (``shifted_batches.current_runs``),
which has the scheduler's requests; this backend only sees the forward batch.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_pic.launcher.server_flags import setting

from . import model_check, shifted_batches, stored_positions
from .key_runs import KeyRuns
from .segmented_graphs import GraphStep, SegmentedDecodeGraphs


class SegmentedAttention(AttentionBackend):
    """Attention for batches with moved keys (``shifted_batches.is_shifted``), over the shared
    pages. ``kernels``: ``run_kernels.FlashInferRunKernels`` or ``TorchRunKernels``."""

    def __init__(self, model_runner: Any, kernels: Any) -> None:
        super().__init__()
        model_check.check_server_settings(model_runner)
        if stored_positions.table() is None:
            # without it no batch is marked shifted (shifted_batches.mark_forward_batch): every
            # span batch would run the dense backend over moved keys, unturned
            raise RuntimeError("segmented attention: the stored-positions table is not "
                               "allocated (the position-free backend allocates it first)")
        self.max_context_len = int(model_runner.model_config.context_len)
        self._attach(kernels, model_runner.req_to_token_pool.req_to_token,
                     model_runner.token_to_kv_pool,
                     model_check.model_rotary(model_runner).cos_sin_cache.float().to(
                         model_runner.device), model_runner.device)

    @classmethod
    def over_pool(cls, kernels: Any, req_to_token: torch.Tensor, pool: Any,
                  cos_sin: torch.Tensor, device: torch.device | str) -> SegmentedAttention:
        """The backend without a model runner or its checks: ``pool`` (``get_kv_buffer``,
        ``set_kv_buffer``), its rows' ``req_to_token`` and the float32 cos/sin cache (the
        kernel tests and ``bench_segmented_decode``)."""
        self = cls.__new__(cls)
        AttentionBackend.__init__(self)
        self.max_context_len = int(req_to_token.shape[1])
        self._attach(kernels, req_to_token, pool, cos_sin, torch.device(device))
        return self

    def _attach(self, kernels: Any, req_to_token: torch.Tensor, pool: Any,
                cos_sin: torch.Tensor, device: torch.device) -> None:
        self.kernels = kernels
        self.req_to_token = req_to_token
        self.pool = pool
        self.cos_sin = cos_sin
        self.device = device
        self.run_rows = self.run_shifts = self.merge_index = None
        self.count = None  # a captured step's rows to turn (device int32 [1]); None: all
        self.active = kernels  # the kernel set of the batch planned last (a graph's, or these)
        self.grouped = False  # this decode batch's runs were grouped (``_plan_decode``)
        # --span-group-shared-runs: off attends every request's runs on their own
        self.group_shared_runs = setting("--span-group-shared-runs") == "auto"
        self.runs_per_request = int(setting("--span-graph-runs"))
        self.graphs: SegmentedDecodeGraphs | None = None  # init_cuda_graph_state

    def init_forward_metadata(self, forward_batch: Any) -> None:
        per_request = shifted_batches.current_runs()
        if per_request is None or len(per_request) != len(forward_batch.req_pool_indices):
            raise RuntimeError("segmented attention: no key runs for this batch (the "
                               "ForwardBatch.init_new hook did not run for it)")
        runs = KeyRuns.build(per_request, self.device)
        pool_indices = forward_batch.req_pool_indices
        self.active, self.count = self.kernels, None
        if forward_batch.forward_mode.is_decode_or_idle():
            self._plan_decode(runs, pool_indices)
        else:
            self._plan_extend(runs, runs.kv_indices(self.req_to_token, pool_indices),
                              [int(n) for n in forward_batch.extend_seq_lens_cpu])

    def _plan_decode(self, runs: KeyRuns, pool_indices: torch.Tensor) -> None:
        """One query row per run (its request's), merged back per request; runs reading the
        same slots share one request of the paged kernel (``shared_groups``)."""
        to = dict(device=self.device, non_blocking=True)
        groups = runs.shared_groups() if self.group_shared_runs else None
        layout = runs.grouped(groups, runs.num_runs)
        if groups is None:
            self.kernels.plan_decode(runs.kv_indptr,
                                     runs.kv_indices(self.req_to_token, pool_indices))
        else:
            kv_indptr, kv_indices = runs.run_kv_indices(self.req_to_token, pool_indices,
                                                        layout.firsts)
            self.kernels.plan_paged(torch.from_numpy(layout.qo_indptr), kv_indptr, kv_indices)
            shifted_batches.count("shared_run_batches")
        self.grouped = groups is not None
        self.merge_index = torch.from_numpy(layout.merge_index).to(**to)
        self.run_rows = torch.from_numpy(layout.owners).to(**to)
        self.run_shifts = torch.from_numpy(layout.shifts).to(**to)

    def _plan_extend(self, runs: KeyRuns, kv_indices: torch.Tensor, new: list[int]) -> None:
        """The new tokens over themselves (ragged, causal), and each run of the prefix with a
        copy of its request's new tokens (paged); the merge's states per token are its ragged
        row (column 0), then its runs' rows, padded."""
        qo_indptr = torch.zeros(len(new) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor(new, dtype=torch.int32), 0)
        total = int(qo_indptr[-1])
        if runs.num_runs == 0:
            self.kernels.plan_extend(qo_indptr, None, None, None)
            self.merge_index = torch.arange(total, device=self.device)[:, None]
            self.run_rows = None
            return
        run_qo = torch.zeros(runs.num_runs + 1, dtype=torch.int32)
        run_qo[1:] = torch.cumsum(torch.tensor([new[i] for i in runs.owners],
                                               dtype=torch.int32), 0)
        self.kernels.plan_extend(qo_indptr, run_qo, runs.kv_indptr, kv_indices)
        width = 1 + runs.runs_of.shape[1]
        index = torch.full((total, width), total + int(run_qo[-1]), dtype=torch.int64)
        index[:, 0] = torch.arange(total)
        column = [1] * len(new)
        rows, shifts = [], []
        for r, (i, shift) in enumerate(zip(runs.owners, runs.shifts, strict=True)):
            a, n = int(qo_indptr[i]), new[i]
            rows.append(torch.arange(a, a + n))
            shifts.append(torch.full((n,), shift, dtype=torch.int64))
            index[a : a + n, column[i]] = total + torch.arange(int(run_qo[r]), int(run_qo[r + 1]))
            column[i] += 1
        to = dict(device=self.device, non_blocking=True)
        self.run_rows = torch.cat(rows).to(**to)
        self.run_shifts = torch.cat(shifts).to(**to)
        self.merge_index = index.to(**to)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """The buffers of the captured decode steps (``segmented_graphs``); the key list holds
        at most every request's whole context, as SGLang's FlashInfer backend sizes its own."""
        self.graphs = SegmentedDecodeGraphs(self.kernels, self.runs_per_request, max_bs,
                                            max_bs * self.max_context_len, self.device)

    def graph_fits(self) -> bool:
        """Whether the decode batch ``init_new`` built last can replay a captured step."""
        return self.graphs is not None and self.graphs.fits(shifted_batches.current_runs())

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False):
        if self.graphs is None:
            raise RuntimeError("segmented attention: a CUDA graph of a batch with moved keys "
                               "without --position-free-span-graphs "
                               "(span_graphs.around_can_run_graph)")
        bs = forward_batch.batch_size
        if in_capture:
            step = self.graphs.capture(bs)
        else:
            step = self.graphs.replay(bs, shifted_batches.current_runs(), self.req_to_token,
                                      forward_batch.req_pool_indices, self.group_shared_runs)
            shifted_batches.count("graph_steps")
        self._use(step)

    def _use(self, step: GraphStep) -> None:
        self.active, self.count, self.grouped = step.kernels, step.count, True
        self.run_rows, self.run_shifts = step.rows, step.shifts
        self.merge_index = step.merge_index

    def init_forward_metadata_in_graph(self, forward_batch: Any):
        if self.graphs is None:
            raise RuntimeError("segmented attention: a CUDA graph of a batch with moved keys "
                               "without --position-free-span-graphs")

    def _save(self, layer: Any, forward_batch: Any, k: torch.Tensor | None,
              v: torch.Tensor | None, save_kv_cache: bool) -> None:
        if save_kv_cache and k is not None:
            self.pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)

    def _check_scale(self, layer: Any) -> None:
        if abs(layer.scaling - self.kernels.scale) > 1e-6 or layer.logit_cap:
            raise RuntimeError("segmented attention: a layer with its own softmax scale or "
                               "logit cap")

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        self._check_scale(layer)
        self._save(layer, forward_batch, k, v, save_kv_cache)
        q = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
        kv = self.pool.get_kv_buffer(layer.layer_id)
        kernels = self.active
        attend = kernels.paged if self.grouped else kernels.decode
        o, lse = attend(kernels.turn(q, self.run_rows, self.run_shifts, self.cos_sin,
                                     self.count), kv)
        out = kernels.merge(o, lse, self.merge_index)
        return out.view(-1, layer.tp_q_head_num * layer.head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       **kwargs):
        self._check_scale(layer)
        self._save(layer, forward_batch, k, v, save_kv_cache)
        q = q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim)
        k = k.view(-1, layer.tp_k_head_num, layer.head_dim)
        v = v.view(-1, layer.tp_v_head_num, layer.head_dim)
        o, lse = self.kernels.ragged(q, k, v)
        if self.run_rows is not None:
            kv = self.pool.get_kv_buffer(layer.layer_id)
            o2, lse2 = self.kernels.paged(self.kernels.turn(q, self.run_rows, self.run_shifts,
                                                            self.cos_sin), kv)
            o, lse = torch.cat((o, o2)), torch.cat((lse, lse2))
        out = self.kernels.merge(o, lse, self.merge_index)
        return out.view(-1, layer.tp_q_head_num * layer.head_dim)
