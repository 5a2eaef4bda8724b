"""Sparse decode attention: sink + local window, and the selected keys of the retrieval region.

    q          [rows, q_heads, D]           one row per slot, or (``row_of_slot``) the layer's
                                            whole decode batch, of which slot ``r`` reads row
                                            ``row_of_slot[r]`` (-1: the slot is idle this step)
    k_win/v_win [batch, kv_heads, W, D]     the sink tokens and the local window (any order: keys
                                            are post-RoPE), ``win_len[batch]`` valid rows
    k_host/v_host [batch, kv_heads, N, D]   the retrieval region, in **pinned host memory**: the
                                            kernel reads the selected rows itself over PCIe
                                            (mapped memory, no copy orchestrated by the CPU)
    sel        [batch, kv_heads, k] int32   selected rows of the retrieval region (-1: none)
    out        [rows, q_heads, D]           written at the slots' rows only with ``row_of_slot``

``attend_pool`` is the same attention with every key in SGLang's KV pool ``[S, kv_heads, D]``:
the window is a list of pool slots per sequence (``win_idx [batch, W]``), and a selected row
``j`` is the pool slot ``req_to_token[pool_of_slot[b], sink + j]``, looked up inside the kernel.
Reading the batch's queries through ``row_of_slot`` and writing its output rows in place saves
the gather, scatter and index arithmetic around the kernel (13 launches a layer in the server).

Stage 1 (grid ``batch x kv_heads x splits``): the first ``ceil(W / CHUNK)`` splits attend over
window chunks, the rest over chunks of ``SEL_CHUNK`` selected rows; each writes a partial output
and its log-sum-exp for the ``G`` query heads of its KV head (padded to 16 rows for ``tl.dot``).
The selected rows' chunks are small (one ``BLOCK_T`` tile by default): each row is three
dependent loads (``sel`` -> ``req_to_token`` -> K/V) that one program cannot overlap across its
tiles, and those splits sit on the decode step's critical path, after the selection (one
long chunk would walk its tiles in series); the window's chunks run beside the selection and
stay long.
Stage 2 merges the partials by log-sum-exp, which is exact: softmax over the union of disjoint
key sets.

The window's partials do not depend on the selection, so ``attend_pool_window`` can launch them
on a side stream before the selection runs (``window=`` of ``attend_pool`` then launches only
the selected rows' splits and joins the side stream before the merge): at batch 1 the selection
kernels use a few SMs, and the window's chunks, the longest programs of stage 1, leave the
critical path. Inside a CUDA graph the fork and the join become the graph's branches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 16


@triton.jit(do_not_specialize=["N_ROWS"])  # the batch size: one compiled kernel for all
def _partial_kernel(Q, RowOfSlot, KW, VW, WinLen, WinIdx, KH, VH, Sel, ReqToToken, PoolOfSlot,
                    MidO, MidL, sm_scale,
                    stride_qb, stride_qh,
                    stride_wb, stride_wh, stride_wt, stride_widx,
                    stride_hb, stride_hh, stride_ht, stride_r2t,
                    K_SEL, S_WIN, SINK, N_ROWS, SPLIT0, SPLITS,
                    G: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                    SEL_CHUNK: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, Q_ROWS: tl.constexpr,
                    POOL: tl.constexpr):
    """Split ``SPLIT0 + program_id(2)`` of ``SPLITS`` (a launch may cover only the window's
    splits, or only the selected rows')."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2) + SPLIT0
    kv_heads = tl.num_programs(1)
    splits = SPLITS
    lane = tl.arange(0, BLOCK_H)
    mask_h = lane < G
    heads = h * G + lane
    offs_d = tl.arange(0, D)
    q_row = b
    if Q_ROWS:
        # an idle slot (-1) reads row 0 and writes nothing; a row past the batch is never read
        q_row = tl.minimum(tl.maximum(tl.load(RowOfSlot + b), 0), N_ROWS - 1)
    q = tl.load(Q + q_row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    if s < S_WIN:
        start = s * CHUNK
        end = tl.minimum(start + CHUNK, tl.load(WinLen + b))
        kbase = KW + b * stride_wb + h * stride_wh
        vbase = VW + b * stride_wb + h * stride_wh
        stride_t = stride_wt
    else:
        start = (s - S_WIN) * SEL_CHUNK
        end = tl.minimum(start + SEL_CHUNK, K_SEL)
        kbase = KH + b * stride_hb + h * stride_hh
        vbase = VH + b * stride_hb + h * stride_hh
        stride_t = stride_ht
    for t0 in tl.range(start, end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        valid = offs_t < end
        # (both branches leave ``rows`` int64: a runtime branch must not change its type)
        if s < S_WIN:
            if POOL:
                rows = tl.load(WinIdx + b * stride_widx + offs_t, mask=valid, other=0)
                rows = rows.to(tl.int64)
            else:
                rows = offs_t.to(tl.int64)
        else:
            rows = tl.load(Sel + (b * kv_heads + h) * K_SEL + offs_t, mask=valid, other=-1)
            valid = valid & (rows >= 0)
            rows = tl.maximum(rows, 0)
            if POOL:  # retrieval row -> position -> pool slot
                rows = tl.load(ReqToToken + tl.load(PoolOfSlot + b) * stride_r2t + SINK + rows,
                               mask=valid, other=0)
            rows = rows.to(tl.int64)
        k = tl.load(kbase + rows[None, :] * stride_t + offs_d[:, None], mask=valid[None, :],
                    other=0.0)  # [D, BLOCK_T]
        qk = tl.dot(q, k.to(q.dtype)) * sm_scale  # [BLOCK_H, BLOCK_T]
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        v = tl.load(vbase + rows[:, None] * stride_t + offs_d[None, :], mask=valid[:, None],
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    lse = tl.where(denom > 0, m + tl.log(tl.maximum(denom, 1e-30)), float("-inf"))
    out = acc / tl.maximum(denom, 1e-30)[:, None]
    row = (b * kv_heads * G + heads) * splits + s
    tl.store(MidO + row[:, None] * D + offs_d[None, :], out, mask=mask_h[:, None])
    tl.store(MidL + row, lse, mask=mask_h)


@triton.jit(do_not_specialize=["N_ROWS"])
def _merge_kernel(MidO, MidL, RowOfSlot, Out, stride_ob, stride_oh, N_ROWS,
                  SPLITS: tl.constexpr,
                  SPLITS_P: tl.constexpr, D: tl.constexpr, Q_ROWS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    out_row = b
    if Q_ROWS:
        out_row = tl.load(RowOfSlot + b)
    if (out_row >= 0) & (out_row < N_ROWS):
        row = b * heads + h
        offs_s = tl.arange(0, SPLITS_P)
        offs_d = tl.arange(0, D)
        lse = tl.load(MidL + row * SPLITS + offs_s, mask=offs_s < SPLITS, other=float("-inf"))
        m = tl.max(lse, axis=0)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m))
        o = tl.load(MidO + (row * SPLITS + offs_s[:, None]) * D + offs_d[None, :],
                    mask=offs_s[:, None] < SPLITS, other=0.0)
        out = tl.sum(w[:, None] * o, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
        tl.store(Out + out_row * stride_ob + h * stride_oh + offs_d,
                 out.to(Out.dtype.element_ty))


class SparseAttention:
    """Scratch buffers and launches for fixed ``(batch, q_heads, kv_heads, D)``, window
    capacity ``W`` and ``k`` selected keys. ``chunk``: window rows per split; ``sel_chunk``:
    selected rows per split (default one ``block_t`` tile, see the module doc, and more for a
    top-k over 2048 rows: at most 64 selected splits, so the merge's program, which holds every
    split's partial, stays small)."""

    def __init__(self, batch: int, q_heads: int, kv_heads: int, d: int, w: int, k: int,
                 device: torch.device | str = "cuda", chunk: int = 256, block_t: int = 32,
                 sel_chunk: int | None = None):
        if q_heads // kv_heads > BLOCK_H:
            raise ValueError(f"at most {BLOCK_H} query heads per KV head")
        self.G, self.d, self.k, self.chunk, self.block_t = q_heads // kv_heads, d, k, chunk, block_t
        self.sel_chunk = (max(block_t, triton.next_power_of_2(triton.cdiv(k, 64)))
                          if sel_chunk is None else sel_chunk)
        self.s_win = triton.cdiv(w, chunk)
        self.splits = self.s_win + triton.cdiv(k, self.sel_chunk)
        self.mid_o = torch.empty(batch, q_heads, self.splits, d, dtype=torch.float32,
                                 device=device)
        self.mid_l = torch.empty(batch, q_heads, self.splits, dtype=torch.float32, device=device)

    def __call__(self, q, k_win, v_win, win_len, k_host, v_host, sel, out, sm_scale: float,
                 row_of_slot: torch.Tensor | None = None):
        """Attention over each sequence's window rows and selected host rows (module doc)."""
        if k_win.stride() != v_win.stride() or k_host.stride() != v_host.stride():
            raise ValueError("K and V buffers need the same layout")
        bsz, kv_heads = sel.shape[:2]
        if row_of_slot is None and q.shape[0] < bsz:
            raise ValueError(f"q has {q.shape[0]} rows for {bsz} sequences")
        self._launch(q, row_of_slot, k_win, v_win, win_len, None, k_host, v_host, sel, None,
                     None, 0, out, sm_scale, bsz, kv_heads,
                     (k_win.stride(0), k_win.stride(1), k_win.stride(2)),
                     (k_host.stride(0), k_host.stride(1), k_host.stride(2)))
        return out

    def attend_pool(self, q, row_of_slot, k_buf, v_buf, win_idx, win_len, sel, req_to_token,
                    pool_of_slot, sink: int, out, sm_scale: float, window=None):
        """Attention over pool slots: ``win_idx[b, :win_len[b]]`` and the slots of the
        selected positions ``sink + sel`` of request row ``pool_of_slot[b]`` of
        ``req_to_token``; ``k_buf/v_buf`` ``[S, kv_heads, D]``. Writes ``out`` at
        ``row_of_slot`` (module doc). ``window``: what ``attend_pool_window`` returned (its
        window splits are done or under way; only the selected rows' are launched here)."""
        args = self._pool_args(q, row_of_slot, k_buf, v_buf, win_idx, win_len, sel,
                               req_to_token, pool_of_slot, sink, sm_scale)
        bsz, kv_heads = sel.shape[:2]
        if window is None:
            self._partials(*args, 0, self.splits)
        else:
            self._partials(*args, self.s_win, self.splits - self.s_win)
            if isinstance(window, torch.cuda.Stream):
                torch.cuda.current_stream().wait_stream(window)
        self._merge(row_of_slot, win_len, out, bsz, kv_heads)
        return out

    def attend_pool_window(self, q, row_of_slot, k_buf, v_buf, win_idx, win_len, sel,
                           req_to_token, pool_of_slot, sink: int, sm_scale: float,
                           stream: torch.cuda.Stream | None = None):
        """The window's splits of ``attend_pool`` on ``stream``, after what the current stream
        has queued (the query, the step's new K/V), or on the current stream without one;
        ``sel`` is only read for its shape. Returns what ``attend_pool(..., window=)`` takes:
        the stream to join, or True."""
        args = (*self._pool_args(q, row_of_slot, k_buf, v_buf, win_idx, win_len, sel,
                                 req_to_token, pool_of_slot, sink, sm_scale), 0, self.s_win)
        if stream is None:
            self._partials(*args)
            return True
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._partials(*args)
        return stream

    @staticmethod
    def _pool_args(q, row_of_slot, k_buf, v_buf, win_idx, win_len, sel, req_to_token,
                   pool_of_slot, sink, sm_scale) -> tuple:
        """``_partials``' arguments (but the splits) for attention over pool slots: window and
        selected rows both read ``k_buf``/``v_buf`` ``[S, kv_heads, D]``."""
        if k_buf.stride() != v_buf.stride():
            raise ValueError("K and V buffers need the same layout")
        bsz, kv_heads = sel.shape[:2]
        pool = (0, k_buf.stride(1), k_buf.stride(0))
        return (q, row_of_slot, k_buf, v_buf, win_len, win_idx, k_buf, v_buf, sel, req_to_token,
                pool_of_slot, sink, sm_scale, bsz, kv_heads, pool, pool)

    def _launch(self, q, row_of_slot, kw, vw, win_len, win_idx, kh, vh, sel, req_to_token,
                pool_of_slot, sink, out, sm_scale, bsz, kv_heads, win_strides, sel_strides):
        self._partials(q, row_of_slot, kw, vw, win_len, win_idx, kh, vh, sel, req_to_token,
                       pool_of_slot, sink, sm_scale, bsz, kv_heads, win_strides, sel_strides,
                       0, self.splits)
        self._merge(row_of_slot, win_len, out, bsz, kv_heads)

    def _partials(self, q, row_of_slot, kw, vw, win_len, win_idx, kh, vh, sel, req_to_token,
                  pool_of_slot, sink, sm_scale, bsz, kv_heads, win_strides, sel_strides,
                  first: int, count: int):
        """Stage 1 for splits ``first .. first + count``."""
        if count <= 0:
            return
        q_rows = row_of_slot is not None
        is_pool = win_idx is not None
        _partial_kernel[(bsz, kv_heads, count)](
            q, row_of_slot if q_rows else win_len, kw, vw, win_len,
            win_idx if is_pool else win_len, kh, vh, sel,
            req_to_token if is_pool else sel, pool_of_slot if is_pool else win_len,
            self.mid_o, self.mid_l, sm_scale, q.stride(0), q.stride(1), *win_strides,
            win_idx.stride(0) if is_pool else 0, *sel_strides,
            req_to_token.stride(0) if is_pool else 0, sel.shape[-1], self.s_win, sink,
            q.shape[0], first, self.splits,
            G=self.G, D=self.d, CHUNK=self.chunk, SEL_CHUNK=self.sel_chunk,
            BLOCK_T=self.block_t, BLOCK_H=BLOCK_H,
            Q_ROWS=q_rows, POOL=is_pool)

    def _merge(self, row_of_slot, win_len, out, bsz, kv_heads):
        q_rows = row_of_slot is not None
        sp = self.splits
        _merge_kernel[(bsz, kv_heads * self.G)](
            self.mid_o, self.mid_l, row_of_slot if q_rows else win_len, out, out.stride(0),
            out.stride(1), out.shape[0], SPLITS=sp, SPLITS_P=triton.next_power_of_2(sp), D=self.d,
            Q_ROWS=q_rows)
