"""The operations sparse decoding needs, on the GPU (Triton kernels) or on CPU (torch).

Both implementations share one interface so that ``decode_state.SparseDecodeState`` (what moves
where, per request and step) is the same code on every device. ``q`` is the layer's decode batch
``[bs, q_heads, D]``; slot ``r`` is the request in row ``row_of_slot[r]`` (-1: idle this step):

    encode(layer, slot, keys [n, kv_heads, D], offset)     keys enter a slot's retrieval region
    truncate(layer, slot, keep, held)      a region of ``held`` rows keeps its first ``keep``
    select(layer, q, row_of_slot [R], n_ret [R], n_sel [R], shift [R])
           -> [R, kv_heads, k] int32 rows (-1: none); a slot with ``n_sel`` 0 does not vote:
                                    it attends the rows this layer selected for it last,
                                    ``shift`` rows on (``--sparse-reselect-interval``), or, for
                                    ops made with ``rerank_between``, reranks this layer's last
                                    vote's candidates ``shift`` rows on with its query and
                                    takes their top-k (``--sparse-vote-interval``)
    attend_pool(q, row_of_slot, k_buf, v_buf [S, kv_heads, D], win_idx [R, W] pool slots,
           win_len [R], rows [R, kv_heads, k], req_to_token, pool_of_slot [R], sink, out, scale)
                                    softmax attention over each slot's first win_len window
                                    slots and the pool slots of its selected positions
                                    ``sink + rows``, written into ``out`` ``[bs, q_heads, D]`` at
                                    the slots' rows (other rows untouched)
    start_window(q, row_of_slot, k_buf, v_buf, win_idx, win_len, req_to_token, pool_of_slot,
           sink, scale) -> handle | None
                                    the window's part of ``attend_pool`` begun before the
                                    selection (a side stream on a GPU; None: nothing begun),
                                    passed to ``attend_pool(..., window=handle)``
    attend_split(q, row_of_slot, k_win, v_win [R, kv_heads, W, D], win_len [R], k_host, v_host
           [R, kv_heads, N, D], rows [R, kv_heads, k] (-1: none), out, scale)
                                    the same over window rows and selected host rows
                                    (``--sparse-offload``)

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
                 capacity: int, topk: int, candidates: int, attended: int, device,
                 rerank_between: bool = False):
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
        # each layer's last selection: a slot that skips a step's selection attends these
        self.last = torch.full((layers, slots, kv_heads, self.selector.k), -1,
                               dtype=torch.int32, device=self.device)
        # --sparse-vote-interval: each layer's last vote's candidates, reranked between votes
        self.cand = (torch.full((layers, slots, kv_heads, self.selector.C), -1,
                                dtype=torch.int32, device=self.device)
                     if rerank_between else None)
        self.attention = SparseAttention(slots, q_heads, kv_heads, d, attended - topk, topk,
                                         device=self.device)
        self._side_stream = None  # start_window's, made on first use

    @staticmethod
    def kept_vote_bytes(layers: int, slots: int, kv_heads: int, candidates: int) -> int:
        """GPU memory of the kept candidate lists (``--sparse-vote-interval`` above 1)."""
        return layers * slots * kv_heads * candidates * 4

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

    def truncate(self, layer: int, slot: int, keep: int, held: int) -> None:
        """Rows past ``keep`` are never read (the selection reads ``n_ret`` rows) and later
        encodes overwrite them; only the sign-bit counts, which the votes' histogram range is
        set from, lose the dropped rows' bits (bit ``i % 32`` of word ``i // 32`` is
        coordinate ``i``)."""
        if held <= keep:
            return
        words = self.centroid[layer, slot, :, keep:held]  # [kv_heads, m, D / 32] int32
        shifts = torch.arange(32, device=words.device, dtype=torch.int32)
        bits = (words[..., None] >> shifts) & 1  # [kv_heads, m, D / 32, 32]
        self.bit_counts[layer, slot] -= bits.sum(1, dtype=torch.int32).flatten(1)

    def select(self, layer: int, q: torch.Tensor, row_of_slot: torch.Tensor,
               n_ret: torch.Tensor, n_sel: torch.Tensor | None = None,
               shift: torch.Tensor | None = None) -> torch.Tensor:
        return self.selector(q, self.rt, self.levels, self.centroid[layer], self.codes[layer],
                             self.weights[layer], n_ret, self.bit_counts[layer],
                             row_of_slot=row_of_slot, n_sel=n_sel,
                             last=None if n_sel is None else self.last[layer], shift=shift,
                             cand=None if n_sel is None or self.cand is None
                             else self.cand[layer])

    def start_window(self, q, row_of_slot, k_buf, v_buf, win_idx, win_len, req_to_token,
                     pool_of_slot, sink: int, scale: float):
        """On a GPU, the window's attention partials on a side stream, overlapping the
        selection (``SparseAttention.attend_pool_window``); elsewhere None."""
        if not q.is_cuda:
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=q.device)
        return self.attention.attend_pool_window(
            q, row_of_slot, k_buf, v_buf, win_idx, win_len, self.selector.sel, req_to_token,
            pool_of_slot, sink, scale, self._side_stream)

    def attend_pool(self, q, row_of_slot, k_buf, v_buf, win_idx, win_len, rows, req_to_token,
                    pool_of_slot, sink: int, out, scale: float, window=None) -> torch.Tensor:
        return self.attention.attend_pool(q, row_of_slot, k_buf, v_buf, win_idx, win_len, rows,
                                          req_to_token, pool_of_slot, sink, out, scale,
                                          window=window)

    def attend_split(self, q, row_of_slot, k_win, v_win, win_len, k_host, v_host, rows, out,
                     scale: float) -> torch.Tensor:
        return self.attention(q, k_win, v_win, win_len, k_host, v_host, rows, out, scale,
                              row_of_slot=row_of_slot)


class TorchIndexOps:
    """The same operations in torch (CPU engine), from ``retrieval.KeyIndex`` per layer and slot."""

    def __init__(self, layers: int, slots: int, q_heads: int, kv_heads: int, head_dim: int,
                 capacity: int, topk: int, candidates: int, attended: int, device,
                 rerank_between: bool = False):
        self.cfg = ParisConfig(vote="similarity")
        self.k, self.c, self.G = topk, candidates, q_heads // kv_heads
        self.index: list[list[KeyIndex | None]] = [[None] * slots for _ in range(layers)]
        self.last: list[torch.Tensor | None] = [None] * layers  # each layer's last selection
        # --sparse-vote-interval: each layer's and slot's last vote's candidates [kv_heads, C]
        self.rerank_between = rerank_between
        self.last_cand: list[list[torch.Tensor | None]] = [[None] * slots for _ in range(layers)]

    def encode(self, layer: int, slot: int, keys: torch.Tensor, offset: int) -> None:
        keys = keys.float().transpose(0, 1)  # [kv_heads, n, D]
        index = self.index[layer][slot]
        if offset == 0 or index is None:
            self.index[layer][slot] = KeyIndex(keys, self.cfg)
            return
        if index.n != offset:
            raise RuntimeError(f"retrieval region holds {index.n} keys, appending at {offset}")
        index.append(keys)

    def truncate(self, layer: int, slot: int, keep: int, held: int) -> None:
        index = self.index[layer][slot]
        if index is not None and index.n > keep:
            index.truncate(keep)

    def select(self, layer: int, q: torch.Tensor, row_of_slot: torch.Tensor,
               n_ret: torch.Tensor, n_sel: torch.Tensor | None = None,
               shift: torch.Tensor | None = None) -> torch.Tensor:
        q = _slot_queries(q, row_of_slot)
        slots, hq, d = q.shape
        kv_heads = hq // self.G
        out = torch.full((slots, kv_heads, self.k), -1, dtype=torch.int32, device=q.device)
        last = self.last[layer]
        if last is None:
            last = self.last[layer] = out.clone()
        n_sel = n_ret if n_sel is None else n_sel
        shifts = [0] * slots if shift is None else shift.tolist()
        for s, (n, fresh) in enumerate(zip(n_ret.tolist(), n_sel.tolist(), strict=True)):
            index = self.index[layer][s]
            if n == 0 or index is None:
                continue
            qg = q[s].float().view(kv_heads, self.G, d)
            gone = None  # candidates moved into the window (a step between votes)
            if fresh == 0 and self.rerank_between:  # its last vote's candidates, moved on
                moved = self.last_cand[layer][s] + shifts[s]
                gone = moved >= n
                cand = moved.clamp(max=n - 1)
            elif fresh == 0:  # the slot attends its last selection, moved on
                moved = last[s] + shifts[s]
                out[s] = torch.where((last[s] >= 0) & (moved < n), moved, -1)
                continue
            else:
                qn = qg / qg.norm(dim=-1, keepdim=True).clamp_min(1e-12)
                votes = index.coarse_votes(qn.sum(1))[:, :n]  # similarity votes are linear in q
                cand = votes.topk(min(self.c, n), dim=-1).indices
                self.last_cand[layer][s] = cand
            est = torch.stack([index.estimate(qg[:, g], cand) for g in range(self.G)]).amax(0)
            k = min(self.k, cand.shape[1])
            if gone is None:
                out[s, :, :k] = cand.gather(1, est.topk(k, dim=-1).indices).int()
                last[s] = out[s]
                continue
            top = est.masked_fill(gone, -math.inf).topk(k, dim=-1)
            out[s, :, :k] = torch.where(top.values > -math.inf, cand.gather(1, top.indices),
                                        -1).int()
        return out

    def start_window(self, *args, **kwargs) -> None:
        return None  # one exact attention over window and selection in ``attend_pool``

    def attend_pool(self, q, row_of_slot, k_buf, v_buf, win_idx, win_len, rows, req_to_token,
                    pool_of_slot, sink: int, out, scale: float, window=None) -> torch.Tensor:
        kv_heads = rows.shape[1]
        at = torch.arange(win_idx.shape[1], device=win_idx.device)
        window_slots = torch.where(at[None, :] < win_len[:, None].long(), win_idx, -1)
        pos = (rows.long() + sink).clamp(max=req_to_token.shape[1] - 1)
        selected = torch.where(rows >= 0, req_to_token[pool_of_slot[:, None, None], pos], -1)
        idx = torch.cat([window_slots[:, None, :].expand(-1, kv_heads, -1).int(),
                         selected.int()], 2)
        res = indexed_attention(_slot_queries(q, row_of_slot), k_buf, v_buf, idx, scale)
        return _write_rows(out, row_of_slot, res)

    def attend_split(self, q, row_of_slot, k_win, v_win, win_len, k_host, v_host, rows, out,
                     scale: float) -> torch.Tensor:
        res = split_attention(_slot_queries(q, row_of_slot), k_win, v_win, win_len, k_host,
                              v_host, rows, scale)
        return _write_rows(out, row_of_slot, res)


def _slot_queries(q: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
    """``[R, q_heads, D]``: each slot's query row of the batch (row 0 for an idle slot)."""
    return q.index_select(0, row_of_slot.clamp(0, q.shape[0] - 1))


def _write_rows(out: torch.Tensor, row_of_slot: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """``out[row_of_slot[r]] = res[r]`` for the slots with a row in ``out`` (as the kernels:
    -1 and rows past the batch are skipped)."""
    active = (row_of_slot >= 0) & (row_of_slot < out.shape[0])
    out[row_of_slot[active]] = res[active].to(out.dtype)
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
