"""A long prompt's chunked prefill with its finished chunks in host memory (``--sparse-offload``).

Without this, a prompt's whole KV sits in the GPU pool until its first decode step offloads the
retrieval region, so the longest prompt a server can take is what its pool holds. With it, a
chunked prefill whose computed prefix is past ``--sparse-threshold`` takes a sparse slot, and
before each later chunk the positions computed so far, up to the last ``local``, enter the
retrieval region (encoded for selection, copied to the host region, pool slots freed:
``decode_state.SparseDecodeState._offload_prefix``). The pool holds, per such request, the sink,
``local`` tokens and the chunks in flight; the host region holds the rest, as it will while the
request decodes.

Attention of a chunk over its offloaded prefix is exact (dense from host, not sparse): per
layer, the request's keys are laid out in order (``gather_prefix``: sink and tail from the pool,
the region copied from host memory, the chunk's own keys) and the chunk's queries attend them
causally (``causal_attention``). The dense kernel sees the request with no prefix
(``SparseDecodeState.extend_view``), so it does only the chunk's own causal part, which is
overwritten. Per chunk and layer that copies the region once over PCIe (for 8B-class models with 8
KV heads at D = 128: 4 KiB per token, so 1 GiB at 256K tokens, ~20 ms at 50 GB/s), several
times less than the chunk's attention over the whole prefix at these lengths, which is why
dense-from-host is affordable.

The scheduler, in SGLang, would not admit such a prompt: it caps a request's input at the pool
size (``max_req_input_len``) and admits a request only when the pool can hold its whole prompt.
Three hooks, registered with ``--sparse-offload`` only, change that for prompts this path serves:
``raise_input_limit`` (AFTER ``TpModelWorker.get_worker_info``: the cap becomes the host
region's ``--sparse-max-context``), ``clip_new_tokens`` (AROUND
``Scheduler.init_req_max_new_tokens``: SGLang would leave such a prompt no new tokens) and
``admit_offloaded_prompt`` (AROUND ``PrefillAdder.add_one_req``: such a prompt is charged
``threshold + 2 chunks``, its peak in the pool, while a sparse slot is free for it). A fourth,
``keep_offloaded_prefill_eager`` (AROUND ``PrefillCudaGraphRunner.can_run_graph``), keeps the
batches that may attend an offloaded prefix off SGLang's prefill CUDA graphs.
"""

from __future__ import annotations

import weakref

import torch

from sglang_pic.compat.request_state import matched_len, pool_row

from .config import SparseDecodeConfig

_SCORE_ELEMENTS = 1 << 26
"""fp32 scores per block of the fallback attention (256 MiB)."""

_state = None  # the scheduler's SparseDecodeState with offloading (``bind``)
_credited: weakref.WeakSet = weakref.WeakSet()  # admitted with a credit, slot not yet taken


def bind(state) -> None:
    """The offloading sparse state of this (scheduler) process, read by the admission hook."""
    global _state
    _state = state


def gather_prefix(buf: torch.Tensor, sink: torch.Tensor, host_rows: torch.Tensor,
                  tail: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """One layer's K (or V) of a request in position order, ``[S + N + T + E, kv_heads, D]``:
    the pool slots ``sink`` (``[S]``) of ``buf`` ``[pool, kv_heads, D]``, the retrieval region
    ``host_rows`` ``[N, kv_heads, D]`` (host memory, copied without blocking), the pool slots
    ``tail`` (``[T]``) and the chunk's own ``new`` ``[E, kv_heads, D]``."""
    s, n, t, e = sink.numel(), host_rows.shape[0], tail.numel(), new.shape[0]
    out = torch.empty((s + n + t + e, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
    torch.index_select(buf, 0, sink, out=out[:s])
    out[s:s + n].copy_(host_rows, non_blocking=True)
    torch.index_select(buf, 0, tail, out=out[s + n:s + n + t])
    out[s + n + t:].copy_(new)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of the last ``E`` positions' queries ``q`` ``[E, q_heads, D]`` over the keys
    and values ``[L, kv_heads, D]`` of positions ``0..L-1`` (L >= E), causal: query ``i`` sees
    keys ``0 .. L - E + i``. FlashInfer's single-request prefill on a GPU that has it (its
    causal mask is aligned to the last key); otherwise fp32 scores in blocks of queries."""
    if q.is_cuda:
        try:
            from flashinfer import single_prefill_with_kv_cache
        except ImportError:
            pass
        else:
            return single_prefill_with_kv_cache(q, k.to(q.dtype), v.to(q.dtype), causal=True,
                                                sm_scale=scale)
    e, hq, d = q.shape
    length, kv_heads = k.shape[0], k.shape[1]
    group = hq // kv_heads
    kf = k.float().permute(1, 0, 2)  # [kv_heads, L, D]
    vf = v.float().permute(1, 0, 2)
    out = torch.empty(e, hq, d, dtype=torch.float32, device=q.device)
    block = max(1, min(e, _SCORE_ELEMENTS // max(1, hq * length)))
    for i0 in range(0, e, block):
        i1 = min(e, i0 + block)
        visible = length - e + i1  # keys the block's last query sees
        qb = q[i0:i1].float().view(i1 - i0, kv_heads, group, d).permute(1, 2, 0, 3)
        scores = torch.einsum("hgbd,hld->hgbl", qb, kf[:, :visible]) * scale
        pos = torch.arange(visible, device=q.device)
        last = length - e + torch.arange(i0, i1, device=q.device)  # each query's last key
        scores.masked_fill_(pos[None, :] > last[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        ob = torch.einsum("hgbl,hld->bhgd", probs, vf[:, :visible])
        out[i0:i1] = ob.reshape(i1 - i0, hq, d)
    return out


# ---- the scheduler -------------------------------------------------------------------------


def _serves(server_args) -> bool:
    """Whether prompts longer than the pool can be served: offloading on, chunked prefill on."""
    chunk = getattr(server_args, "chunked_prefill_size", None)
    return chunk is not None and chunk > 0


def raise_input_limit(result, self, *args, **kwargs):
    """AFTER ``TpModelWorker.get_worker_info``: SGLang caps a request's input at the pool size
    (``max_req_len``, ``max_req_input_len``: items 4 and 5); offloaded prefill needs only the
    host region to hold it, so the cap is ``--sparse-max-context`` (or the context length)."""
    state = _state
    if state is None or not _serves(self.server_args):
        return None
    context = int(self.model_config.context_len)
    limit = min(context - 1, (state.cfg.max_context or context) - 1)
    if limit <= result[4]:
        return None
    out = list(result)
    out[4], out[5] = limit, limit - 5
    return tuple(out)


def clip_new_tokens(original, self, req, *args, **kwargs):
    """AROUND ``Scheduler.init_req_max_new_tokens(req)``: SGLang also caps ``max_new_tokens`` at
    what the pool holds beside the prompt (0 for a prompt longer than the pool). A prompt that
    offloads its prefill decodes with its context in host memory too, so its cap is the
    request-length limit (``raise_input_limit``) only."""
    requested = req.sampling_params.max_new_tokens
    result = original(self, req, *args, **kwargs)
    state, prompt = _state, len(req.origin_input_ids)
    if state is None or prompt <= state.cfg.threshold or not _serves(self.server_args):
        return result
    wanted = (1 << 30) if requested is None else requested
    limit = getattr(self, "max_new_tokens_limit", None)
    if limit:
        wanted = min(wanted, limit)
    req.sampling_params.max_new_tokens = max(0, min(wanted, self.max_req_len - prompt - 1))
    return result


def pool_need(cfg: SparseDecodeConfig, chunk: int, prompt: int) -> int:
    """Pool tokens a prompt of ``prompt`` tokens holds at most during an offloaded prefill:
    offloading starts once the computed prefix is past ``threshold`` (at most ``threshold +
    chunk``), while the next chunk is allocated."""
    return min(prompt, cfg.threshold + 2 * chunk + cfg.sink + cfg.local)


def release_finished_slots(scheduler, running_batch) -> bool:
    """Before the scheduler admits requests: sparse slots whose request is neither running nor
    the chunked prefill are released (``SparseDecodeState.release_finished``). A prompt that
    finishes during its offloaded prefill (``max_new_tokens`` 1, an abort) never decodes, where
    slots are otherwise reclaimed, and its slot would keep the next long prompt out for good.
    Returns whether any was released."""
    state = _state
    if state is None or all(slot is None for slot in state.slots):
        return False  # nothing to release: the running batch is not read (every iteration)
    live = {pool_row(req) for req in running_batch.reqs}
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        live.add(pool_row(chunked))
    live.discard(None)
    return state.release_finished(live) > 0


def _budget_offsets(adder) -> tuple[object, str, str]:
    """Where ``PrefillAdder`` keeps the tokens its admitted requests will take from the pool:
    the object and its (total, current) offsets. 0.5.17 keeps them on the adder, 0.5.23 on
    its ``memory_budget`` (a ``PrefillBudget``)."""
    budget = getattr(adder, "memory_budget", None)
    if budget is not None:
        return budget, "total_offset", "current_offset"
    return adder, "rem_total_token_offset", "cur_rem_token_offset"


def admit_offloaded_prompt(original, self, req, *args, **kwargs):
    """AROUND ``PrefillAdder.add_one_req(req, ...)``: a prompt that will offload its prefill is
    charged ``pool_need`` tokens, not its length, while a sparse slot is free for it (each such
    prompt admitted holds a free slot until it takes one, or finishes without taking one)."""
    state = _state
    credit = 0
    if state is not None:
        cfg = state.cfg
        chunk = self.rem_chunk_tokens
        prompt = len(req.origin_input_ids)
        held = {slot.rid for slot in state.slots if slot is not None}
        for r in list(_credited):  # a credit ends when its request holds a slot or finished
            if r.rid in held or r.finished():
                _credited.discard(r)
        waiting = sum(r is not req for r in _credited)
        free = sum(slot is None for slot in state.slots) - waiting
        if chunk and prompt > cfg.threshold and free > 0 and not matched_len(req):
            credit = max(0, prompt - pool_need(cfg, chunk, prompt))
    if not credit:
        return original(self, req, *args, **kwargs)
    budget, total, current = _budget_offsets(self)
    setattr(budget, total, getattr(budget, total) - credit)
    setattr(budget, current, getattr(budget, current) - credit)
    try:
        result = original(self, req, *args, **kwargs)
    finally:
        setattr(budget, total, getattr(budget, total) + credit)
        setattr(budget, current, getattr(budget, current) + credit)
    if req in self.can_run_list:
        _credited.add(req)
    return result


def keep_offloaded_prefill_eager(original, self, forward_batch, *args, **kwargs):
    """AROUND ``PrefillCudaGraphRunner.can_run_graph(forward_batch)``: an extend batch with a
    row whose computed prefix is past the threshold may attend a prefix in host memory. That
    row's attention is set up per batch on the eager path (``attend_prefill``, and the dense
    kernel's metadata built without that prefix: ``backends._extend_view``); SGLang's prefill
    graph runner builds the metadata from its own padded view, where the dense kernel would read
    the prefix's freed pool slots. Such batches run eagerly; a batch that does not say its
    prefixes is not sent to a graph either."""
    state = _state
    if state is not None:
        prefix = getattr(forward_batch, "extend_prefix_lens_cpu", None)
        if prefix is None or any(int(n) > state.cfg.threshold for n in prefix):
            return False
    return original(self, forward_batch, *args, **kwargs)
