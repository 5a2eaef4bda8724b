"""Which requests decode sparsely, where their keys are, and the sparse part of a decode step.

SGLang's KV pool keeps every token's K/V (post-RoPE) in GPU memory; sparse decoding changes
what a long request *attends*, not where its KV lives. Per sparse request ("slot", at most
``max_requests``) and layer, its context is split as

    positions [0, sink)                   sink: always attended
    positions [sink, sink + n_ret)        retrieval region: encoded (ids, 4-bit codes, weights);
                                          ``topk`` of them per KV head are selected each step
    positions [sink + n_ret, seq_len)     local window, ``local`` .. ``local + update`` tokens:
                                          always attended; its oldest ``update`` tokens enter
                                          the retrieval region when it is full

so each step attends ``sink + topk + window`` tokens: the sink and the window as pool slots in
``win_idx [R, sink + local + update]`` (the first ``win_len[r]``), the selected ones as retrieval
rows, turned into pool slots inside the attention kernel (``req_to_token``).

With ``--sparse-offload`` (``enable_offload``) the retrieval region leaves the pool: tokens
entering it are copied to pinned host memory (``offload.HostKVRegion``) and their pool slots
freed (``offload.PoolSlotRelease``); each step gathers sink + window from the pool into
``k_win/v_win [R, W, kv_heads, D]`` and the kernel reads the selected rows from host memory.

Per step, outside any CUDA graph (``prepare_decode``, from the backend's metadata init):
activate requests whose context exceeds ``threshold`` (their region is encoded from the pool,
every layer, and their sink listed in ``win_idx``), slide windows, rebuild the window part of
``win_idx`` and the batch-row <-> slot maps, and give the dense kernel a length of 1 for sparse
rows so it does no real work for them.
Per layer, inside the graph when there is one (``attend``): select, then attend, with the
queries read from and the outputs written to the dense output's sparse rows by the kernels
themselves (two selection-and-attention launch chains, no gather or scatter around them). Every
tensor the graph touches is allocated once.

With offloading, a long prompt's prefill leaves the pool too (``note_extend``): once a chunked
prefill's computed prefix is over ``threshold`` the request takes a slot, and before each later
chunk the finished positions up to the last ``local`` enter the retrieval region (encoded, moved to
host memory, pool slots freed). That chunk's attention for the request is not the dense kernel's:
its metadata sees no prefix for the request (``extend_view``), and ``attend_prefill`` overwrites
its rows with exact attention over sink + host region + resident tail + the chunk
(``prefill_offload.causal_attention``). The pool then holds, per such request, the sink, the
window and at most two chunks, not the prompt.

A slot belongs to the request that activated it until a batch shows its request-pool index
holding another request - an extend (``note_extend``) or a decode step (``prepare_decode``: a
different request id, or a length that is not the next step) - or a new long request needs the
slot of one no longer decoding.

A released slot keeps its encoded region, and a new request whose prefix is the same reuses it
(``_slot_for``; as much of it as the new request's region holds): the next turn of a
conversation over a long document, whose prefix the radix cache holds, encodes only its new
tokens instead of the whole region again, which would otherwise cost every turn a long first
step; requests that share only the first part of a region (a system prompt and a
document, then different questions) reuse that part.
"The same" is checked on content, not on pool slots, which may have been freed and rewritten
since: each slot records a fingerprint of its positions' keys in the first and the last layer
(``FINGERPRINT_DIMS`` values of KV head 0 per position and layer: first-layer keys are a
function of token and position, so equal ones mean the same tokens; last-layer keys depend on
everything before them, so a prefix computed another way - a span prefilled alone, a recompute -
differs there), compared exactly with the new request's up to the first position that differs.
The comparison's result is read on the host: a reuse check waits for the GPU once. Not with
``--sparse-offload``, whose regions left the pool.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from .config import SparseDecodeConfig
from .prefill_offload import causal_attention, gather_prefix

logger = logging.getLogger(__name__)

FINGERPRINT_DIMS = 4  # key values (KV head 0) per position and fingerprinted layer


def _put(t: torch.Tensor, i: int, value: int) -> None:
    """``t[i] = value`` without waiting for the GPU. Assigning a Python number to one element of
    a CUDA tensor copies it from pageable host memory, and that copy waits for every kernel
    already queued on the stream: the decode step's bookkeeping would wait for the previous
    step, leaving the GPU idle while the CPU then prepared the next one. ``fill_`` passes the
    value as a kernel argument instead."""
    t[i : i + 1].fill_(value)


@dataclass
class _Slot:
    pool_index: int
    rid: str | None
    n_ret: int  # keys in the retrieval region
    seq_len: int  # context length at the last step seen (the decoded token included)
    prefilling: bool = False  # an offloaded prefill that has not decoded yet
    # decode steps its last selection has served (None: it must select at its next step)
    selection_age: int | None = None


class SparseDecodeState:
    def __init__(self, cfg: SparseDecodeConfig, ops, *, layer_ids: list[int], q_heads: int,
                 kv_heads: int, head_dim: int, capacity: int, max_batch: int,
                 req_to_token: torch.Tensor, device, dtype: torch.dtype = torch.bfloat16):
        self.cfg, self.ops = cfg, ops
        # steps one vote serves: the whole selection (reselect_interval) or the votes alone,
        # the steps between reranking their candidates (vote_interval; the ops were made so)
        self.interval = max(cfg.reselect_interval, cfg.vote_interval)
        self.layer_ids = list(layer_ids)  # the model's attention layers; ops index them 0..n-1
        self.layer_index = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.dtype = dtype
        self.q_heads, self.kv_heads, self.d = q_heads, kv_heads, head_dim
        self.capacity = capacity
        self.req_to_token = req_to_token
        dev = torch.device(device)
        r = cfg.max_requests
        i64 = dict(dtype=torch.int64, device=dev)
        self.slots: list[_Slot | None] = [None] * r
        # what each decode step uploads in one copy: slot_of_row [max_batch], row_of_slot [R]
        # (-1: not in this step's batch), n_ret [R] (0 for a slot not in the batch: its
        # selection passes then skip the slot's keys), n_sel [R] (n_ret for a slot that
        # selects this step, 0 for one attending its last selection) and shift [R] (the steps
        # since that selection)
        self._step_rows = torch.full((max_batch + 4 * r,), -1, **i64)
        self.slot_of_row = self._step_rows[:max_batch]
        self.row_of_slot = self._step_rows[max_batch : max_batch + r]
        # what the selection and attention read: written by each step's upload only (a
        # release zeroes n_ret), in one int32 tensor so that one copy converts them
        self._counts = torch.zeros(3, r, dtype=torch.int32, device=dev)
        self.n_ret, self.n_sel, self.shift = self._counts
        self.pool_of_slot = torch.zeros(r, **i64)
        # sink + window of each slot: pool slots (padding slot 0 past win_len)
        self.win_idx = torch.zeros(r, cfg.sink + cfg.local + cfg.update, **i64)
        self.win_len = torch.zeros(r, dtype=torch.int32, device=dev)
        self.selected: torch.Tensor | None = None  # the last layer's selection (inspection)
        self.rid_of_pool: dict[int, str] = {}
        # host staging of _step_rows (slot_of_row, row_of_slot, n_ret), two buffers used in turn:
        # copied without blocking, since a blocking copy from pageable memory waits for the
        # GPU's previous step and would cost the overlap scheduler its overlap at every step
        pin = dev.type == "cuda"
        self._staging = [torch.empty(max_batch + 4 * r, dtype=torch.int64, pin_memory=pin)
                         for _ in range(2)]
        self._staging_copied: list = [None, None]  # the CUDA event of each buffer's last copy
        self._staging_turn = 0
        self.too_long: set[int] = set()  # pool indices whose context outgrew the capacity
        self.active = False
        self.rows: list[int] = []  # batch rows decoding sparsely this step
        self.batch_rows = 0  # request rows of this step's batch (graph padding excluded)
        self.stats = {"activated": 0, "sparse_steps": 0, "encoded_tokens": 0, "refused_full": 0,
                      "offloaded_tokens": 0, "reused_tokens": 0, "selections": 0}
        # a released slot's encoded rows, reusable by a request with the same prefix (module
        # doc), and per slot and position [0, sink + region) its keys' fingerprint
        self.kept_rows = [0] * r
        # [R, sink + capacity, 2 * FINGERPRINT_DIMS], made at the first encode (the KV dtype)
        self._fingerprint: torch.Tensor | None = None
        self.metrics = None  # sglang_pic.metrics.Counters with --enable-metrics (set by the backend)
        self._warned_full = False
        self.prefill_rows: list[tuple[int, int, int, int, int]] = []
        """This extend batch's rows whose prefix is partly in host memory: (batch row, slot,
        prefix length, extend length, first query token in the batch)."""
        self.host = None  # offload.HostKVRegion with --sparse-offload (enable_offload)
        self.pool_release = None  # offload.PoolSlotRelease, likewise

    def enable_offload(self, host, pool_release, kv_dtype: torch.dtype) -> None:
        """Keep retrieval regions in ``host`` and give their pool slots back (see module doc)."""
        r, w = self.win_idx.shape
        self.host, self.pool_release = host, pool_release
        # the K/V of each slot's sink + window, gathered from the pool every layer
        self.k_win = torch.zeros(r, w, self.kv_heads, self.d, dtype=kv_dtype,
                                 device=self.win_idx.device)
        self.v_win = torch.zeros_like(self.k_win)

    # ---- per step, eager ------------------------------------------------------------------
    def note_extend(self, pool_indices: list[int], rids: list[str] | None,
                    prefix_lens: list[int] | None, extend_lens: list[int] | None) -> None:
        """An extend batch: a pool index now serving another request frees its slot; a sparse
        request's own decode token processed in a mixed batch (dense) moves its length on; with
        offloading, a chunked prefill over ``threshold`` moves its finished positions to the
        retrieval region (``_offload_prefix``) and its rows are listed in ``prefill_rows``."""
        self.prefill_rows = []
        for i, p in enumerate(pool_indices):
            rid = rids[i] if rids is not None else None
            if rid is None or rid != self.rid_of_pool.get(p):
                self.too_long.discard(p)  # another request: its length is its own
            if rid is not None:
                self.rid_of_pool[p] = rid
            for s, slot in enumerate(self.slots):
                if slot is None or slot.pool_index != p:
                    continue
                # the slot's request continues when the extend starts where it stopped; the rid
                # (absent from graph runners' views) must then match too when both are known
                same = prefix_lens is not None and extend_lens is not None \
                    and prefix_lens[i] == slot.seq_len \
                    and (rid is None or slot.rid is None or slot.rid == rid)
                if same:
                    slot.seq_len += extend_lens[i]
                else:
                    self._release(s)
        if self.host is not None and prefix_lens is not None and extend_lens is not None:
            starts = [0, *itertools.accumulate(extend_lens[:-1])]  # each row's first query
            for i, p in enumerate(pool_indices):
                self._offload_prefix(i, p, prefix_lens[i], extend_lens[i], starts[i],
                                     rids[i] if rids is not None else None)

    def _offload_prefix(self, row: int, pool_index: int, prefix: int, extend: int, q_start: int,
                        rid: str | None) -> None:
        """Before a prefill chunk of ``extend`` tokens after ``prefix`` computed ones: past
        ``threshold``, the computed positions up to the last ``local`` enter the request's
        retrieval region (taking a free slot first), and the row is listed for
        ``attend_prefill``."""
        cfg = self.cfg
        k = next((s for s, slot in enumerate(self.slots)
                  if slot is not None and slot.pool_index == pool_index), None)
        if k is None:
            if prefix <= cfg.threshold or pool_index in self.too_long \
                    or prefix + extend > self.capacity + cfg.sink + cfg.local:
                return
            k = next((s for s, slot in enumerate(self.slots) if slot is None), None)
            if k is None:  # every slot holds a request (never one taken from a decoding one)
                self._count("refused_full", 1)
                return
            n_ret = prefix - cfg.sink - cfg.local
            if rid is not None:
                self.rid_of_pool[pool_index] = rid
            self._take_slot(k, pool_index, n_ret, prefix + extend)
            self.slots[k].prefilling = True
            logger.info("sparse decode: a prompt offloads its prefill after %d tokens (slot %d)",
                        prefix, k)
        else:
            slot = self.slots[k]
            end = prefix - cfg.local
            if end > cfg.sink + slot.n_ret:
                self._encode(k, pool_index, cfg.sink + slot.n_ret, end - cfg.sink - slot.n_ret,
                             slot.n_ret)
                slot.n_ret = end - cfg.sink
        self.prefill_rows.append((row, k, prefix, extend, q_start))

    def skip_decode(self) -> None:
        """A decode step none of whose requests is long enough to be sparse."""
        if self.active:
            self.deactivate()
        return None

    @property
    def all_rows(self) -> bool:
        """Whether every request row of this step decodes sparsely: the dense attention then
        has nothing to compute (``backends`` skips it where the backend allows)."""
        return self.active and len(self.rows) == self.batch_rows

    def deactivate(self) -> None:
        self.active = False
        self.rows = []
        self.slot_of_row.fill_(-1)

    def prepare_decode(self, pool_indices: list[int], seq_lens: list[int],
                       seq_lens_dev: torch.Tensor,
                       rids: list[str] | None = None) -> torch.Tensor:
        """Bookkeeping of one decode step over the batch's first ``len(pool_indices)`` rows
        (``rids``: their request ids, when the caller has them). Returns the lengths the dense
        kernel should see (1 for sparse rows)."""
        cfg = self.cfg
        in_batch = {p: i for i, p in enumerate(pool_indices)}
        slot_of_pool = {s.pool_index: k for k, s in enumerate(self.slots) if s is not None}
        for p, k in list(slot_of_pool.items()):
            slot = self.slots[k]
            row = in_batch.get(p)
            # a request decodes one token per step; anything else is not the request we know
            if row is not None and (seq_lens[row] != slot.seq_len + 1 or (
                    rids is not None and slot.rid is not None and rids[row] != slot.rid)):
                self._release(k)
                del slot_of_pool[p]
            elif row is not None and rids is not None and slot.rid is None:
                slot.rid = rids[row]  # activated from a graph runner's view, which has no rids
        for row, (p, n) in enumerate(zip(pool_indices, seq_lens, strict=True)):
            if p in slot_of_pool or n <= cfg.threshold or p in self.too_long:
                continue
            if n > self.capacity + cfg.sink + cfg.local:
                self.too_long.add(p)
                logger.warning("sparse decode: a context of %d tokens exceeds the sparse "
                               "capacity (%d); it decodes densely", n, self.capacity)
                continue
            if rids is not None:
                self.rid_of_pool[p] = rids[row]
            k, reused = self._slot_for(p, n - cfg.sink - cfg.local, in_batch)
            if k is not None:
                self._activate(k, p, n, reused)
                slot_of_pool[p] = k
        rows, slots, fresh = [], [], []
        for k, slot in enumerate(self.slots):
            if slot is None:
                continue
            row = in_batch.get(slot.pool_index)
            if row is None:
                slot.selection_age = None  # sat this step out (retracted, paused): select anew
                continue
            slot.seq_len = seq_lens[row]
            slot.prefilling = False
            held = slot.n_ret
            self._slide(k)
            self._fill_window(k, slot)
            rows.append(row)
            slots.append(k)
            fresh.append(self._selects_now(slot, slot.n_ret != held))
        self.active = bool(rows)
        self.rows = rows
        self.batch_rows = len(pool_indices)
        self._upload_rows(rows, slots, fresh)
        if not rows:
            return seq_lens_dev
        self._count("sparse_steps", len(rows))
        self._count("selections", sum(fresh))
        sparse_row = self.slot_of_row[: seq_lens_dev.shape[0]] >= 0
        return torch.where(sparse_row, torch.ones_like(seq_lens_dev), seq_lens_dev)

    def _selects_now(self, slot: _Slot, region_grew: bool) -> bool:
        """Whether ``slot`` votes at this step: at its first step, when keys entered its region
        (they left the dense window and no vote has seen them) and every ``interval`` steps;
        between those it attends its last selection (``reselect_interval``) or reranks its last
        vote's candidates (``vote_interval``), moved on by the steps since."""
        if slot.selection_age is None or region_grew or (
                slot.selection_age + 1 >= self.interval):
            slot.selection_age = 0
            return True
        slot.selection_age += 1
        return False

    def _upload_rows(self, rows: list[int], slots: list[int], fresh: list[bool]) -> None:
        """``slot_of_row`` (-1 for dense rows), ``row_of_slot`` (-1 for idle slots), ``n_ret``
        (0 for idle slots), ``n_sel`` (0 also for slots not selecting this step, ``fresh``
        False) and ``shift`` (their selections' age) of this step, written in a host buffer
        and copied without blocking the CPU."""
        turn = self._staging_turn
        self._staging_turn ^= 1
        buf = self._staging[turn]
        if self._staging_copied[turn] is not None:
            self._staging_copied[turn].synchronize()  # its copy two steps ago has read it
        n, r = self.slot_of_row.numel(), len(self.slots)
        buf[: n + r] = -1
        buf[n + r :] = 0
        for i, (row, k) in enumerate(zip(rows, slots, strict=True)):
            buf[row] = k
            buf[n + k] = row
            buf[n + r + k] = self.slots[k].n_ret
            if fresh[i]:
                buf[n + 2 * r + k] = self.slots[k].n_ret
            else:
                buf[n + 3 * r + k] = self.slots[k].selection_age
        self._step_rows.copy_(buf, non_blocking=True)
        self._counts.view(-1).copy_(self._step_rows[n + r :])
        if buf.is_pinned():
            event = torch.cuda.Event()
            event.record()
            self._staging_copied[turn] = event

    def _count(self, name: str, n: int) -> None:
        self.stats[name] += n
        if self.metrics is not None:
            self.metrics.inc(name, n)

    def _free_slot(self, in_batch: dict[int, int]) -> int | None:
        for k, slot in enumerate(self.slots):
            if slot is None:
                return k
        for k, slot in enumerate(self.slots):  # a slot whose request is not decoding any more
            # (a prefill in progress is not in a decode batch: its slot holds its prefix)
            if slot.pool_index not in in_batch and not slot.prefilling:
                self._release(k)
                return k
        self._count("refused_full", 1)
        if not self._warned_full:
            self._warned_full = True
            logger.warning("sparse decode: all %d slots busy; further long requests decode "
                           "densely (raise --sparse-max-requests)", len(self.slots))
        return None

    def _slot_for(self, pool_index: int, n_ret: int, in_batch: dict[int, int]
                  ) -> tuple[int | None, int]:
        """A slot for the request in ``pool_index`` about to decode sparsely with ``n_ret``
        region rows, and how many of them the slot holds encoded already: the slot no decoding
        request holds whose region shares the most leading rows with this request's (module
        doc; its rows past them are dropped), else ``_free_slot``'s with none. A held slot whose
        request is not in this step counts as free, as in ``_free_slot``: without
        ``--sparse-offload`` nothing releases a finished request's slot before its
        request-pool row serves another request (a request absent from a decode step while it
        lives - retracted, say - re-encodes its region when it decodes again)."""
        best, best_rows, best_held = None, 0, 0
        if self.host is None:
            for k, slot in enumerate(self.slots):
                if slot is not None and (slot.pool_index in in_batch or slot.prefilling):
                    continue  # its request is decoding (or prefilling) now
                held = self.kept_rows[k] if slot is None else slot.n_ret
                rows = self._shared_rows(k, pool_index, min(held, n_ret)) if held else 0
                if rows > best_rows:
                    best, best_rows, best_held = k, rows, held
                    if rows == n_ret:  # the whole region: no slot can offer more
                        break
        if best is None:
            return self._free_slot(in_batch), 0
        if self.slots[best] is not None:
            self._release(best)
        if best_held > best_rows:
            for layer in range(len(self.layer_ids)):
                self.ops.truncate(layer, best, best_rows, best_held)
        return best, best_rows

    def _keys_fingerprint(self, locs: torch.Tensor) -> torch.Tensor:
        """``[len(locs), 2 * FINGERPRINT_DIMS]``: first- and last-layer key values of the pool
        slots ``locs`` (KV head 0)."""
        return torch.cat([self.key_buffer(layer_id)[locs, 0, :FINGERPRINT_DIMS]
                          for layer_id in (self.layer_ids[0], self.layer_ids[-1])], -1)

    def _record_fingerprint(self, k: int, start: int, locs: torch.Tensor) -> None:
        """Slot ``k``'s fingerprint of positions ``start ..``, held in pool slots ``locs``."""
        fp = self._keys_fingerprint(locs)
        if self._fingerprint is None or self._fingerprint.dtype != fp.dtype:
            self._fingerprint = torch.zeros(len(self.slots), self.cfg.sink + self.capacity,
                                            fp.shape[1], dtype=fp.dtype, device=fp.device)
        self._fingerprint[k, start:start + len(locs)] = fp

    def _shared_rows(self, k: int, pool_index: int, rows: int) -> int:
        """How many of the first ``rows`` region rows of slot ``k`` the request in
        ``pool_index`` shares, with the sink: positions up to the first whose fingerprint
        differs (exact comparison; one read of the result, a wait for the GPU)."""
        if self._fingerprint is None or rows <= 0:
            return 0
        end = self.cfg.sink + rows
        same = (self._keys_fingerprint(self._positions_to_slots(pool_index, 0, end))
                == self._fingerprint[k, :end]).all(-1)
        # the first position that differs (argmin of a bool: its first False), else all
        first = int(torch.where(same.all(), end, torch.argmin(same.to(torch.int8))))
        return max(0, first - self.cfg.sink)

    def _positions_to_slots(self, pool_index: int, start: int, end: int) -> torch.Tensor:
        return self.req_to_token[pool_index, start:end].long()

    def _encode(self, k: int, pool_index: int, start: int, count: int, offset: int) -> None:
        """Encode positions ``[start, start + count)`` at retrieval rows ``offset..`` (all
        layers); with offload, also move their K/V to host memory and free their pool slots."""
        locs = self._positions_to_slots(pool_index, start, start + count)
        if self.host is None:  # offloaded regions are never reused: no fingerprint
            self._record_fingerprint(k, start, locs)
        for layer, layer_id in enumerate(self.layer_ids):
            keys = self.key_buffer(layer_id)[locs]
            self.ops.encode(layer, k, keys, offset)
            if self.host is not None:
                self.host.store(layer, k, keys, self.value_buffer(layer_id)[locs], offset)
        if self.host is not None:  # enable_offload sets both
            self.pool_release.release(pool_index, start, start + count)
            self._count("offloaded_tokens", count)
        self._count("encoded_tokens", count)

    def _activate(self, k: int, pool_index: int, seq_len: int, reused: int = 0) -> None:
        cfg = self.cfg
        n_ret = seq_len - cfg.sink - cfg.local
        self._take_slot(k, pool_index, n_ret, seq_len - 1, reused)
        logger.info("sparse decode: a request of %d tokens decodes sparsely (slot %d, %d keys "
                    "in its retrieval region, %d of them encoded by an earlier request; %d "
                    "activated so far)", seq_len, k, n_ret, reused, self.stats["activated"])

    def _take_slot(self, k: int, pool_index: int, n_ret: int, seq_len: int,
                   reused: int = 0) -> None:
        """Slot ``k`` for the request in row ``pool_index``: positions ``[sink, sink + n_ret)``
        encoded (and offloaded) but for the first ``reused`` rows, which the slot holds already
        (``_slot_for``), its sink listed; ``seq_len``: the context it has once the batch being
        prepared ran."""
        cfg = self.cfg
        self.kept_rows[k] = 0
        if reused:
            self._count("reused_tokens", reused)
        elif self.host is None:
            self._record_fingerprint(k, 0, self._positions_to_slots(pool_index, 0, cfg.sink))
        if n_ret > reused or not reused:  # (a new region's encode at 0 resets its counts)
            self._encode(k, pool_index, cfg.sink + reused, n_ret - reused, reused)
        self.slots[k] = _Slot(pool_index, self.rid_of_pool.get(pool_index), n_ret, seq_len)
        _put(self.pool_of_slot, k, pool_index)
        # the sink's pool slots never change while the request holds the slot
        self.win_idx[k, : cfg.sink] = self._positions_to_slots(pool_index, 0, cfg.sink)
        self._count("activated", 1)

    def _slide(self, k: int) -> None:
        """Move the window's oldest tokens into the retrieval region, ``update`` at a time,
        until at most ``local + update`` are left (in one encode: after an offloaded prefill the
        window holds the last chunk) or the region is full (the window then grows: attended
        tokens are capped)."""
        cfg, slot = self.cfg, self.slots[k]
        excess = slot.seq_len - cfg.sink - slot.n_ret - (cfg.local + cfg.update)
        if excess <= 0:
            return
        blocks = min(-(-excess // cfg.update), (self.capacity - slot.n_ret) // cfg.update)
        if blocks <= 0:
            return
        count = blocks * cfg.update
        self._encode(k, slot.pool_index, cfg.sink + slot.n_ret, count, slot.n_ret)
        slot.n_ret += count

    def _fill_window(self, k: int, slot: _Slot) -> None:
        """This step's window part of ``win_idx`` (its sink part is written at activation)."""
        cfg = self.cfg
        win_start = cfg.sink + slot.n_ret
        window = self._positions_to_slots(slot.pool_index, win_start, slot.seq_len)
        window = window[-(cfg.local + cfg.update):]  # capped when the region is full
        n = cfg.sink + window.numel()
        self.win_idx[k, cfg.sink : n] = window
        self.win_idx[k, n:] = 0
        _put(self.win_len, k, n)

    def release_finished(self, live_pool_indices: set[int]) -> int:
        """Release the slots whose request row is not in ``live_pool_indices`` (the scheduler's
        running and chunked requests): a request that finished, or was aborted, during its
        offloaded prefill never reaches a decode step, where slots are otherwise reclaimed.
        Returns how many were released."""
        stale = [k for k, slot in enumerate(self.slots)
                 if slot is not None and slot.pool_index not in live_pool_indices]
        for k in stale:
            self._release(k)
        return len(stale)

    def _release(self, k: int) -> None:
        slot = self.slots[k]
        # what the slot's region holds stays valid until another request takes the slot
        self.kept_rows[k] = slot.n_ret if slot is not None and self.host is None else 0
        self.slots[k] = None
        _put(self.n_ret, k, 0)
        _put(self.pool_of_slot, k, 0)
        _put(self.row_of_slot, k, -1)
        _put(self.win_len, k, 0)

    # ---- per layer, graph-safe -----------------------------------------------------------
    def attend(self, layer_id: int, q: torch.Tensor, o: torch.Tensor, scale: float) -> None:
        """Overwrite the sparse rows of ``o`` ``[bs, q_heads, D]`` with sparse attention of
        their queries in ``q`` ``[bs, q_heads, D]``."""
        layer = self.layer_index[layer_id]
        window = None
        if self.host is None:  # the window's part first, beside the selection where it can
            window = self.ops.start_window(q, self.row_of_slot, self.key_buffer(layer_id),
                                           self.value_buffer(layer_id), self.win_idx,
                                           self.win_len, self.req_to_token, self.pool_of_slot,
                                           self.cfg.sink, scale)
        rows = self.ops.select(layer, q, self.row_of_slot, self.n_ret,  # [R, kvh, k]
                               *((self.n_sel, self.shift) if self.interval > 1
                                 else ()))
        self.selected = rows
        if self.host is not None:
            flat = self.win_idx.view(-1)
            for buf, win in ((self.key_buffer(layer_id), self.k_win),
                             (self.value_buffer(layer_id), self.v_win)):
                torch.index_select(buf, 0, flat, out=win.view(-1, *win.shape[2:]))
            self.ops.attend_split(q, self.row_of_slot, self.k_win.permute(0, 2, 1, 3),
                                  self.v_win.permute(0, 2, 1, 3), self.win_len,
                                  self.host.keys(layer), self.host.values(layer), rows, o, scale)
        else:
            self.ops.attend_pool(q, self.row_of_slot, self.key_buffer(layer_id),
                                 self.value_buffer(layer_id), self.win_idx, self.win_len, rows,
                                 self.req_to_token, self.pool_of_slot, self.cfg.sink, o, scale,
                                 window=window)

    def extend_view(self, prefix_lens: list[int], seq_lens: list[int]
                    ) -> tuple[list[int], list[int]] | None:
        """The prefix and sequence lengths the dense extend kernel should see: no prefix for the
        rows of ``prefill_rows`` (their pool positions are partly freed; ``attend_prefill``
        computes them). None when the batch has none."""
        if not self.prefill_rows:
            return None
        prefix_lens, seq_lens = list(prefix_lens), list(seq_lens)
        for row, _, _, extend, _ in self.prefill_rows:
            prefix_lens[row], seq_lens[row] = 0, extend
        return prefix_lens, seq_lens

    def attend_prefill(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, scale: float) -> None:
        """Overwrite the ``prefill_rows`` of the extend output ``o`` ``[tokens, q_heads, D]``:
        exact causal attention of their queries (``q``) over the sink and the resident tail from
        the pool, the retrieval region from host memory, and their own new keys (``k``/``v``
        ``[tokens, kv_heads, D]``)."""
        cfg, layer = self.cfg, self.layer_index[layer_id]
        k_buf, v_buf = self.key_buffer(layer_id), self.value_buffer(layer_id)
        for _, slot_k, prefix, extend, start in self.prefill_rows:
            slot = self.slots[slot_k]
            sink = self._positions_to_slots(slot.pool_index, 0, cfg.sink)
            tail = self._positions_to_slots(slot.pool_index, cfg.sink + slot.n_ret, prefix)
            end = start + extend
            keys = gather_prefix(k_buf, sink, self.host.k[layer, slot_k, : slot.n_ret], tail,
                                 k[start:end])
            values = gather_prefix(v_buf, sink, self.host.v[layer, slot_k, : slot.n_ret], tail,
                                   v[start:end])
            o[start:end] = causal_attention(q[start:end], keys, values, scale).to(o.dtype)

    def warm_up(self) -> None:
        """Run the per-layer sparse path and the encoder once, so their kernels compile at
        start-up and not in the first long request's decode step (a multi-second stall of every
        request batched with it). No slot is active, so nothing is written."""
        dev = self.win_idx.device
        q = torch.zeros(1, self.q_heads, self.d, dtype=self.dtype, device=dev)
        self.attend(self.layer_ids[0], q, q.clone(), 1.0)
        keys = torch.zeros(self.cfg.update, self.kv_heads, self.d, dtype=self.dtype, device=dev)
        self.ops.encode(0, 0, keys, 0)

    # the KV pool, bound by the backend (get_key_buffer / get_value_buffer of SGLang's pool)
    key_buffer = None
    value_buffer = None
