"""The attention kernels segmented attention calls: FlashInfer's on a GPU, torch on the CPU.

Segmented attention (``segmented_backend``) attends each run of keys moved by one distance
(``key_runs``) as a request of its own, with the query turned back by the run's shift, and merges
the partial outputs by their log-sum-exp. It needs a turn, three batched calls and a merge:

* ``turn``: each run's query row, turned back by the run's shift;
* ``decode``: one query row per run, over the run's keys (non-causal);
* ``paged``: each run's copy of its request's new tokens, over the run's keys (non-causal: a
  run lies before every new token); in a decode step, the query rows of the runs that read the
  same slots, over those keys once (``plan_paged``);
* ``ragged``: each request's new tokens over themselves (causal);
* ``merge``: ``out[i] = sum_j w_ij o[index[i, j]]``, ``w`` from the log-sum-exps.

``FlashInferRunKernels`` plans FlashInfer's batch wrappers (the kernels vanilla SGLang runs,
sharing its workspace) and turns and merges with one Triton kernel each
(``sglang_pic_kernel.rotating_attention.segmented_ops``); ``for_graph`` gives a copy whose paged
wrapper runs in CUDA-graph mode (``segmented_graphs``). ``TorchRunKernels`` is the same contract
in plain torch: the CPU engine's path, and the reference the GPU test checks FlashInfer's
against. A kernel set's log-sum-exps are only ever merged with its own (FlashInfer's are base 2;
the torch ones are made base 2 too).

Shapes: ``q`` [rows, Hq, D]; keys and values of the pool ``[slots, Hkv, D]``; a log-sum-exp
float32 [rows, Hq]; ``merge``'s ``index`` [M, S], entries ``>= rows`` padding.
"""

from __future__ import annotations

import math

import numpy as np
import torch

LOG2E = 1.0 / math.log(2.0)
EMPTY_LSE = -1e30
"""The log-sum-exp of the padding state ``merge`` weighs with zero."""


def turn_table(shift: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin that turn a query back by ``shift`` positions (NeoX RoPE), float32
    ``[len(shift), 1, D / 2]`` each: computed once per batch, used by every layer (``turn``).
    ``cos_sin`` is SGLang's float32 cos/sin cache ``[positions, D]``."""
    cos, sin = cos_sin.index_select(0, shift.abs()).chunk(2, dim=-1)
    sin = sin * (-shift.sign()).to(sin.dtype)[:, None]  # back: the opposite angle
    return cos[:, None, :].contiguous(), sin[:, None, :].contiguous()


TURN_ROWS = 8192
"""Rows turned per step (``turn``): bounds the float32 temporaries of a long extend's queries."""


def turn(q: torch.Tensor, rows: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]
         ) -> torch.Tensor:
    """``q[rows]`` turned by ``table`` (``turn_table``): ``[len(rows), H, D]``; math in float32,
    ``TURN_ROWS`` rows at a time, the result in ``q.dtype`` (a shift of 0 returns the rows
    exactly)."""
    cos, sin = table
    out = q.new_empty((rows.numel(), *q.shape[1:]))
    half = q.shape[-1] // 2
    for a in range(0, rows.numel(), TURN_ROWS):
        b = min(a + TURN_ROWS, rows.numel())
        x1, x2 = q.index_select(0, rows[a:b]).float().chunk(2, dim=-1)
        out[a:b, :, :half] = x1 * cos[a:b] - x2 * sin[a:b]
        out[a:b, :, half:] = x2 * cos[a:b] + x1 * sin[a:b]
    return out


def with_padding_state(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``o`` [N, H, D] and ``lse`` [N, H] with the padding state appended at row N: a zero
    output whose log-sum-exp (``EMPTY_LSE``, float32) gives it no weight in a merge."""
    return (torch.cat((o, o.new_zeros((1, *o.shape[1:])))),
            torch.cat((lse.float(), lse.new_full((1, lse.shape[1]), EMPTY_LSE,
                                                 dtype=torch.float32))))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``q`` [n, Hq, D] over ``k``/``v`` [m, Hkv, D]; causal aligns the last query
    with the last key. Returns the output [n, Hq, D] and the base-2 log-sum-exp [n, Hq]."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale
    if causal:
        n, m = q.shape[0], k.shape[0]
        allowed = torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n)
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), vf)
    return out.to(q.dtype), (lse * LOG2E).transpose(0, 1).contiguous()


class TorchRunKernels:
    """Segmented attention's kernels in plain torch (the CPU engine; the GPU test's reference)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._decode = self._paged = self._ragged = None

    @staticmethod
    def graph_workspace(rows: int) -> None:
        """No workspace: the CPU runs no graph."""
        return None

    def for_graph(self, *buffers: torch.Tensor | None) -> TorchRunKernels:
        """A kernel set of its own for a captured step (no graph on the CPU: the buffers are
        FlashInfer's business; the padded plan is the same)."""
        return TorchRunKernels(self.scale)

    @staticmethod
    def turn(q: torch.Tensor, rows: torch.Tensor, shift: torch.Tensor, cos_sin: torch.Tensor,
             count: torch.Tensor | None = None) -> torch.Tensor:
        """``q[rows]`` turned back by ``shift`` (every row: ``count`` only bounds what a
        caller reads)."""
        return turn(q, rows, turn_table(shift, cos_sin))

    def plan_decode(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> None:
        self._decode = (kv_indptr.tolist(), kv_indices.long())

    def plan_extend(self, qo_indptr: torch.Tensor, run_qo_indptr: torch.Tensor | None,
                    run_kv_indptr: torch.Tensor | None, kv_indices: torch.Tensor | None) -> None:
        self._ragged = qo_indptr.tolist()
        self._paged = None
        if run_qo_indptr is not None:
            self.plan_paged(run_qo_indptr, run_kv_indptr, kv_indices)

    def plan_paged(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                   kv_indices: torch.Tensor) -> None:
        self._paged = (qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.long())

    def _over_pool(self, q, kv, qo, kvp, idx):
        k_buf, v_buf = kv
        outs, lses = [], []
        for i in range(len(kvp) - 1):
            slots = idx[kvp[i] : kvp[i + 1]]
            o, s = _attend(q[qo[i] : qo[i + 1]], k_buf[slots], v_buf[slots], self.scale, False)
            outs.append(o)
            lses.append(s)
        return torch.cat(outs), torch.cat(lses)

    def decode(self, q: torch.Tensor, kv) -> tuple[torch.Tensor, torch.Tensor]:
        kvp, idx = self._decode
        return self._over_pool(q, kv, list(range(len(kvp))), kvp, idx)

    def paged(self, q: torch.Tensor, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows past the last group (a padded step's) are the padding state, as no group
        covers them."""
        qo, kvp, idx = self._paged
        o, lse = self._over_pool(q, kv, qo, kvp, idx)
        rest = q.shape[0] - o.shape[0]
        if rest:
            o = torch.cat((o, o.new_zeros((rest, *o.shape[1:]))))
            lse = torch.cat((lse, lse.new_full((rest, lse.shape[1]), EMPTY_LSE)))
        return o, lse

    def ragged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        qo = self._ragged
        parts = [_attend(q[a:b], k[a:b], v[a:b], self.scale, True)
                 for a, b in zip(qo[:-1], qo[1:], strict=True)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    @staticmethod
    def merge(o: torch.Tensor, lse: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``o`` [N, H, D] and ``lse`` [N, H] (base 2), merged along ``index`` [M, S] (entries
        < N, or >= N: padding) into [M, H, D]."""
        index = index.clamp(max=o.shape[0])
        o, lse = with_padding_state(o, lse)
        s = lse[index]  # [M, S, H]
        w = torch.exp2(s - s.amax(dim=1, keepdim=True))
        out = (o[index].float() * w[..., None]).sum(1) / w.sum(1)[..., None]
        return out.to(o.dtype)


class FlashInferRunKernels:
    """Segmented attention's kernels on FlashInfer's batch wrappers (planned per batch; the
    float workspace is the one vanilla's wrappers use, which run before or after, never
    between a plan and its run)."""

    def __init__(self, workspace: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, scale: float,
                 use_tensor_cores: bool) -> None:
        """As vanilla's ``FlashInferAttnBackend`` builds and plans its wrappers: queries (and the
        ragged call's new keys) in the model's dtype, the pool in the KV cache's; the paged
        prefill on FlashInfer's ``fa2`` kernels, the ragged one on ``auto``."""
        from flashinfer import (
            BatchDecodeWithPagedKVCacheWrapper,
            BatchPrefillWithPagedKVCacheWrapper,
            BatchPrefillWithRaggedKVCacheWrapper,
        )
        from sglang_pic_kernel.rotating_attention.segmented_ops import merge_runs, turn_rows

        self._decode = BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=use_tensor_cores)
        self._paged = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        self._ragged = BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="auto")
        self.workspace = workspace
        self._turn_rows, self._merge_runs = turn_rows, merge_runs  # imported once, not per call
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype
        self.scale = scale

    def graph_workspace(self, rows: int) -> torch.Tensor:
        """The float workspace of the captured steps' paged wrappers, for up to ``rows`` query
        rows in as many groups. In CUDA-graph mode FlashInfer's prefill plan always splits the
        keys and sizes its partial states for the largest grid a replay may need (scheduler.cuh,
        ``PrefillSplitQOKVIndptr``): ``num_qo_heads x tiles x cta_tile_q x (head_dim + 1)``
        floats, ``tiles = ceil(rows x gqa / cta_tile_q) + rows - 1`` with one row per group at
        most, so ``cta_tile_q`` is FA2's for ``gqa`` packed rows. Vanilla's workspace (384 MB)
        is too small for large batches (~840 MB at 2,560 rows of Llama-3-8B), hence a buffer of
        its own."""
        h, hkv, d = self.heads
        gqa = h // hkv
        cta = 128 if gqa > 64 and d < 256 else 64 if gqa > 16 else 16
        tiles = -(-rows * gqa // cta) + rows - 1
        device = self.workspace.device
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        padded = max(2 * sms // hkv, tiles)
        size = int(h * padded * cta * (d + 1) * 4 * 1.1) + (16 << 20)
        return torch.empty(size, dtype=torch.uint8, device=device)

    def for_graph(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                  workspace: torch.Tensor) -> FlashInferRunKernels:
        """A copy whose paged wrapper runs in CUDA-graph mode over these buffers (its batch
        size fixed to ``len(qo_indptr) - 1``) and ``workspace`` (``graph_workspace``), as
        SGLang's backend builds its own graph wrappers; the decode and ragged wrappers are
        shared (a captured step never calls them)."""
        from flashinfer import BatchPrefillWithPagedKVCacheWrapper

        twin = object.__new__(FlashInferRunKernels)
        twin.__dict__.update(self.__dict__)
        twin._paged = BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, backend="fa2", qo_indptr_buf=qo_indptr,
            paged_kv_indptr_buf=kv_indptr, paged_kv_indices_buf=kv_indices,
            paged_kv_last_page_len_buf=kv_last_page_len)
        return twin

    def turn(self, q: torch.Tensor, rows: torch.Tensor, shift: torch.Tensor,
             cos_sin: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
        return self._turn_rows(q, rows, shift, cos_sin, count)

    def plan_decode(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor) -> None:
        n = kv_indptr.numel() - 1
        self._decode.plan(kv_indptr, kv_indices, torch.ones(n, dtype=torch.int32), *self.heads,
                          1, q_data_type=self.q_dtype, kv_data_type=self.kv_dtype,
                          sm_scale=self.scale, non_blocking=True)

    def plan_extend(self, qo_indptr: torch.Tensor, run_qo_indptr: torch.Tensor | None,
                    run_kv_indptr: torch.Tensor | None, kv_indices: torch.Tensor | None) -> None:
        self._ragged.plan(qo_indptr, qo_indptr, *self.heads, causal=True, sm_scale=self.scale,
                          q_data_type=self.q_dtype, kv_data_type=self.q_dtype)
        if run_qo_indptr is not None:
            self.plan_paged(run_qo_indptr, run_kv_indptr, kv_indices)

    def plan_paged(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                   kv_indices: torch.Tensor) -> None:
        """The paged prefill, not causal: ``qo_indptr`` rows of queries over each span of
        ``kv_indices`` (page size 1)."""
        n = kv_indptr.numel() - 1
        # the longest query span, given: FlashInfer otherwise takes it with Python's max() over
        # a tensor, element by element (giving it took a graph step's plan at 1,536 groups from
        # 8.7 to 4.9 ms on an H100's host). Its key-span twin (max_sequence_kv) skips a step
        # 0.6.15's plan needs later.
        self._paged.plan(qo_indptr, kv_indptr, kv_indices, torch.ones(n, dtype=torch.int32),
                         *self.heads, 1, causal=False, sm_scale=self.scale,
                         q_data_type=self.q_dtype, kv_data_type=self.kv_dtype,
                         non_blocking=True,
                         max_token_per_sequence=int(np.diff(qo_indptr.numpy()).max()))

    def decode(self, q: torch.Tensor, kv) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode.run(q, kv, return_lse=True)

    def paged(self, q: torch.Tensor, kv) -> tuple[torch.Tensor, torch.Tensor]:
        return self._paged.run(q, kv, return_lse=True)

    def ragged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ragged.run(q, k, v, return_lse=True)

    def merge(self, o: torch.Tensor, lse: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """One Triton kernel reading each state once where its row's index names it (no
        gathered ``rows x runs`` copy of the output, which a long extend after many runs would
        make: 8K tokens x 12 runs x 32 heads x 128 is 0.8 GB per layer in bf16)."""
        return self._merge_runs(o.contiguous(), lse.float().contiguous(), index.contiguous())
