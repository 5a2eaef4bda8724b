"""The three operations sparse decoding needs, on the GPU (Triton kernels) or on CPU (torch).

Both implementations share one interface so that ``decode_state.SparseDecodeState`` (what moves
where, per request and step) is the same code on every device:

    encode(layer, slot, keys [n, kv_heads, D], offset)     keys enter a slot's retrieval region
    select(layer, q [R, q_heads, D], n_ret [R]) -> [R, kv_heads, k] int32 rows (-1: none)
    attend(q [R, q_heads, D], k_buf, v_buf [S, kv_heads, D], idx [R, kv_heads, K] int32 pool
           slots (-1: none), out [R, q_heads, D], scale)   softmax attention over those slots
    attend_split(q, k_win, v_win [R, kv_heads, W, D], win_len [R], k_host, v_host
           [R, kv_heads, N, D], rows [R, kv_heads, k] (-1: none), out, scale)
                                    the same over each slot's first win_len window rows and its
                                    selected host rows (``--sparse-offload``)

``R`` is the number of sparse slots (``max_requests``), ``k`` the retrieved keys per KV head.
Selection is per KV head: a group's query heads vote together and rerank by the best estimate
among them (what the kernels do; ``KernelIndexOps``). ``TorchIndexOps`` computes the same steps
exactly in float (no vote quantisation, no histogram bins) from ``retrieval.KeyIndex`` - the CPU
engine's path and the reference the GPU path is tested against.
"""

from __future__ import annotations

import math

import torch

from .retrieval import SRHT, KeyIndex, ParisConfig, lloyd_max_levels


class KernelIndexOps:
    """Retrieval metadata of ``slots`` requests x ``layers`` layers in GPU memory (allocated
    once, so every launch has fixed shapes and a decode step can be captured in a CUDA graph)."""

    def __init__(self, layers: int, slots: int, q_heads: int, kv_heads: int, head_dim: int,
                 capacity: int, topk: int, candidates: int, attended: int, device):
        from sglang_pic_kernel.pariskv import Selector, SparseAttention

        d = head_dim
        self.device = torch.device(device)
        self.rt = SRHT(d, 0)(torch.eye(d)).contiguous().to(self.device)
        self.levels = torch.tensor(lloyd_max_levels(d), dtype=torch.float32, device=self.device)
        self.edges = ((self.levels[1:] + self.levels[:-1]) / 2).contiguous()
        shape = (layers, slots, kv_heads, capacity)
        self.centroid = torch.zeros(*shape, d // 32, dtype=torch.int32, device=self.device)
        self.codes = torch.zeros(*shape, d // 2, dtype=torch.uint8, device=self.device)
        self.weights = torch.zeros(*shape, d // 4, dtype=torch.float16, device=self.device)
        self.bit_counts = torch.zeros(layers, slots, kv_heads, d, dtype=torch.int32,
                                      device=self.device)
        self.selector = Selector(slots, q_heads, kv_heads, d, capacity,
                                 min(candidates, capacity), topk, device=self.device)
        self.attention = SparseAttention(slots, q_heads, kv_heads, d, 0, attended,
                                         device=self.device)
        self.no_window = torch.zeros(slots, dtype=torch.int32, device=self.device)
        self.split_attention = SparseAttention(slots, q_heads, kv_heads, d, attended - topk,
                                               topk, device=self.device)

    @staticmethod
    def bytes_per_token(kv_heads: int, head_dim: int) -> int:
        """GPU metadata per retrieval-region token and layer (packed ids, codes, weights)."""
        return kv_heads * (head_dim // 8 + head_dim // 2 + head_dim // 2)

    def encode(self, layer: int, slot: int, keys: torch.Tensor, offset: int) -> None:
        from sglang_pic_kernel.pariskv import encode_keys

        encode_keys(keys.contiguous(), self.rt, self.edges, self.levels,
                    self.centroid[layer, slot], self.codes[layer, slot],
                    self.weights[layer, slot], offset=offset,
                    bit_counts=self.bit_counts[layer, slot])

    def select(self, layer: int, q: torch.Tensor, n_ret: torch.Tensor) -> torch.Tensor:
        return self.selector(q, self.rt, self.levels, self.centroid[layer], self.codes[layer],
                             self.weights[layer], n_ret, self.bit_counts[layer])

    def attend(self, q, k_buf, v_buf, idx, out, scale: float) -> torch.Tensor:
        # the pool seen as one "host region" shared by every slot: stride 0 over slots
        slots, kv_heads = idx.shape[:2]
        kv = [b.permute(1, 0, 2).unsqueeze(0).expand(slots, -1, -1, -1) for b in (k_buf, v_buf)]
        return self.attention(q, kv[0], kv[1], self.no_window, kv[0], kv[1], idx, out, scale)

    def attend_split(self, q, k_win, v_win, win_len, k_host, v_host, rows, out, scale: float):
        return self.split_attention(q, k_win, v_win, win_len, k_host, v_host, rows, out, scale)


class TorchIndexOps:
    """The same operations in torch (CPU engine), from ``retrieval.KeyIndex`` per layer and slot."""

    def __init__(self, layers: int, slots: int, q_heads: int, kv_heads: int, head_dim: int,
                 capacity: int, topk: int, candidates: int, attended: int, device):
        self.cfg = ParisConfig(vote="similarity")
        self.k, self.c, self.G = topk, candidates, q_heads // kv_heads
        self.index: list[list[KeyIndex | None]] = [[None] * slots for _ in range(layers)]

    def encode(self, layer: int, slot: int, keys: torch.Tensor, offset: int) -> None:
        keys = keys.float().transpose(0, 1)  # [kv_heads, n, D]
        index = self.index[layer][slot]
        if offset == 0 or index is None:
            self.index[layer][slot] = KeyIndex(keys, self.cfg)
            return
        if index.n != offset:
            raise RuntimeError(f"retrieval region holds {index.n} keys, appending at {offset}")
        index.append(keys)

    def select(self, layer: int, q: torch.Tensor, n_ret: torch.Tensor) -> torch.Tensor:
        slots, hq, d = q.shape
        kv_heads = hq // self.G
        out = torch.full((slots, kv_heads, self.k), -1, dtype=torch.int32, device=q.device)
        for s, n in enumerate(n_ret.tolist()):
            index = self.index[layer][s]
            if n == 0 or index is None:
                continue
            qg = q[s].float().view(kv_heads, self.G, d)
            qn = qg / qg.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            votes = index.coarse_votes(qn.sum(1))[:, :n]  # similarity votes are linear in q
            cand = votes.topk(min(self.c, n), dim=-1).indices
            est = torch.stack([index.estimate(qg[:, g], cand) for g in range(self.G)]).amax(0)
            k = min(self.k, cand.shape[1])
            out[s, :, :k] = cand.gather(1, est.topk(k, dim=-1).indices).int()
        return out

    def attend(self, q, k_buf, v_buf, idx, out, scale: float) -> torch.Tensor:
        out.copy_(indexed_attention(q, k_buf, v_buf, idx, scale))
        return out

    def attend_split(self, q, k_win, v_win, win_len, k_host, v_host, rows, out, scale: float):
        out.copy_(split_attention(q, k_win, v_win, win_len, k_host, v_host, rows, scale))
        return out


def indexed_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                      idx: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q`` ``[R, q_heads, D]`` over the pool slots ``idx``
    ``[R, kv_heads, K]`` (-1: none) of ``k_buf/v_buf`` ``[S, kv_heads, D]``; fp32 result."""
    kv_heads = idx.shape[1]
    valid = idx >= 0
    heads = torch.arange(kv_heads, device=idx.device)[None, :, None]
    rows = idx.clamp_min(0).long()
    return _masked_attention(q, k_buf[rows, heads], v_buf[rows, heads], valid, scale)


def split_attention(q: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
                    win_len: torch.Tensor, k_host: torch.Tensor, v_host: torch.Tensor,
                    rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q`` ``[R, q_heads, D]`` over each slot's first ``win_len[r]`` rows
    of ``k_win/v_win`` ``[R, kv_heads, W, D]`` and its ``rows`` ``[R, kv_heads, k]`` (-1: none)
    of ``k_host/v_host`` ``[R, kv_heads, N, D]``; fp32 result (what ``SparseAttention`` does)."""
    d = q.shape[-1]
    kv_heads, w = k_win.shape[1], k_win.shape[2]
    at = torch.arange(w, device=win_len.device)
    valid = torch.cat([(at[None, :] < win_len[:, None].long())[:, None, :].expand(-1, kv_heads, -1),
                       rows >= 0], dim=2)  # [R, kvh, W + k]
    take = rows.clamp_min(0).long()[..., None].expand(-1, -1, -1, d)
    keys = torch.cat([k_win, k_host.gather(2, take)], dim=2)
    values = torch.cat([v_win, v_host.gather(2, take)], dim=2)
    return _masked_attention(q, keys, values, valid, scale)


def _masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q`` ``[R, q_heads, D]`` over ``keys/values`` ``[R, kv_heads, K, D]``
    where ``valid`` ``[R, kv_heads, K]``; fp32 result. Invalid rows may hold anything (rows of a
    host region never written: NaN included), so they are zeroed, not only masked."""
    slots, hq, d = q.shape
    kv_heads = keys.shape[1]
    keys = keys.float().masked_fill(~valid[..., None], 0.0)
    values = values.float().masked_fill(~valid[..., None], 0.0)
    qg = q.float().view(slots, kv_heads, hq // kv_heads, d)
    s = torch.einsum("rhgd,rhkd->rhgk", qg, keys) * scale
    s = s.masked_fill(~valid[:, :, None, :], -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("rhgk,rhkd->rhgd", p, values).reshape(slots, hq, d)
