"""ParisKV memory layout of one attention layer for a batch of long sequences, and its decode step.

Where each token's KV lives (per sequence ``b``, KV head ``h``):

    GPU window   k_win/v_win [batch, kv_heads, W, D], W = sink + local + update
                 rows [0, sink): the first ``sink`` tokens (attention sinks), kept for good;
                 rows [sink, win_len): the most recent tokens, oldest first
    host region  k_host/v_host [batch, kv_heads, capacity, D] in pinned host memory: every other
                 token, rows [0, n_ret), read by the GPU only for the ``k`` selected rows
    GPU metadata centroid/codes/weights [batch, kv_heads, capacity, ...] of the host rows
                 (``sglang_pic_kernel.pariskv.encode``): 160 bytes per token and KV head for
                 D = 128, against 512 for its full-precision K and V

Decode appends each new token to the window. When the recent part reaches ``local + update``
tokens, its oldest ``update`` tokens move to the host region (copied, encoded) and the rest slide
down: the window never grows, so generation length is bounded by host memory only, and the
retrieval metadata never goes stale (keys are encoded once, with data-independent centroids).

``attend`` = select (votes, pruning, rerank, top-k) + sparse attention, all GPU kernels with
fixed shapes, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch

from .retrieval import SRHT, lloyd_max_levels


class ParisKVLayer:
    def __init__(self, batch: int, q_heads: int, kv_heads: int, head_dim: int, capacity: int,
                 *, k: int = 100, candidates: int = 4096, sink: int = 16, local: int = 512,
                 update: int = 128, similarity: bool = True, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
                 pin_memory: bool | None = None, sm_scale: float | None = None):
        from sglang_pic_kernel.pariskv import Selector, SparseAttention

        d = head_dim
        self.batch, self.q_heads, self.kv_heads, self.d = batch, q_heads, kv_heads, d
        self.sink, self.local, self.update, self.capacity = sink, local, update, capacity
        self.device = torch.device(device)
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
        self.rt = SRHT(d, seed)(torch.eye(d)).contiguous().to(self.device)
        self.levels = torch.tensor(lloyd_max_levels(d), dtype=torch.float32, device=self.device)
        self.edges = ((self.levels[1:] + self.levels[:-1]) / 2).contiguous()
        w = sink + local + update
        gpu = dict(dtype=dtype, device=self.device)
        self.k_win = torch.zeros(batch, kv_heads, w, d, **gpu)
        self.v_win = torch.zeros(batch, kv_heads, w, d, **gpu)
        pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.k_host = torch.zeros(batch, kv_heads, capacity, d, dtype=dtype, pin_memory=pin)
        self.v_host = torch.zeros(batch, kv_heads, capacity, d, dtype=dtype, pin_memory=pin)
        B = d // 4
        self.centroid = torch.zeros(batch, kv_heads, capacity, d // 32, dtype=torch.int32,
                                    device=self.device)  # sign bits, packed (encode_keys)
        self.codes = torch.zeros(batch, kv_heads, capacity, d // 2, dtype=torch.uint8,
                                 device=self.device)
        self.weights = torch.zeros(batch, kv_heads, capacity, B, dtype=torch.float16,
                                   device=self.device)
        self.bit_counts = torch.zeros(batch, kv_heads, d, dtype=torch.int32, device=self.device)
        # lengths: device copies feed the kernels, host copies decide when to move tokens
        self.win_len = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.n_ret = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.win_len_host = [0] * batch
        self.n_ret_host = [0] * batch
        self.selector = Selector(batch, q_heads, kv_heads, d, capacity, min(candidates, capacity),
                                 k, similarity=similarity, device=self.device)
        self.attention = SparseAttention(batch, q_heads, kv_heads, d, w, self.selector.k,
                                         device=self.device)

    # ---- filling ------------------------------------------------------------------------
    def _to_host(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k``/``v`` ``[n, kv_heads, D]`` (GPU) to sequence ``b``'s retrieval region."""
        from sglang_pic_kernel.pariskv import encode_keys

        n, start = k.shape[0], self.n_ret_host[b]
        if start + n > self.capacity:
            raise ValueError(f"sequence {b} outgrows the host KV capacity {self.capacity}")
        self.k_host[b, :, start:start + n].copy_(k.transpose(0, 1), non_blocking=True)
        self.v_host[b, :, start:start + n].copy_(v.transpose(0, 1), non_blocking=True)
        encode_keys(k, self.rt, self.edges, self.levels, self.centroid[b], self.codes[b],
                    self.weights[b], offset=start, bit_counts=self.bit_counts[b])
        self.n_ret_host[b] += n
        self.n_ret[b] = self.n_ret_host[b]

    def prefill(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Sequence ``b``'s prompt KV ``[n, kv_heads, D]`` (post-RoPE), replacing what it held."""
        n = k.shape[0]
        self.n_ret_host[b] = 0
        sink = min(self.sink, n)
        recent = min(self.local, n - sink)
        self.k_win[b, :, :sink] = k[:sink].transpose(0, 1)
        self.v_win[b, :, :sink] = v[:sink].transpose(0, 1)
        self._to_host(b, k[sink:n - recent], v[sink:n - recent])
        self.k_win[b, :, sink:sink + recent] = k[n - recent:].transpose(0, 1)
        self.v_win[b, :, sink:sink + recent] = v[n - recent:].transpose(0, 1)
        self.win_len_host[b] = sink + recent
        self.win_len[b] = sink + recent

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One decode token per sequence: ``k``/``v`` ``[batch, kv_heads, D]``."""
        rows = torch.arange(self.batch, device=self.device)
        self.k_win[rows, :, self.win_len.long()] = k
        self.v_win[rows, :, self.win_len.long()] = v
        self.win_len += 1
        for b in range(self.batch):
            self.win_len_host[b] += 1
            if self.win_len_host[b] == self.k_win.shape[2]:
                self._slide(b)

    def _slide(self, b: int) -> None:
        """Move the oldest ``update`` recent tokens of sequence ``b`` to the host region."""
        s, u = self.sink, self.update
        self._to_host(b, self.k_win[b, :, s:s + u].transpose(0, 1),
                      self.v_win[b, :, s:s + u].transpose(0, 1))
        self.k_win[b, :, s:s + self.local] = self.k_win[b, :, s + u:].clone()
        self.v_win[b, :, s:s + self.local] = self.v_win[b, :, s + u:].clone()
        self.win_len_host[b] -= u
        self.win_len[b] = self.win_len_host[b]

    # ---- decode -------------------------------------------------------------------------
    def select(self, q: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, k]`` selected rows of the retrieval regions for ``q``."""
        return self.selector(q, self.rt, self.levels, self.centroid, self.codes, self.weights,
                             self.n_ret, self.bit_counts)

    def attend(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of ``q`` ``[batch, q_heads, D]`` over window + selected tokens."""
        out = torch.empty_like(q) if out is None else out
        return self.attention(q, self.k_win, self.v_win, self.win_len, self.k_host, self.v_host,
                              self.select(q), out, self.sm_scale)
