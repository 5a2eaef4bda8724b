"""The HTTP server against an attacker (issue 21, items 10-13): every test names the defect it
guards against.

10 one request killed the whole server (the scheduler process crashed): token ids outside the
vocabulary, a negative id on a span server, ``top_logprobs_num`` beyond the vocabulary,
constrained decoding on CPU; 11 malformed bodies got a 500 (deep JSON with ``spans``, a JSON
string as the chat body) or slipped past the span middleware (a ``"\\u0073pans"`` key);
12 span sub-requests of a disconnected client kept running, unseen in the load report;
13 ``cached_tokens_details`` disagreed with ``cached_tokens`` on span requests. The servers
require their API key (test_api_key.py); a client without it is refused before its body is read.

Every refusal must be a 400 with a message, and the server must answer the next request with the
same greedy output as before. The suite's shared plain server (``server``) and span server
(``span_server``, which test_spans_cpu also uses: these tests use their own prompts).
"""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from types import SimpleNamespace

import msgspec
import pytest
import requests
from conftest import Server
from sglang.srt.managers.load_snapshot import LoadSnapshot
from sglang_pic.spans.load import SpanLoad, with_span_load
from sglang_pic.spans.planner import Held, SpanPlanner, Unit, cached_tokens_details
from sglang_pic.spans.segments import Segment

PROBE = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
_baselines: dict[str, list[int]] = {}


@pytest.fixture(params=["plain", "span"])
def any_server(request, server, span_server):
    return server if request.param == "plain" else span_server


def probe(srv: Server) -> list[int]:
    r = srv.post("/generate", json=PROBE, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def baseline(srv: Server) -> list[int]:
    """The probe's greedy output before any attack on ``srv``."""
    if srv.url not in _baselines:
        _baselines[srv.url] = probe(srv)
    return _baselines[srv.url]


def assert_survived(srv: Server) -> None:
    assert srv.proc.poll() is None, f"server exited; log:\n{srv.log.read_text()[-3000:]}"
    assert probe(srv) == baseline(srv)


def error_message(r: requests.Response) -> str:
    body = r.json()
    error = body.get("error", body)
    return error["message"] if isinstance(error, dict) else str(error)


def assert_refused(srv: Server, path: str, needle: str, **kwargs) -> None:
    """``path`` answers 400 with ``needle`` in its message, and the server still works."""
    baseline(srv)
    r = srv.post(path, timeout=120, **kwargs)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert needle in error_message(r), r.text[:500]
    assert_survived(srv)


# ---- 10: one request kills the server ----------------------------------------------------------

def test_input_ids_outside_the_vocabulary(any_server):
    assert_refused(any_server, "/generate", "outside the vocabulary",
                   json={"input_ids": [1, 2, 999999], "sampling_params": {"max_new_tokens": 2}})


def test_negative_input_id_on_a_span_server(span_server):
    assert_refused(span_server, "/generate", "negative ids",
                   json={"input_ids": [1, -3, 2], "sampling_params": {"max_new_tokens": 2}})


def test_negative_input_id_on_a_plain_server(server):
    assert_refused(server, "/generate", "outside the vocabulary",
                   json={"input_ids": [1, -3, 2], "sampling_params": {"max_new_tokens": 2}})


def test_top_logprobs_beyond_the_vocabulary(server):
    assert_refused(server, "/generate", "top_logprobs_num`",
                   json={"text": "hi", "return_logprob": True, "top_logprobs_num": 100000})


@pytest.mark.parametrize("path,body,needle", [
    ("/generate", {"text": "hi", "return_logprob": True, "token_ids_logprob": [5, 999999]},
     "token_ids_logprob"),
    ("/v1/completions", {"model": "m", "prompt": [1, 2, 999999], "max_tokens": 2},
     "outside the vocabulary"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": 100000},
     "<= 20 - at `$.logprobs`"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2, "logprobs": True, "top_logprobs": 100000},
     "<= 20 - at `$.top_logprobs`"),
    ("/generate", {"text": "hi", "rid": "pic-span-0", "sampling_params": {"max_new_tokens": 2}},
     "reserved"),
], ids=["token_ids_logprob", "completions-prompt-ids", "completions-logprobs", "chat-top_logprobs",
        "reserved-rid"])
def test_openai_and_logprob_equivalents(server, path, body, needle):
    assert_refused(server, path, needle, json=body)


@pytest.mark.parametrize("params,needle", [
    ({"max_new_tokens": 2, "stream_interval": "2"}, "stream_interval"),
    ({"max_new_tokens": 2, "min_new_tokens": 1, "stop_token_ids": [999999]}, "stop_token_ids"),
    ({"max_new_tokens": 2, "n": 10_000_000}, "<= 128 - at `$.sampling_params.n`"),
    ({"max_new_tokens": 2, "logit_bias": {"999999": 1.0}}, "logit_bias key"),
], ids=["stream_interval-string", "stop_token_ids-outside", "n-huge", "logit_bias-outside"])
def test_sampling_values_the_scheduler_cannot_take(server, params, needle):
    """Values SGLang's own checks pass on to the scheduler, where they raise (a string compared
    with an int), index outside a vocabulary-sized tensor, or copy the request ten million
    times on the tokenizer's event loop: refused with a 400 before."""
    assert_refused(server, "/generate", needle, json={"text": "hi", "sampling_params": params})


@pytest.mark.parametrize("path,body,check", [
    ("/generate", {"text": "The answer is", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "regex": "(yes|no)[.]"}},
     lambda r: re.fullmatch("(yes|no)[.]", r["text"])),
    ("/v1/chat/completions", {"model": "m", "max_tokens": 16, "temperature": 0,
                              "messages": [{"role": "user", "content": "A JSON object, please."}],
                              "response_format": {"type": "json_object"}},
     lambda r: r["choices"][0]["message"]["content"].lstrip().startswith("{")),
], ids=["regex", "chat-json_object"])
def test_constrained_decoding_on_cpu(server, path, body, check):
    """Served on CPU through the CPU grammar hooks (``sglang_pic.cpu.grammar``, registered by
    ``cpu_support``); without them xgrammar killed the scheduler."""
    baseline(server)
    r = server.post(path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert check(r.json()), r.text
    assert_survived(server)


# ---- 11: 500s instead of 400s ------------------------------------------------------------------

def test_deeply_nested_json_with_spans(any_server):
    depth = 100_000
    body = '{"spans": ' + "[" * depth + "]" * depth + "}"
    assert_refused(any_server, "/generate", "depth", data=body,
                   headers={"content-type": "application/json"})


def test_the_key_is_checked_before_the_span_middleware_reads_the_body(span_server):
    """SGLang's API-key middleware is added after our span middleware, so it runs first: a
    client without the key gets 401 before anything parses its body (the body above is a 400
    only for a client holding the key)."""
    depth = 100_000
    body = '{"spans": ' + "[" * depth + "]" * depth + "}"
    r = requests.post(span_server.url + "/generate", data=body, timeout=60,
                      headers={"content-type": "application/json"})
    assert r.status_code == 401, r.text
    # the refusal says where `sglang-pic serve` keeps this server's key (its port names it)
    from sglang_pic.security.api_key import key_file

    port = int(span_server.url.rsplit(":", 1)[1])
    assert str(key_file(port)) in r.json()["message"]


def test_escaped_spans_key_is_the_spans_field(span_server):
    """``"\\u0073pans"`` is ``spans`` in JSON: the middleware must not drop it."""
    spans = [{"text": "Read the note.\n"},
             {"text": "Note: the door code is 7781.\n", "mode": "independent"},
             {"text": "Question: the door code?\nAnswer:"}]
    sp = {"max_new_tokens": 6, "temperature": 0}
    plain = span_server.post("/generate", json={"spans": spans, "sampling_params": sp})
    assert plain.status_code == 200, plain.text
    escaped = json.dumps({"spans": spans, "sampling_params": sp}).replace('"spans"', '"\\u0073pans"')
    r = span_server.post("/generate", data=escaped, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == plain.json()["output_ids"]


def test_escaped_spans_key_on_a_plain_server(server):
    body = '{"\\u0073pans": [{"text": "hi"}], "sampling_params": {"max_new_tokens": 2}}'
    assert_refused(server, "/generate", "span cache", data=body,
                   headers={"content-type": "application/json"})


@pytest.mark.parametrize("body,needle", [
    ('"hello"', "must be a JSON object"),
    ("[1, 2]", "must be a JSON object"),
    ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": "x"}',
     "wrong type"),
], ids=["string", "array", "response_format-string"])
def test_malformed_chat_bodies(server, body, needle):
    assert_refused(server, "/v1/chat/completions", needle, data=body,
                   headers={"content-type": "application/json"})


# ---- 12: a disconnected client's span work is cancelled and visible ----------------------------

def _loads(srv: Server) -> dict:
    return srv.get("/v1/loads").json()["loads"][0]


def _busy(srv: Server) -> int:
    load = _loads(srv)
    return load.get("num_running_reqs", 0) + load.get("num_waiting_reqs", 0)


def _cancel_lines(srv: Server) -> int:
    return srv.log.read_text(errors="replace").count("span prefill(s) no request waits for")


def test_disconnect_cancels_span_prefills(span_server):
    baseline(span_server)
    rnd = random.Random(12)
    words = "alpha beta gamma delta river stone light cloud paper green house field".split()
    tag = uuid.uuid4().hex[:8]
    docs = [f"Document {tag}-{i}: " + " ".join(rnd.choice(words) for _ in range(120))
            for i in range(20)]
    spans = ([{"text": "Answer from the documents.\n"}]
             + [{"text": d, "mode": "independent"} for d in docs]
             + [{"text": "\nQuestion: which document mentions a river?\nAnswer:"}])
    cancelled_before = _cancel_lines(span_server)
    body = {"spans": spans, "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    with span_server.post("/generate", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        deadline = time.time() + 30
        while _busy(span_server) < 5:  # the span prefills are queued or running
            assert time.time() < deadline, _loads(span_server)
            time.sleep(0.1)
    # the client is gone: its span prefills must stop well before all 20 are computed
    deadline = time.time() + 30
    while _busy(span_server):
        assert time.time() < deadline, _loads(span_server)
        time.sleep(0.2)
    assert _cancel_lines(span_server) > cancelled_before, "no span prefill was cancelled"
    assert_survived(span_server)


def test_a_client_hanging_up_aborts_only_its_own_request(server):
    """SGLang aborts every request whose id starts with the aborted one, and a disconnect
    aborts the client's own ``rid``: a client sending ``rid: "victim"`` and hanging up aborted
    another client's ``victim-request`` in flight. Every client id gets a random suffix."""
    from concurrent.futures import ThreadPoolExecutor

    long = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        victim = pool.submit(server.post, "/generate", json={
            "text": "Tell a long story.", "rid": "victim-request", "sampling_params": long})
        time.sleep(1.0)  # the victim is running
        with server.post("/generate", json={"text": "Count slowly.", "rid": "victim",
                                            "stream": True, "sampling_params": long},
                         stream=True, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # started; the connection closes here
        answer = victim.result(timeout=300)
    assert answer.status_code == 200, answer.text
    meta = answer.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length", meta["finish_reason"]
    assert meta["completion_tokens"] == 48
    assert meta["id"].startswith("victim-request-") and len(meta["id"]) == len(
        "victim-request-") + 16
    assert_survived(server)


def test_abort_cancels_the_units_no_request_waits_for():
    """R waits on U1, U2 and the dependent unit D, which itself waits on U1; S waits on U2.
    Aborting R cancels D and, through D's abort, U1; U2 still has S and keeps running."""
    from sglang.srt.managers.io_struct import AbortReq

    planner = SpanPlanner(SimpleNamespace(), SimpleNamespace(schedule="isps"))
    aborted: list[str] = []

    class Scheduler:  # abort_request with our AFTER hook, as the plugin installs it
        ipc_channels = SimpleNamespace(send_to_tokenizer=SimpleNamespace(
            send_output=lambda out, req: aborted.append(f"answered {out.rid}")))

        def abort_request(self, recv):
            aborted.append(recv.rid)
            planner.on_abort(self, recv)

    units = {name: Unit(name, f"pic-span-{name}", None, 10) for name in ("u1", "u2", "d")}
    units["u1"].waiters = ["R", "pic-span-d"]
    units["u2"].waiters = ["R", "S"]
    units["d"].waiters = ["R"]
    planner.units = dict(units)
    planner.unit_by_rid = {u.rid: u for u in units.values()}

    def held(rid, pending):
        return Held(SimpleNamespace(rid=rid, req_pool_idx=None), set(pending))

    planner.held = {"R": held("R", ["u1", "u2", "d"]), "S": held("S", ["u2"]),
                    "pic-span-d": held("pic-span-d", ["u1"])}
    planner.on_abort(Scheduler(), AbortReq(rid="R"))
    assert aborted == ["answered R", "pic-span-d", "pic-span-u1"]
    assert list(planner.units) == ["u2"] and list(planner.held) == ["S"]


def _held(rid: str, length: int, final_start: int) -> SimpleNamespace:
    req = SimpleNamespace(rid=rid, origin_input_ids=list(range(length)),
                          pic_segments=[Segment(final_start, None, None, 0, None, False)])
    return SimpleNamespace(req=req)


def test_load_report_counts_requests_waiting_for_their_spans():
    """Held and backlogged requests are in none of SGLang's queues: the planner adds them."""
    planner = SimpleNamespace(
        held={"a": _held("a", 300, 256), "pic-span-1": _held("pic-span-1", 100, 80)},
        backlog=[(SimpleNamespace(origin_input_ids=list(range(50))), None)],
    )
    load = SpanPlanner.waiting_load(planner)
    assert load == SpanLoad(requests=3, tokens=450, uncached_tokens=44 + 20 + 50)
    snap = LoadSnapshot(num_running_reqs=2, num_waiting_reqs=5, num_total_tokens=1000,
                        num_active_tokens=900, num_waiting_uncached_tokens=70)
    out = with_span_load(snap, load)
    assert (out.num_running_reqs, out.num_waiting_reqs) == (2, 8)
    assert (out.num_total_tokens, out.num_active_tokens) == (1450, 1350)
    assert out.num_waiting_uncached_tokens == 70 + 114
    assert with_span_load(snap, SpanLoad()) is snap
    assert isinstance(out, LoadSnapshot) and msgspec.json.encode(out)


# ---- 13: cached token counts agree -------------------------------------------------------------

def test_cached_tokens_details_agree_with_cached_tokens(span_server):
    tag = uuid.uuid4().hex[:8]
    docs = [f"Document {tag}: the blue castle's code is 4417, set by King Aldric in 1502.\n",
            f"Document {tag}: Mount Quellen is 3120 metres high, north of the river Aster.\n"]

    def meta(prefix: str) -> dict:
        spans = ([{"text": prefix}] + [{"text": d, "mode": "independent"} for d in docs]
                 + [{"text": "Question: the castle's code?\nAnswer:"}])
        r = span_server.post("/generate", json={
            "spans": spans, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]

    cold = meta(f"System {tag}.\n")  # every span computed by this request's sub-requests
    assert cold["cached_tokens"] == 0
    assert cold["cached_tokens_details"] is None
    warm = meta(f"Another system {tag}.\n")  # the spans are cached, the prefix is not
    assert warm["cached_tokens"] > 0
    assert warm["cached_tokens_details"] == {"device": warm["cached_tokens"], "host": 0}


def test_cached_tokens_details_split_store_hits():
    req = SimpleNamespace(cached_tokens=300, pic_store_tokens=128)
    assert cached_tokens_details(req, with_storage=True) == {"device": 172, "host": 0, "storage": 128}
    req = SimpleNamespace(cached_tokens=300, pic_store_tokens=0)
    assert cached_tokens_details(req, with_storage=False) == {"device": 300, "host": 0}
    assert cached_tokens_details(SimpleNamespace(cached_tokens=0), with_storage=True) is None
