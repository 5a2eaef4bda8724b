"""Copy on reuse: a request that reuses a cached span at another offset reads a copy of the
span's pages with the keys turned to where they now stand (made for it, or shared with the
requests reading the same pages at the same offset).

Why (``--span-copy-on-reuse on``). In the shifted layout (``stored_positions``) a span cached at
one offset and reused at another is read by segmented attention (``segmented_backend``): a batch
holding such a request runs eagerly, off the CUDA graphs, for the request's whole life: its
last piece's prefill and every decode step. Turning the moved keys *once*, into pool slots of the request's
own, makes its row read every key at the position it was computed at: from then on its batches
are vanilla attention (FlashInfer, CUDA graphs). The price is pool memory: one copy of each
moved page per running request instead of one shared copy, and one gather / turn / scatter per
layer at the request's first prefill (a span of ``n`` tokens moves ``2 * n * kv_heads * D``
elements per layer).

How (``MovedPageCopier.prepare``, from the ``ForwardBatch.init_new`` AFTER hook, before the
batch's attention metadata is built):

* at a span request's first extend, the pages of its matched prefix holding a key whose recorded
  position differs from its index in the row are found (one device-to-host read per batch with
  such requests, which waits for the GPU: once per span request's life; then a small read of
  each moved request's source slots and shifts, to key the shared copies);
* when the pool keeps at least ``reserve`` free slots after the copy, that many slots are
  allocated from SGLang's allocator, each page's K is turned by the distance it moved and K/V are
  written there (on the GPU by one kernel launch for all layers,
  ``sglang_pic_kernel.rotating_attention.turn_copy_kv``; torch ops per layer on the CPU), the
  slots' recorded positions are their row indices, and the row points at them; otherwise the request reads the shared pages (``reads_shared_pages`` stays true) and
  each later batch of it tries again (``retry``: the pages are known, no device read);
* SGLang rewrites a row's prefix before each chunk of a chunked prefill, so every extend batch
  points the row at the copies again;
* a turned copy is shared: requests reading the same cached pages moved by the same distance
  (in RAG, a document at the same place in the prompt) read one copy, reference-counted per run
  of pages with one shift; the copied slots record the positions they are read at, which are the
  same for every such request (shift = row index - stored position, the stored positions fixed);
* ``SpanRadixCache.cache_finished_req`` (SGLang 0.5.17) or ``on_release`` (0.5.23), at finish,
  abort or retraction, drops the request's references (``release``) and frees a copy nobody
  reads any more; the shared pages stay in the tree, locked by the request as before.

Shapes: the pool's per-layer K and V buffers are ``[slots, kv_heads, D]``; a request's copy is
``MovedCopy.positions`` / ``slots``, int64 ``[n]`` (whole pages).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from sglang_pic.compat.request_state import matched_len, pool_row

from . import stored_positions
from .key_runs import RUNS_ATTR, runs_from_shifts

logger = logging.getLogger(__name__)

ATTR = "pic_moved_copy"
"""On a span request: ``MovedCopy`` (its moved pages are copied), ``NOTHING_MOVED``, ``Waiting``
(no room yet: it reads the shared pages, and is copied once the pool has room) or ``SHARED``
(its moved keys cannot be copied: it reads the shared pages for its whole life)."""
NOTHING_MOVED = "nothing-moved"
SHARED = "shared"
SEGMENTED_BACKENDS = ("pic_flashinfer", "pic_torch_native")
"""Backends whose batches with moved keys run segmented attention (``segmented_backend``)."""
SUMMARY_EVERY = 64  # copied requests between two summary lines in the log
RESERVE_SHARE = 0.1
"""A copy is made only if this share of the pool stays free after it (room for the running
requests' decode tokens, which SGLang budgets without knowing about copies)."""


@dataclass
class Waiting:
    """A request whose moved pages did not fit yet: ``pages`` (CPU int64, ascending) of its row."""

    pages: torch.Tensor


@dataclass
class MovedCopy:
    positions: torch.Tensor  # int64 [n]: row positions of the copied pages (whole pages)
    slots: torch.Tensor  # int64 [n]: the pool slots of the turned copies the row reads there
    runs: list[tuple[bytes, bytes]]  # keys of the shared copies (``TurnedRun``) it holds


@dataclass
class TurnedRun:
    """A turned copy of a run of moved pages with one shift, shared by the requests reading
    those pages at that shift: ``slots`` int64 [n] on the device, ``readers`` its refcount."""

    slots: torch.Tensor
    readers: int = 0


def turn_keys(keys: torch.Tensor, shift: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Keys ``[n, heads, D]`` rotated (NeoX RoPE) at their stored positions, turned by ``shift``
    ``[n]`` positions (either sign; 0 leaves a key as is). ``cos_sin_cache`` ``[positions, D]``
    is SGLang's (cos | sin halves). Math in float32, the result in ``keys.dtype``."""
    rows = shift.abs().clamp(max=cos_sin_cache.shape[0] - 1)
    cos, sin = cos_sin_cache.index_select(0, rows).float().chunk(2, dim=-1)
    sin = sin * shift.sign().to(sin.dtype)[:, None]  # a turn back is the opposite angle
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = keys.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(keys.dtype)


def reads_shared_pages(req: Any) -> bool:
    """Whether ``req`` (a span request: ``pic_segments`` set) still reads the shared pages of
    the spans it moved: not yet prepared, waiting for room for its copy, or not copyable."""
    state = getattr(req, ATTR, None)
    return state is None or state == SHARED or isinstance(state, Waiting)


def _is_shared(state: Any) -> bool:
    return isinstance(state, str) and state == SHARED


class MovedPageCopier:
    """Makes and frees span requests' copies of their moved pages (see the module docstring).
    One per scheduler process, bound to its KV pool, allocator and RoPE table."""

    def __init__(self, model_runner: Any, rotary: Any, use_kernel: bool | None = None,
                 copies: bool = True):
        self.pool = model_runner.token_to_kv_pool
        self.allocator = model_runner.token_to_kv_pool_allocator
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.cos_sin_cache = rotary.cos_sin_cache.float().contiguous()
        self.page_size = int(getattr(self.allocator, "page_size", 1) or 1)
        first = int(getattr(self.pool, "start_layer", 0) or 0)
        self.layer_ids = range(first, first + int(self.pool.layer_num))
        if use_kernel is None:  # the torch path on CPU (the interpreter would be slower)
            use_kernel = self.pool.get_key_buffer(first).device.type == "cuda"
        self.buffers = self._layer_buffers() if use_kernel else None
        self.reserve = int(RESERVE_SHARE * self.allocator.size)
        self.copies = copies  # False: only find the moved runs (segmented attention reads them)
        self.stats = {"copied_requests": 0, "copied_tokens": 0, "reused_copy_tokens": 0,
                      "shared_requests": 0, "waiting_requests": 0}
        self.runs: dict[tuple[bytes, bytes], TurnedRun] = {}  # (shifts, source slots) -> copy
        # requests in state ``Waiting`` / ``SHARED`` (``_set_state`` keeps the counts): the only
        # prepared requests that read moved keys, known on the CPU for every batch
        self.waiting = 0
        self.shared = 0
        self.counters = None  # sglang_pic.metrics.Counters with --enable-metrics
        self._warned = False

    def _layer_buffers(self) -> Any:
        """The pool's buffers as the one-launch turned-copy kernel reads them, or None (the
        torch path, one gather / turn / scatter per layer) for a layout it cannot address."""
        from sglang_pic_kernel.rotating_attention import LayerBuffers

        try:
            return LayerBuffers([self.pool.get_key_buffer(i) for i in self.layer_ids],
                                [self.pool.get_value_buffer(i) for i in self.layer_ids])
        except ValueError as e:
            logger.info("span copy on reuse: copying with torch ops per layer (%s)", e)
            return None

    def _set_state(self, req: Any, state: Any) -> None:
        """Set ``req``'s state (``ATTR``); every change goes through here, so ``waiting`` and
        ``shared`` count the requests in those states exactly."""
        old = getattr(req, ATTR, None)
        self.waiting += isinstance(state, Waiting) - isinstance(old, Waiting)
        self.shared += _is_shared(state) - _is_shared(old)
        setattr(req, ATTR, state)

    def reads_shared_anywhere(self) -> bool:
        """Whether a request of this process may read moved keys: one waiting for room for its
        copy or not copyable (the request counts, no request is looked at). While none does,
        every batch of the process reads keys where they were computed (FlashInfer and its CUDA
        graphs on ``pic_flashinfer``), span requests included: they read their own turned
        copies. A span request is prepared at its first extend, in the ``init_new`` hook right
        before this is asked (``prepare``), and released only as it leaves the batches for good
        or until its next extend (``release``), so every live one is counted here."""
        return self.waiting > 0 or self.shared > 0

    def _count(self, name: str, n: int = 1) -> None:
        self.stats[name] += n
        if self.counters is not None:
            self.counters.inc(name, n)

    def prepare(self, reqs: list, prefix_lens: list[int] | None) -> None:
        """For an extend batch: copy the moved pages of span requests seen for the first time,
        and point the rows of those already copied at their copies (SGLang rewrote the prefix).
        The batch's new span requests are looked up with one device-to-host read. Requests
        still waiting for room are retried (``retry``)."""
        new: list[tuple[Any, int]] = []
        for i, req in enumerate(reqs):
            if getattr(req, "pic_segments", None) is None:
                continue
            state = getattr(req, ATTR, None)
            if isinstance(state, MovedCopy):
                self.req_to_token[pool_row(req), state.positions] = state.slots.to(
                    self.req_to_token.dtype)
            elif state is None:
                n = prefix_lens[i] if prefix_lens is not None else matched_len(req)
                new.append((req, int(n)))
        if new:
            for (req, n), (pages, host) in zip(new, self._moved_pages(new), strict=True):
                moved = pages is None or pages.numel() > 0
                setattr(req, RUNS_ATTR, runs_from_shifts(host[1], host[0]) if moved and n
                        else None)
                if self.copies:
                    self._set_state(req, self._copy(pool_row(req), pages, host))
                elif moved:
                    self._count("shared_requests")
                    self._set_state(req, SHARED)
                else:
                    self._set_state(req, NOTHING_MOVED)
        self.retry(reqs)

    def retry(self, reqs: list) -> None:
        """Copy the moved pages of the batch's requests that waited for room, if the pool has it
        now (any batch; the pages were found at their first extend, so no device read).

        Called for every decode step: while no request of the process waits (``waiting``, a
        CPU count) it returns without looking at the batch's requests, so a batch without
        spans costs no Python work per request here (at batch 256, ~40 us a step on a 2-core
        machine, on the scheduler thread the overlap scheduler needs for the next step)."""
        if not self.waiting:
            return
        for req in reqs:
            state = getattr(req, ATTR, None)
            if isinstance(state, Waiting) and self._has_room(state.pages.numel() * self.page_size):
                self._set_state(req, self._copy(pool_row(req), state.pages))

    def _has_room(self, count: int) -> bool:
        return self.allocator.available_size() - count >= self.reserve

    def _moved_pages(self, reqs: list[tuple[Any, int]]
                     ) -> list[tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]]:
        """Per request (and its prefix length ``n``): the pages (ascending, CPU int64) of its row's
        first ``n`` slots holding a key stored at another position than its index (None when such
        a key is in a partial last page: never seen, matches are whole pages; not copyable), and
        the row's ``n`` slots and shifts (position minus stored position) on the CPU, which
        ``_copy`` keys its runs by. One device-to-host read for the whole batch: a read per
        request waited for the previous request's copy kernel each time (a RAG batch of 128 new
        span requests: 128 waits on the scheduler thread, one after the other)."""
        table = stored_positions.table()
        page = self.page_size
        flags, rows, shifts = [], [], []
        for req, n in reqs:
            row = self.req_to_token[pool_row(req), :n].long()
            shift = torch.arange(n, device=row.device) - table[row].long()
            moved = shift != 0
            full = n // page * page
            flags.append(moved[:full].view(-1, page).any(dim=1).long())
            flags.append(moved[full:].any().view(1).long())  # the partial page, if any
            rows.append(row)
            shifts.append(shift)
        # the batch's read (it waits for the GPU); slots and shifts fit int32: half the bytes
        cpu = torch.cat(flags + rows + shifts).to(torch.int32).cpu().long()
        k = len(reqs)
        parts = cpu.split([n // page + 1 for _, n in reqs] + [n for _, n in reqs] * 2)
        out = []
        for i in range(k):
            moved_pages, partial = parts[i][:-1], bool(parts[i][-1])
            pages = None if partial else torch.nonzero(moved_pages).flatten()
            out.append((pages, (parts[k + i], parts[2 * k + i])))
        return out

    def _copy(self, pool_index: int, pages: torch.Tensor | None,
              host: tuple[torch.Tensor, torch.Tensor] | None = None) -> MovedCopy | Waiting | str:
        """Copy the row's moved ``pages`` (None: a moved key in a partial page, not copyable);
        ``host``: the row's slots and shifts from the batch's read (``_moved_pages``), else they
        are read here (a request that waited for room, copied at a later batch)."""
        if pages is None:
            self._count("shared_requests")
            return SHARED
        if pages.numel() == 0:
            return NOTHING_MOVED
        row = self.req_to_token[pool_index]
        within = torch.arange(self.page_size)
        positions_cpu = (pages[:, None] * self.page_size + within).flatten()
        positions = positions_cpu.to(row.device)
        table = stored_positions.table()
        if host is not None:
            src_cpu, shift_cpu = host[0][positions_cpu], host[1][positions_cpu]
        else:  # a request that waited for room: its own read
            src = row[positions].long()
            src_cpu, shift_cpu = src.cpu(), (positions - table[src].long()).cpu()
        # runs of one shift, cut at page boundaries (padding starts every piece on a page, so a
        # run is a span); a run's key holds all its shifts and source slots, so a copy is reused
        # only for exactly the same turn of exactly the same slots
        cuts = (torch.nonzero(shift_cpu[1:] != shift_cpu[:-1]).flatten() + 1).tolist()
        bounds = [0, *(c for c in cuts if c % self.page_size == 0), positions.numel()]
        keys: list[tuple[bytes, bytes]] = []
        missing: dict[tuple[bytes, bytes], tuple[int, int]] = {}  # run key -> (start, end)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            key = (shift_cpu[a:b].numpy().tobytes(), src_cpu[a:b].numpy().tobytes())
            keys.append(key)
            if key not in self.runs:
                missing.setdefault(key, (a, b))
        count = sum(b - a for a, b in missing.values())
        slots = None
        if count:
            slots = self.allocator.alloc(count) if self._has_room(count) else None
            if slots is None:
                self._count("waiting_requests")
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "span copy on reuse: the pool is too full to copy %d moved tokens (%d "
                        "free, %d kept free); such requests read the shared pages (segmented "
                        "attention) until it has room", count,
                        self.allocator.available_size(), self.reserve)
                return Waiting(pages)
            slots = slots.to(device=row.device, dtype=torch.int64)
            take = torch.cat([torch.arange(a, b) for a, b in missing.values()])
            self._turn_copy(src_cpu[take].to(row.device), slots, shift_cpu[take].to(row.device))
            table[slots] = positions_cpu[take].to(table.device, table.dtype)
            at = 0
            for key, (a, b) in missing.items():
                self.runs[key] = TurnedRun(slots[at : at + b - a])
                at += b - a
        for key in keys:
            self.runs[key].readers += 1
        own = torch.cat([self.runs[key].slots for key in keys])
        row[positions] = own.to(row.dtype)
        self._count("copied_requests")
        self._count("copied_tokens", count)
        self._count("reused_copy_tokens", positions.numel() - count)
        if self.stats["copied_requests"] % SUMMARY_EVERY == 0:  # readable without --enable-metrics
            logger.info("span copy on reuse so far: %s, %d shared copies live",
                        ", ".join(f"{k} {v}" for k, v in self.stats.items()), len(self.runs))
        logger.debug("span copy on reuse: %d moved tokens of pool row %d, %d copied now",
                     positions.numel(), pool_index, count)
        return MovedCopy(positions, own, keys)

    def _turn_copy(self, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor) -> None:
        """Every layer: K[dst] = K[src] turned by ``shift``, V[dst] = V[src]."""
        if self.buffers is not None:
            from sglang_pic_kernel.rotating_attention import turn_copy_kv

            turn_copy_kv(self.buffers, src, dst, shift, self.cos_sin_cache)
            return
        for layer_id in self.layer_ids:
            k_buf = self.pool.get_key_buffer(layer_id)
            v_buf = self.pool.get_value_buffer(layer_id)
            k_buf[dst] = turn_keys(k_buf[src], shift, self.cos_sin_cache)
            v_buf[dst] = v_buf[src]

    def release(self, req: Any) -> None:
        """Drop ``req``'s references to its turned copies (its row is being released: finished,
        aborted or retracted), freeing those nobody reads any more, and forget its state, so a
        retracted request is prepared again when it is resumed."""
        state = getattr(req, ATTR, None)
        if isinstance(state, MovedCopy):
            for key in state.runs:
                run = self.runs[key]
                run.readers -= 1
                if run.readers == 0:
                    del self.runs[key]
                    self.allocator.free(run.slots)
        if state is not None:
            self._set_state(req, None)


_copier: MovedPageCopier | None = None


def wanted(model_runner: Any) -> bool:
    """Whether this scheduler process needs a copier: with the span radix cache, on
    ``pic_flashinfer`` and ``pic_torch_native`` (whose segmented attention reads the runs the
    copier finds, ``key_runs``) or with ``--span-copy-on-reuse on``."""
    args = model_runner.server_args
    if getattr(args, "radix_cache_backend", None) != "pic_span":
        return False
    return copies_pages(model_runner) or args.attention_backend in SEGMENTED_BACKENDS


def copies_pages(model_runner: Any) -> bool:
    """``--span-copy-on-reuse on``; ``auto`` (the default) and ``off`` read moved spans from the
    shared pages with segmented attention, which holds a span's KV once whatever its offsets."""
    from sglang_pic.launcher.server_flags import setting

    return setting("--span-copy-on-reuse") == "on"


def start(model_runner: Any, counters: Any = None) -> MovedPageCopier:
    """Create the process's copier (``wanted`` said yes); ``counters``: ``sglang_pic.metrics``
    counters with the keys of ``MovedPageCopier.stats``, or None."""
    from .model_check import model_rotary

    global _copier
    copies = copies_pages(model_runner)
    _copier = MovedPageCopier(model_runner, model_rotary(model_runner), copies=copies)
    _copier.counters = counters
    if copies:
        logger.info("span copy on reuse: requests reading a cached span at another offset get "
                    "a turned copy of its pages (while %d pool slots stay free)",
                    _copier.reserve)
    return _copier


def copier() -> MovedPageCopier | None:
    return _copier

