"""How span prefills (the planner's unit requests) are scheduled, without a model.

A cold span prompt waits on its units; the scheduler passes that follow a unit's prefill are
on that prompt's critical path (``docs/spans.md``, "Scheduling"). These tests pin what SGLang
makes of a unit request, as the planner submits it.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

PAGE = 4


def _submitted_unit():
    """The request the planner hands to ``Scheduler.handle_generate_request`` for a missing
    independent span of a client request with ordinary sampling parameters."""
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang_pic.spans import config as span_config
    from sglang_pic.spans.planner import SpanPlanner
    from sglang_pic.spans.segments import Segment

    handled: list = []
    planner = SpanPlanner(SimpleNamespace(page_size=PAGE), span_config.load())
    planner.scheduler, planner._handle = None, lambda scheduler, recv: handled.append(recv)
    client = SamplingParams(max_new_tokens=64, temperature=0.7)
    client.normalize(None)  # as SGLang's tokenizer manager hands a request to the scheduler
    client.min_new_tokens = 8
    planner._template = SimpleNamespace(rid="client", input_ids=None, input_text=None,
                                        sampling_params=client, return_logprob=True, stream=True)
    span = Segment(4, 8, None, 4, 8, True)
    planner._submit_unit("key", [1, 2, 3, 4, 5, 6, 7, 8], span, [span])
    (recv,) = handled
    assert client.max_new_tokens == 64  # the client's parameters are left as they were
    return recv


@pytest.mark.capability("spans")
def test_a_span_prefill_is_a_prefill_only_request(monkeypatch):
    """A unit asks for no output token: SGLang then takes it as a prefill-only request, which
    finishes with its prefill, and a batch of units only is prefill-only, which the overlap
    scheduler never follows with a decode step (``Scheduler.get_next_batch_to_run``). With one
    throw-away token, the step after a unit's last chunk was a decode of the unit alone, run
    before the request waiting on it could start: one more forward pass per cold span prompt
    (a bs-1 decode, ~6 ms on an H200 for an 8B model)."""
    from sglang.srt.managers import schedule_batch

    # a server without speculative decoding (the span cache refuses it), as SGLang's runtime
    # context would say in a scheduler process
    monkeypatch.setattr(schedule_batch, "get_spec",
                        lambda: SimpleNamespace(speculative_algorithm=None))
    recv = _submitted_unit()
    params = recv.sampling_params
    assert params.max_new_tokens == 0 and params.min_new_tokens == 0
    assert recv.return_logprob is False and recv.stream is False
    params.verify(vocab_size=1000)  # SGLang accepts it as it is
    unit = schedule_batch.Req(recv.rid, None, array("q", recv.input_ids), params)
    assert unit.is_prefill_only
    # the prefill's dummy token (what a prefill-only batch samples) finishes it by length
    unit.output_ids.append(0)
    unit.update_finish_state()
    assert unit.finished() and unit.finished_len == 0
    assert list(unit.output_ids_through_stop) == []  # no KV beyond the prompt is kept


class _Cache:
    """The planner's view of the span radix cache: which unit prompts hold pages, what was
    stashed (``cache_unfinished_req``) and what went to PTStore."""

    page_size = PAGE

    def __init__(self) -> None:
        self.cached: set[tuple[int, ...]] = set()
        self.stashed: list = []
        self.saved: list = []
        self.locks = 0
        self.store = SimpleNamespace(load=lambda *args: False,
                                     save=lambda ids, ns, start, end: self.saved.append(
                                         tuple(ids[start:end])))

    def cache_unfinished_req(self, req, chunked=False):  # SGLang 0.5.17
        self.stashed.append(req.rid)
        self.cached.add(tuple(req.origin_input_ids))

    def checkpoint(self, req, *, up_to):  # SGLang 0.5.23
        assert up_to == len(req.origin_input_ids)
        self.cache_unfinished_req(req, chunked=True)

    def inc_lock_ref(self, node):
        self.locks += 1

    def dec_lock_ref(self, node, params=None):
        self.locks -= 1


def _waiting_request(monkeypatch):
    """A planner holding a client request whose one span (tokens 4-7) is not cached: the unit
    it submitted and its stand-in as SGLang's scheduler holds it."""
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang_pic.spans import config as span_config
    from sglang_pic.spans.planner import SpanPlanner
    from sglang_pic.spans.segments import Segment

    cache = _Cache()
    planner = SpanPlanner(cache, span_config.load())
    monkeypatch.setattr(planner, "_cached_node", lambda ids, ns, start, end: (
        ("node", tuple(ids[start:end])) if tuple(ids[start:end]) in cache.cached else None))
    handled, enqueued = [], []
    planner.scheduler = None
    planner._handle = lambda scheduler, recv: handled.append(recv)
    planner._enqueue = lambda scheduler, req: enqueued.append(req.rid)
    planner._template = SimpleNamespace(rid=None, input_ids=None, input_text=None,
                                        sampling_params=SamplingParams())
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    segments = [Segment(0, 4, None, 0, 4, False), Segment(4, 8, None, 4, 8, True),
                Segment(8, None, "q", 8, None, False)]
    cache.cached.add(tuple(ids[:4]))  # the leading piece is cached
    client = SimpleNamespace(rid="client", origin_input_ids=ids, pic_segments=segments,
                             cached_tokens=0, finished=lambda: False, to_finish=None)
    assert planner._plan(client, segments)  # held
    (recv,) = handled
    unit = SimpleNamespace(rid=recv.rid, origin_input_ids=list(recv.input_ids), extra_key=None,
                           req_pool_idx=3, is_retracted=False, to_finish=None,
                           finished=lambda: False, finished_reason=None,
                           extend_range=SimpleNamespace(end=len(recv.input_ids)),
                           extend_end=len(recv.input_ids), skip_radix_cache_insert=False,
                           prefix_len=0)
    return planner, cache, unit, enqueued


def test_a_request_joins_the_batch_right_after_its_span_prefills(monkeypatch):
    """With the overlap scheduler, SGLang forms a batch before it processes the previous one's
    result. A request waiting on a unit whose prefill the previous batch completed joins the
    batch being formed (the unit's pages stashed in the radix tree as SGLang stashes a chunked
    request's), instead of the next scheduler step, after the unit's result."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    planner, cache, unit, enqueued = _waiting_request(monkeypatch)
    last = SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=[unit], chunked_req=None)
    # still being chunked (SGLang's chunked request): not done, not stashed by us
    for chunked in ({"chunked_req": unit}, {}):
        scheduler = SimpleNamespace(last_batch=SimpleNamespace(**{**vars(last), **chunked}),
                                    chunked_req=unit if not chunked else None)
        planner.release_launched_units(scheduler)
        assert enqueued == [] and cache.stashed == []
    # the last batch a decode, or none: nothing launched a unit's prefill
    for batch in (None, SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=[unit])):
        planner.release_launched_units(SimpleNamespace(last_batch=batch, chunked_req=None))
        assert enqueued == []
    scheduler = SimpleNamespace(last_batch=last, chunked_req=None)
    planner.release_launched_units(scheduler)
    assert cache.stashed == [unit.rid] and enqueued == ["client"]
    assert planner.units == {} and planner.held == {}
    assert cache.saved == []  # PTStore copies the pages only once they are computed
    planner.release_launched_units(scheduler)  # the same batch again: nothing more
    assert cache.stashed == [unit.rid] and enqueued == ["client"]
    # the unit's result: it finishes as usual, its pages go to PTStore, nothing is released twice
    unit.finished = lambda: True
    planner.on_request_cached(unit)
    assert enqueued == ["client"] and cache.saved == [(5, 6, 7, 8)]
    assert planner._unsaved == {}


def test_a_span_prefill_not_found_in_the_cache_is_left_to_its_result(monkeypatch):
    """If the stash did not put the unit's pages in the tree, the waiting request stays held
    (no failure now): the unit's own result decides, as without the overlap scheduler."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    planner, cache, unit, enqueued = _waiting_request(monkeypatch)
    monkeypatch.setattr(cache, "cache_unfinished_req", lambda req, chunked=False: None)
    last = SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=[unit], chunked_req=None)
    planner.release_launched_units(SimpleNamespace(last_batch=last, chunked_req=None))
    assert enqueued == [] and len(planner.units) == 1 and "client" in planner.held
    cache.cached.add(tuple(unit.origin_input_ids))  # SGLang's cache_finished_req inserts it
    unit.finished = lambda: True
    planner.on_request_cached(unit)
    assert enqueued == ["client"] and cache.saved == [(5, 6, 7, 8)]


def test_span_prefills_just_over_the_chunk_budget_go_in_one_pass(monkeypatch):
    """A cold prompt's units (system prompt 256 + document 8192 tokens, chunk budget 8192) are
    taken in one pass, not two with a 256-token tail, when nothing but units waits; any other
    waiting request, a larger overshoot, a chunked request in flight or the prefill token cap
    leaves SGLang's budget as it is. The hook sets the budget for that one batch."""
    from sglang_pic import spans

    planner, cache, unit, _ = _waiting_request(monkeypatch)

    def req(rid, n):
        return SimpleNamespace(rid=rid, origin_input_ids=[0] * n)

    planner.unit_by_rid.update({"u-s": object(), "u-d": object()})
    units = [req("u-s", 256), req("u-d", 8192)]

    def sched(queue, **kw):
        return SimpleNamespace(**{"chunked_prefill_size": 8192, "waiting_queue": queue,
                                  "chunked_req": None, "max_prefill_tokens": 16384, **kw})

    assert planner.unit_chunk_budget(sched(units)) == 8448
    assert planner.unit_chunk_budget(sched([req("u-s", 250), req("u-d", 8192)])) == 8444  # pages
    assert planner.unit_chunk_budget(sched([*units, req("client", 64)])) is None
    assert planner.unit_chunk_budget(sched([req("u-s", 1025), req("u-d", 8192)])) is None
    assert planner.unit_chunk_budget(sched([req("u-d", 8192)])) is None  # fits: nothing to do
    assert planner.unit_chunk_budget(sched(units, **{"chunked_req": object()})) is None
    s = sched(units)
    s.max_prefill_tokens = 8192
    assert planner.unit_chunk_budget(s) is None
    s.max_prefill_tokens, s.chunked_prefill_size = 16384, None
    assert planner.unit_chunk_budget(s) is None

    seen = []
    scheduler = sched(units, last_batch=None, tree_cache=SimpleNamespace(planner=planner))
    spans._on_new_prefill_batch(lambda s: seen.append(s.chunked_prefill_size), scheduler)
    assert seen == [8448] and scheduler.chunked_prefill_size == 8192
    scheduler.waiting_queue = [*units, req("client", 64)]
    spans._on_new_prefill_batch(lambda s: seen.append(s.chunked_prefill_size), scheduler)
    assert seen == [8448, 8192]


def test_ready_first_batches_released_requests_without_waiting_span_prefills():
    """``--span-schedule ready-first``: while span prefills (units) and requests whose spans are
    cached both wait, the batch SGLang forms sees only the latter (and plain requests); the
    units go back at the front of the queue, and are never held back twice in a row. Under
    ``isps`` (and when only one kind waits) the queue is left as it is."""
    from dataclasses import replace

    from sglang_pic import spans
    from sglang_pic.spans import config as span_config
    from sglang_pic.spans.planner import SpanPlanner

    def req(rid, span=False):
        return SimpleNamespace(rid=rid, pic_segments=[object()] if span else None)

    planner = SpanPlanner(SimpleNamespace(page_size=PAGE),
                          replace(span_config.load(), schedule="ready-first"))
    unit_a, unit_b = req("pic-span-a"), req("pic-span-b")
    planner.unit_by_rid.update({unit_a.rid: object(), unit_b.rid: object()})
    planner.units.update({"a": object()})
    question, plain = req("question", span=True), req("plain")
    scheduler = SimpleNamespace(waiting_queue=[unit_a, question, unit_b, plain], last_batch=None,
                                chunked_req=None, chunked_prefill_size=8192,
                                tree_cache=SimpleNamespace(planner=planner))
    seen = []

    def form(s):  # SGLang takes what it batches out of the queue (here: all it sees)
        seen.append([r.rid for r in s.waiting_queue])
        s.waiting_queue = []
        return "batch"

    assert spans._on_new_prefill_batch(form, scheduler) == "batch"
    assert seen == [["question", "plain"]]
    assert [r.rid for r in scheduler.waiting_queue] == ["pic-span-a", "pic-span-b"]
    # the next batch: the units are not held back again, even with another question waiting
    scheduler.waiting_queue.append(req("question-2", span=True))
    spans._on_new_prefill_batch(form, scheduler)
    assert seen[-1] == ["pic-span-a", "pic-span-b", "question-2"]
    # only units, or no unit: nothing to do
    scheduler.waiting_queue = [unit_a, unit_b]
    assert planner.defer_units(scheduler) is None
    scheduler.waiting_queue = [question, plain]
    assert planner.defer_units(scheduler) is None
    # isps leaves the batch to SGLang
    planner.cfg = replace(planner.cfg, schedule="isps")
    scheduler.waiting_queue = [unit_a, question]
    assert planner.defer_units(scheduler) is None
