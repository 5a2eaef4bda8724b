"""`SpanPlanner`: prefill a request's uncached spans as internal sub-requests, then run it.

A request with a span layout can only run once every segment but its last is in the cache:
otherwise SGLang's extend would compute an independent span attending to what precedes it. The
planner lives in the scheduler process (one per ``SpanRadixCache``) and, when such a request
arrives:

1. looks each non-final segment up; a cached one is *pinned* (its node locked for this request, so
   eviction cannot take it before the request is admitted);
2. turns each missing one into a **unit**: an internal request (rid ``pic-span-*``, prefill only:
   ``max_new_tokens`` 0, never streamed to the client) whose prompt is the span alone
   (independent: computed as if it stood alone, at positions 0..L-1; with position-free keys its
   pages are valid at any offset) or the prompt up to that segment (dependent: it attends to
   everything before it);
   units are shared: concurrent requests that need the same uncached span wait on one unit;
3. holds the request until its units are cached, then puts it in SGLang's waiting queue, where
   ``SpanRadixCache.match_prefix`` finds every segment and only the final piece is computed; with
   the overlap scheduler, already when the batch that completes its last unit was launched
   (``release_launched_units``), so it joins the next batch formed.

Scheduling (``--span-schedule``): ``isps`` (interleaved span-prefill scheduling) releases a request
as soon as its own units are done, and units enter the waiting queue like any request, so span
prefills batch together with other prefills and alternate with running decodes; ``ready-first``
is ``isps`` where a batch formed while released requests and units both wait takes the released
ones alone (``defer_units``); ``barrier`` holds every final prompt until no unit is pending at
all (prefill all spans, then all questions).

Cancellation: a unit runs only for the held requests waiting on it. When the last of them is
aborted (SGLang aborts a request whose client disconnected), the unit is aborted too, and so on down
the units that unit waited for, so a disconnected client leaves no span prefill running.

Pins are released when the request finishes, or is aborted before it ran. Pinned pages cannot be
evicted, so the planner bounds them: while pinned plus in-flight span tokens exceed
``MAX_PINNED_FRACTION`` of the KV pool and some request is already held, new requests wait in a
FIFO backlog (unplanned, pinning nothing) until running requests finish; otherwise a burst whose
spans outgrow the pool would pin it full and leave no room for the prefills it waits for.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import uuid
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sglang_pic.compat.radix_api import keep_running_request, matched_tokens
from sglang_pic.compat.request_state import extend_end, pool_row

from .config import SpanConfig
from .load import SpanLoad
from .request import LAYOUT_KEY, UNIT_RID_PREFIX
from .segments import Segment, SpanError, build_segments, decode_pieces

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from .radix_cache import SpanRadixCache

logger = logging.getLogger(__name__)

UNIT_TAIL_FRACTION = 8
"""Span prefills leave no last chunk under ``chunked_prefill_size // UNIT_TAIL_FRACTION`` tokens
(``unit_chunk_budget``)."""

MAX_PINNED_FRACTION = 0.5
"""Share of the KV pool that pinned spans plus pending span prefills may take before new requests
wait in the backlog."""

# SamplingParams fields reset for a unit: no output token, no constraints. ``max_new_tokens`` 0
# makes it one of SGLang's prefill-only requests: it finishes with its prefill, and a batch of
# units only is ``is_prefill_only``, which the overlap scheduler never follows with a decode step.
# With 1 (one throw-away token), the step after a unit's last prefill chunk was a decode of the
# unit alone (the scheduler learns that it finished only after launching the next batch), and
# the request waiting on it ran behind that decode: a forward pass on every cold span prompt.
_UNIT_SAMPLING = {
    "max_new_tokens": 0,
    "min_new_tokens": 0,
    "custom_params": None,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "n": 1,
}


def base_namespace(req: Any) -> str | None:
    """The radix namespace a request's spans start from: its ``extra_key`` (a LoRA adapter or
    the like: requests that must not share KV), with its ``cache_salt`` folded in where the
    release keeps the salt apart (SGLang 0.5.23's ``RadixKey.cache_salt``; 0.5.17 folds it into
    ``extra_key`` itself). Requests with different salts never share span pages."""
    extra, salt = getattr(req, "extra_key", None), getattr(req, "cache_salt", None)
    return f"{extra or ''}\x1fpic-salt:{salt}" if salt else extra


@dataclass
class Unit:
    """One missing segment being prefilled by an internal request."""

    key: str
    rid: str
    segments: list[Segment] | None  # None: a plain prompt (span alone, or the leading piece)
    tokens: int = 0
    waiters: list[str] = field(default_factory=list)


@dataclass
class Held:
    """A request (final prompt or dependent unit) waiting for units; its pins are separate."""

    req: Req
    pending: set[str]
    unit_tokens: int = 0
    """Tokens its units compute: not counted as cached tokens when the request is admitted."""


def is_unit(req: Any) -> bool:
    return str(getattr(req, "rid", "")).startswith(UNIT_RID_PREFIX)


class SpanPlanner:
    def __init__(self, cache: SpanRadixCache, cfg: SpanConfig):
        self.cache = cache
        self.cfg = cfg
        self.scheduler: Any = None
        self._enqueue: Callable[..., Any] | None = None
        self._handle: Callable[..., Any] | None = None
        self._expected: dict[str, Any] = {}
        self.units: dict[str, Unit] = {}
        self.unit_by_rid: dict[str, Unit] = {}
        self.held: dict[str, Held] = {}
        self.pins: dict[str, tuple[Req, list[tuple[Any, int]]]] = {}
        self.pinned_tokens = 0
        self._pin_count: dict[int, int] = {}
        self.backlog: deque[tuple[Req, Any]] = deque()
        self._draining = False
        pool = getattr(cache, "token_to_kv_pool_allocator", None)
        self.pin_budget = int(MAX_PINNED_FRACTION * getattr(pool, "size", 0)) or (1 << 62)
        self._unsaved: dict[str, tuple[Any, int]] = {}
        """Units finished early (``release_launched_units``) whose pages go to PTStore once their
        batch's result is in: rid -> (namespace, start)."""
        self._deferred = False  # the last prefill batch was formed without the units
        self.units_submitted = 0
        """Units this planner ever handed to the scheduler: while none, no output the scheduler
        streams can be a unit's, and ``spans._hide_span_prefills`` looks at no request."""

    # ---- scheduler hooks ------------------------------------------------------------------
    def on_generate_request(self, handle: Callable, scheduler: Any, recv_req: Any) -> Any:
        """AROUND ``Scheduler.handle_generate_request``: remember the request for the queue hook."""
        self.scheduler, self._handle = scheduler, handle
        custom = getattr(recv_req.sampling_params, "custom_params", None) or {}
        if LAYOUT_KEY in custom:
            # kept until the request reaches the queue hook (structured-output requests get there
            # later, from SGLang's grammar queue); dropped there or when the request is aborted
            self._expected[recv_req.rid] = recv_req
        return handle(scheduler, recv_req)

    def on_add_to_queue(self, enqueue: Callable, scheduler: Any, req: Req, *args, **kwargs) -> Any:
        """AROUND ``Scheduler._add_request_to_queue``: hold requests whose segments are missing."""
        self.scheduler, self._enqueue = scheduler, enqueue
        retracted = kwargs.get("is_retracted", args[0] if args else False)
        if not retracted and self._intercept(req):
            return None
        return enqueue(scheduler, req, *args, **kwargs)

    def on_abort(self, scheduler: Any, recv_req: Any) -> None:
        """AFTER ``Scheduler.abort_request``: drop held requests, free pins of never-run ones."""
        from sglang.srt.managers.io_struct import AbortReq

        def matches(rid: str) -> bool:
            return recv_req.abort_all or (bool(recv_req.rid) and rid.startswith(recv_req.rid))

        for rid in [r for r in self._expected if matches(r)]:
            del self._expected[rid]
        for rid in [r for r in self.held if matches(r)]:
            held = self.held.pop(rid)
            if not is_unit(held.req):  # a unit has no client to answer
                scheduler.ipc_channels.send_to_tokenizer.send_output(AbortReq(rid=rid), held.req)
            self._unpin(rid)
        for req, recv in [b for b in self.backlog if matches(b[0].rid)]:
            self.backlog.remove((req, recv))
            scheduler.ipc_channels.send_to_tokenizer.send_output(AbortReq(rid=req.rid), req)
        for rid, (req, _) in list(self.pins.items()):
            if matches(rid) and pool_row(req) is None and rid not in self.held:
                self._unpin(rid)
        if recv_req.abort_all:
            for unit in list(self.units.values()):
                self._finish_unit(unit, failed="aborted")
        else:
            self._cancel_unneeded_units(scheduler)

    def _cancel_unneeded_units(self, scheduler: Any) -> None:
        """Abort every unit that no held request waits for any more.

        Each abort goes through ``Scheduler.abort_request`` (SGLang drops the unit from its waiting
        queue, its chunked prefill or its batch) and so back through ``on_abort``, which cancels the
        units a held dependent unit was itself waiting for.
        """
        from sglang.srt.managers.io_struct import AbortReq

        unneeded = [
            u for u in self.units.values() if not any(w in self.held for w in u.waiters)
        ]
        if not unneeded:
            return
        logger.info("cancelling %d span prefill(s) no request waits for", len(unneeded))
        for unit in unneeded:
            if self.units.get(unit.key) is not unit:
                continue  # cancelled by an earlier abort of this loop
            del self.units[unit.key]
            self.unit_by_rid.pop(unit.rid, None)
            scheduler.abort_request(AbortReq(rid=unit.rid))
        # fewer units: a barrier may have lifted, and the backlog may fit the pin budget now
        for rid in list(self.held):
            self._try_release(rid)
        self._drain_backlog()

    def waiting_load(self) -> SpanLoad:
        """The requests this planner holds outside SGLang's queues (``spans/load.py``)."""
        requests = tokens = uncached = 0
        for held in self.held.values():
            n = len(held.req.origin_input_ids)
            requests, tokens = requests + 1, tokens + n
            uncached += max(0, n - held.req.pic_segments[-1].start)
        for req, _ in self.backlog:
            n = len(req.origin_input_ids)
            requests, tokens, uncached = requests + 1, tokens + n, uncached + n
        return SpanLoad(requests, tokens, uncached)

    # ---- planning -------------------------------------------------------------------------
    def _intercept(self, req: Req) -> bool:
        """True when the planner keeps ``req`` (held until its units are cached)."""
        unit = self.unit_by_rid.get(req.rid)
        if unit is not None:
            if _ending(req):
                self._finish_unit(unit, failed=_abort_message(req))
                return False
            if unit.segments is None:
                return False
            req.pic_segments = unit.segments
            return self._plan(req, unit.segments)
        recv = self._expected.pop(req.rid, None)
        if recv is None or _ending(req):
            return False
        if self.held and self._load() > self.pin_budget:
            self.backlog.append((req, recv))
            return True
        return self._plan_request(req, recv)

    def _load(self) -> int:
        return self.pinned_tokens + sum(u.tokens for u in self.units.values())

    def _drain_backlog(self) -> None:
        if self._draining:
            return
        self._draining = True
        try:
            while self.backlog and (not self.held or self._load() <= self.pin_budget):
                req, recv = self.backlog.popleft()
                if not self._plan_request(req, recv):
                    self._enqueue(self.scheduler, req)
        finally:
            self._draining = False

    def _plan_request(self, req: Req, recv: Any) -> bool:
        """Build the request's segments and plan them; False: enqueue it now."""
        try:
            pieces = decode_pieces(recv.sampling_params.custom_params[LAYOUT_KEY])
            if pieces[-1].end != len(req.origin_input_ids):
                raise SpanError("span layout does not match the prompt length")
            if any(p.start % self.cache.page_size for p in pieces):
                raise SpanError("span layout is not page-aligned for this server")
            if pieces[-1].independent:
                raise SpanError("span layout ends with an independent span")
        except SpanError as e:
            req.set_finish_with_abort(str(e))
            return False
        req.pic_segments = build_segments(
            req.origin_input_ids,
            pieces,
            base_namespace(req),
            page_size=self.cache.page_size,
            recompute_tokens=self.cfg.recompute_tokens,
        )
        self._template = recv
        return self._plan(req, req.pic_segments)

    def _plan(self, req: Req, segments: list[Segment]) -> bool:
        ids = req.origin_input_ids
        pending: set[str] = set()
        unit_tokens = 0
        pins: list[tuple[Any, int]] = []
        req.pic_store_tokens = 0
        for i, seg in enumerate(segments[:-1]):
            key = _unit_key(ids, seg)
            unit = self.units.get(key)
            if unit is None:
                node = self._cached_node(ids, seg.namespace, seg.key_start, seg.key_end)
                if node is None and self._load_from_store(ids, seg):
                    node = self._cached_node(ids, seg.namespace, seg.key_start, seg.key_end)
                    if node is not None:
                        req.pic_store_tokens += seg.key_end - seg.key_start
                if node is not None:
                    self._pin(pins, node, seg.key_end - seg.key_start)
                    continue
                unit = self._submit_unit(key, ids, seg, segments[: i + 1])
                if unit is None:  # the unit request was rejected; so is this request
                    self._release_pins(pins)
                    req.set_finish_with_abort("span prefill was rejected (see the server log)")
                    return False
            unit.waiters.append(req.rid)
            pending.add(key)
            unit_tokens += unit.tokens
        self.pins[req.rid] = (req, pins)
        if not pending and not self._barrier_blocks(req):
            return False  # everything is cached: the caller enqueues it now
        self.held[req.rid] = Held(req, pending, unit_tokens)
        return True

    def _barrier_blocks(self, req: Req) -> bool:
        return self.cfg.schedule == "barrier" and bool(self.units) and not is_unit(req)

    def _load_from_store(self, ids: Any, seg: Segment) -> bool:
        """Whether the segment's missing pages came in from PTStore (``store_tier.py``)."""
        store = self.cache.store
        # an independent span was computed alone (from position 0), a dependent piece in place
        first_position = 0 if seg.independent else seg.key_start
        if store is None or not store.load(ids, seg.namespace, seg.key_start, seg.key_end,
                                           first_position):
            return False
        logger.info("span store: loaded a %d-token segment", seg.key_end - seg.key_start)
        return True

    def _cached_node(self, ids: Any, namespace: str | None, start: int, end: int) -> Any:
        """The node ending key ``ids[start:end]`` in ``namespace`` if all of it is cached."""
        result = RadixCache.match_prefix(
            self.cache, MatchPrefixParams(key=RadixKey(ids[start:end], namespace))
        )
        return result.last_device_node if matched_tokens(result) == end - start else None

    def _submit_unit(
        self, key: str, ids: Any, seg: Segment, prefix_segments: list[Segment]
    ) -> Unit | None:
        plain = seg.independent or (seg.key_start == 0 and len(prefix_segments) == 1)
        if plain:
            tokens, segments = ids[seg.key_start : seg.key_end], None
        else:
            tokens = ids[: seg.end]
            last = prefix_segments[-1]
            segments = [
                *prefix_segments[:-1],
                Segment(last.start, None, last.namespace, last.key_start, None, False),
            ]
        unit = Unit(
            key, f"{UNIT_RID_PREFIX}{uuid.uuid4().hex}", segments, seg.key_end - seg.key_start
        )
        self.units[key] = unit
        self.units_submitted += 1
        self.unit_by_rid[unit.rid] = unit
        recv = copy.copy(self._template)
        recv.rid = unit.rid
        # the unit's pages go under the client's span namespace, its salt included (SGLang
        # 0.5.23 keys a salt apart from the namespace; the span lookups key by namespace only)
        recv.extra_key = base_namespace(self._template)
        if hasattr(recv, "cache_salt"):
            recv.cache_salt = None
        recv.input_ids = array("q", tokens)
        recv.input_text = None
        recv.sampling_params = _unit_sampling(recv.sampling_params)
        for name, value in (
            ("return_logprob", False),
            ("logprob_start_len", -1),
            ("top_logprobs_num", 0),
            ("token_ids_logprob", None),
            ("stream", False),
            ("return_hidden_states", False),
            ("session_params", None),
            ("session_id", None),
            ("custom_logit_processor", None),
            ("priority", None),
        ):
            if hasattr(recv, name):
                setattr(recv, name, value)
        self._handle(self.scheduler, recv)
        return self.units.get(key)

    # ---- batching ---------------------------------------------------------------------------
    def unit_chunk_budget(self, scheduler: Any) -> int | None:
        """The chunk budget for the prefill batch about to be formed, when only span prefills
        wait and they fit it with a small overshoot; else None (SGLang's own budget).

        A cold span prompt (system prompt S, document D, question Q) runs the units for S and D,
        then Q. With S + D just over ``chunked_prefill_size`` C (an 8K document behind a short
        system prompt on the H200, C = 8192), SGLang would prefill the units in two passes, the
        second of only the last few hundred tokens, and Q in a third; vanilla SGLang prefills
        S + D + Q in two. When every waiting request is a unit (no other request's batching
        changes) and their prompts together exceed C by at most C / ``UNIT_TAIL_FRACTION``
        (and fit ``max_prefill_tokens``), this pass takes them whole: Q follows in the next
        pass, as in vanilla. The KV pool check (``PrefillAdder``) is SGLang's as always."""
        size = getattr(scheduler, "chunked_prefill_size", None)
        queue = getattr(scheduler, "waiting_queue", None)
        if not size or size <= 0 or not queue or getattr(scheduler, "chunked_req", None):
            return None
        if not all(req.rid in self.unit_by_rid for req in queue):
            return None
        total = sum(len(req.origin_input_ids) for req in queue)
        page = self.cache.page_size
        budget = -(-total // page) * page
        if size < total <= size + size // UNIT_TAIL_FRACTION \
                and budget <= getattr(scheduler, "max_prefill_tokens", budget):
            return budget
        return None

    def defer_units(self, scheduler: Any) -> list | None:
        """With ``--span-schedule ready-first``, before SGLang forms a prefill batch: when the
        waiting queue holds both span prefills (units) and requests whose spans are all cached
        (their questions), take the units out of the queue so that this batch runs the ready
        requests without them; returns the units (``restore_units`` puts them back at the
        front), or None.

        Why: under ``isps`` a question released while another request's units wait joins the
        same batch, and its first token waits for their prefill (a 64-token question after
        cached documents takes ~20 ms alone on an H100, beside a 900-token document over 40).
        Running the short ready work first is shortest-job-first: the units start one short
        batch later. Never twice in a row, so a stream of cached questions cannot starve them."""
        if self.cfg.schedule != "ready-first":
            return None
        if self._deferred:
            self._deferred = False
            return None
        units, rest = [], []
        for req in getattr(scheduler, "waiting_queue", None) or ():
            (units if req.rid in self.unit_by_rid else rest).append(req)
        if not units or all(getattr(r, "pic_segments", None) is None for r in rest):
            return None
        scheduler.waiting_queue = rest
        self._deferred = True
        return units

    @staticmethod
    def restore_units(scheduler: Any, units: list) -> None:
        """Put ``defer_units``' units back at the front of the waiting queue (SGLang replaced
        the queue with the requests its batch did not take)."""
        scheduler.waiting_queue = [*units, *scheduler.waiting_queue]

    # ---- completion -----------------------------------------------------------------------
    def release_launched_units(self, scheduler: Any) -> None:
        """Before SGLang forms a prefill batch (AROUND ``Scheduler.get_new_batch_prefill``):
        finish the units whose prefill the previous batch ran to its end, so that the requests
        waiting on them can join this batch.

        SGLang's overlap scheduler forms a batch before it processes the previous one's result,
        and a unit finishes (``on_request_cached``) only with that result: a request released
        there joins the waiting queue after this batch was formed, so it ran one scheduler
        step later, after an idle GPU gap (the result's processing, then the next step's
        scheduling and launch). Here the unit's pages go into the radix tree the way SGLang
        stashes a chunked request's pages between chunks (``cache_unfinished_req``, before the
        chunk's result): the batch being formed runs after the unit's on the device, so it reads
        them computed. The unit's own result later finishes it as usual (its pages found there,
        no duplicates to free). Its pages go to PTStore only then (``_unsaved``): a copy made
        now could read them before they are computed. Without the overlap scheduler the
        previous batch's result is processed before this, and nothing is left to do here."""
        last = getattr(scheduler, "last_batch", None)
        if not self.units or last is None or not last.forward_mode.is_extend():
            return
        continuing = (getattr(scheduler, "chunked_req", None), getattr(last, "chunked_req", None))
        for req in list(last.reqs):
            unit = self.unit_by_rid.get(req.rid)
            if (unit is None or any(req is c for c in continuing) or _ending(req)
                    or pool_row(req) is None or getattr(req, "is_retracted", False)
                    or (extend_end(req) or 0) < len(req.origin_input_ids)):
                continue
            keep_running_request(self.cache, req)
            self._finish_unit(unit, req=req, early=True)

    def on_request_cached(self, req: Req) -> None:
        """Called by SpanRadixCache after a request's KV went into the tree (or was dropped)."""
        if not _ending(req):
            return  # retracted or paused: it comes back through the queue, pins and all
        unit = self.unit_by_rid.get(req.rid)
        if unit is not None:
            failed = _abort_message(req) if _is_abort(req) else None
            self._finish_unit(unit, failed=failed, req=req)
        unsaved = self._unsaved.pop(req.rid, None)
        if unsaved is not None and not _is_abort(req):
            namespace, start = unsaved
            ids = req.origin_input_ids
            self.cache.store.save(ids, namespace, start, len(ids))
        if req.rid in self.pins:
            self._unpin(req.rid)

    def _finish_unit(self, unit: Unit, failed: str | None = None, req: Req | None = None,
                     early: bool = False) -> None:
        """The unit is done (``failed``: it failed); ``early``: its prefill was launched but its
        result is not in yet (``release_launched_units``): unless its pages are found in the
        cache, nothing is done (its result decides)."""
        if self.units.get(unit.key) is not unit:
            return
        node = None
        if failed is None and req is not None:
            # a plain unit is keyed from its first token in the request's namespace; a dependent
            # one by its last segment
            last = unit.segments[-1] if unit.segments else None
            namespace, start = (last.namespace, last.key_start) if last else (req.extra_key, 0)
            ids = req.origin_input_ids
            node = self._cached_node(ids, namespace, start, len(ids))
            if node is None:
                if early:
                    return
                failed = "span prefill finished but its pages are not in the cache"
            elif self.cache.store is not None:
                if early:
                    self._unsaved[req.rid] = (namespace, start)
                else:
                    self.cache.store.save(ids, namespace, start, len(ids))
        del self.units[unit.key]
        self.unit_by_rid.pop(unit.rid, None)
        for rid in unit.waiters:
            held = self.held.get(rid)
            if held is None:
                continue
            if failed is not None:
                self._fail(rid, f"span prefill failed: {failed}")
                continue
            self._pin(self.pins[rid][1], node, unit.tokens)
            held.pending.discard(unit.key)
        for rid in list(self.held):
            self._try_release(rid)
        self._drain_backlog()

    def _try_release(self, rid: str) -> None:
        held = self.held.get(rid)
        if held is None or held.pending or self._barrier_blocks(held.req):
            return
        del self.held[rid]
        # SGLang adds the matched prefix length at admission (ScheduleBatch.prepare_for_extend);
        # what our own span prefills computed a moment ago was not a cache hit for this request.
        held.req.cached_tokens -= held.unit_tokens
        self._enqueue(self.scheduler, held.req)

    def _fail(self, rid: str, message: str) -> None:
        held = self.held.pop(rid, None)
        self._unpin(rid)
        if held is None:
            return
        unit = self.unit_by_rid.get(rid)
        if unit is not None:
            self._finish_unit(unit, failed=message)
        held.req.set_finish_with_abort(message)
        self._enqueue(self.scheduler, held.req)

    def _pin(self, pins: list[tuple[Any, int]], node: Any, tokens: int) -> None:
        """Lock ``node`` for a held request; ``pinned_tokens`` counts each pinned node once."""
        self.cache.inc_lock_ref(node)
        pins.append((node, tokens))
        count = self._pin_count.get(id(node), 0)
        self._pin_count[id(node)] = count + 1
        if count == 0:
            self.pinned_tokens += tokens

    def _unpin(self, rid: str) -> None:
        _, pins = self.pins.pop(rid, (None, []))
        self._release_pins(pins)
        self._drain_backlog()

    def _release_pins(self, pins: list[tuple[Any, int]]) -> None:
        for node, tokens in pins:
            self.cache.dec_lock_ref(node)
            count = self._pin_count.pop(id(node)) - 1
            if count:
                self._pin_count[id(node)] = count
            else:
                self.pinned_tokens -= tokens


def _unit_key(ids: Any, seg: Segment) -> str:
    h = hashlib.blake2b(array("q", ids[seg.key_start : seg.key_end]).tobytes(), digest_size=16)
    return f"{seg.namespace or ''}\x1f{h.hexdigest()}"


def _unit_sampling(params: Any) -> Any:
    names = {f.name for f in msgspec.structs.fields(params)}
    return msgspec.structs.replace(
        params, **{k: v for k, v in _UNIT_SAMPLING.items() if k in names}
    )


def _ending(req: Req) -> bool:
    """Finished, or marked to finish (SGLang's ``set_finish_with_abort`` / OOM abort set only
    ``to_finish``; such a request leaves the batch without coming back)."""
    return req.finished() or getattr(req, "to_finish", None) is not None


def _reason(req: Req) -> Any:
    return getattr(req, "finished_reason", None) or getattr(req, "to_finish", None)


def _is_abort(req: Req) -> bool:
    return type(_reason(req)).__name__ == "FINISH_ABORT"


def _abort_message(req: Req) -> str:
    return getattr(_reason(req), "message", None) or "aborted"


def cached_tokens_details(req: Req, with_storage: bool) -> dict[str, int] | None:
    """``meta_info.cached_tokens_details`` of a span request, consistent with ``cached_tokens``.

    SGLang derives ``device`` from the prefix matched at admission, which for a span request
    includes the pages its own span sub-requests computed a moment before; ``cached_tokens`` does
    not (see ``_try_release``). Here the details split ``cached_tokens`` itself: ``storage`` is
    what the planner loaded from PTStore for this request, ``device`` the rest; nothing is in
    HiCache's host tier (the span cache does not run with HiCache). None when nothing was cached,
    as SGLang answers.
    """
    cached = max(0, int(getattr(req, "cached_tokens", 0)))
    if cached == 0:
        return None
    storage = min(cached, int(getattr(req, "pic_store_tokens", 0)))
    details = {"device": cached - storage, "host": 0}
    if with_storage or storage:
        details["storage"] = storage
    return details
