"""How span prefills (the planner's unit requests) are scheduled, without a model.

A cold span prompt waits on its units; the scheduler passes that follow a unit's prefill are
on that prompt's critical path (``docs/spans.md``, "Scheduling"). These tests pin what SGLang
makes of a unit request, as the planner submits it.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

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
    client = SamplingParams(max_new_tokens=64, min_new_tokens=8, temperature=0.7)
    planner._template = SimpleNamespace(rid="client", input_ids=None, input_text=None,
                                        sampling_params=client, return_logprob=True, stream=True)
    span = Segment(4, 8, None, 4, 8, True)
    planner._submit_unit("key", [1, 2, 3, 4, 5, 6, 7, 8], span, [span])
    (recv,) = handled
    assert client.max_new_tokens == 64  # the client's parameters are left as they were
    return recv


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
