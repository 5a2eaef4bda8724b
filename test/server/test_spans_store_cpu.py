"""Span pages in PTStore on CPU: spans computed by one instance are loaded by another at other
offsets, after another prefix and in another order, with the block-attention reference's output.

Two store servers run in this process; two span servers (`sglang-pic serve --enable-span-cache
--ptstore ...`, SmolLM2, page size 16) point at them. The page keys are span-aware
(`sglang_pic.spans.store_tier.page_keys`): an independent span's keys do not depend on what
precedes it, a dependent piece's do.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from conftest import free_port, start_servers, stop_server
from sglang_pic.spans.request import PDEP_ID, SSEP_ID, layout_prompt
from sglang_pic.spans.segments import decode_pieces
from sglang_pic.spans.store_tier import ENV, KEY_PREFIX, create_span_store, unsupported_pool
from sglang_pic.store.engine import StoreEngine
from sglang_pic.store.server import StoreServer
from test_spans_cpu import (
    DOCS,
    PAGE,
    PREFIXES,
    QUESTION,
    generate,
    hf,
    loads,
    reference,
    span_ids,
)

pytestmark = pytest.mark.capability("spans")

__all__ = ["hf"]  # the HF reference fixture, shared with test_spans_cpu

TOKEN = "span-store-test-token"
MIDDLE = "The documents above and below come from the town archive of Brill."


@pytest.fixture(scope="module")
def stores():
    servers = [StoreServer(StoreEngine(256 << 20), f"tcp://127.0.0.1:{free_port()}", TOKEN).start()
               for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()  # some tests stop them earlier; a second stop does nothing


@pytest.fixture(scope="module")
def two_span_servers(stores, tmp_path_factory):
    logs = tmp_path_factory.mktemp("span-store")
    token_file = logs / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    args = ["--enable-span-cache", "--max-total-tokens", "8192", "--page-size", str(PAGE),
            "--chunked-prefill-size", "128", "--ptstore", ",".join(s.endpoint for s in stores),
            "--ptstore-token-file", str(token_file)]
    servers = start_servers({name: (args, logs / f"{name}.log") for name in "ab"})
    started = list(servers.values())
    yield tuple(started)
    for srv in started:
        stop_server(srv)


def _span_blocks(stores) -> int:
    # the servers keep ids as "<tenant>\0<id>"
    return sum(sum(t.split("\0", 1)[1].startswith(KEY_PREFIX) for t in list(s.engine.owned.entries))
               for s in stores)


def _blocks_of(server, lengths) -> int:
    """Blocks the server's span tier stores for keys of ``lengths`` tokens (its block size is in
    its log: ``span blocks go to PTStore [...] (N tokens, ...)``)."""
    block = int(re.search(r"span blocks go to PTStore .*? \((\d+) tokens",
                          server.log.read_text(errors="replace")).group(1))
    return sum(-(-n // block) for n in lengths)


def test_spans_computed_by_one_instance_are_loaded_by_the_other(stores, two_span_servers, hf):
    a, b = two_span_servers
    tok = hf[0]
    docs = [DOCS[0], DOCS[2]]
    first_ids = span_ids(tok, PREFIXES[0], docs)
    first = generate(a, input_ids=first_ids)
    assert first["output_ids"] == reference(hf, first_ids)
    _, layout = layout_prompt(first_ids, marker_ids=(SSEP_ID, PDEP_ID), page_size=PAGE,
                              pad_id=tok.eos_token_id)
    doc_lengths = [p.end - p.start for p in decode_pieces(layout) if p.independent]
    doc_tokens = sum(doc_lengths)
    doc_blocks = _blocks_of(a, doc_lengths)
    deadline = time.time() + 60
    while time.time() < deadline and _span_blocks(stores) < doc_blocks:
        time.sleep(0.5)  # A sends span blocks from a background thread
    assert _span_blocks(stores) >= doc_blocks

    # B has never seen these documents: other prefix, other order, so other offsets
    ids = span_ids(tok, PREFIXES[1], docs[::-1])
    before = loads(b)["total_prefill_uncached_tokens"]
    streamed = sum(s.data.stats["stream_bytes"] for s in stores)
    second = generate(b, input_ids=ids)
    computed = uncached_since(b, before)
    assert second["meta_info"]["cached_tokens"] >= doc_tokens
    assert computed < second["meta_info"]["prompt_tokens"] - doc_tokens + PAGE
    assert second["output_ids"] == reference(hf, ids)
    assert "span store: loaded" in b.log.read_text(errors="replace")
    # the span pages came over the stores' TCP data plane (the span tier turns shared memory off)
    assert sum(s.data.stats["stream_bytes"] for s in stores) > streamed


def uncached_since(server, before: int, settle_s: float = 0.5, limit_s: float = 10.0) -> int:
    """Prefill tokens the server computed since ``before``, read once the counter has stopped
    moving: span sub-requests report their prefill a moment after the request that waited for
    them (on a loaded 2-core machine, after the test read it)."""
    value, since, deadline = loads(server)["total_prefill_uncached_tokens"], time.time(), \
        time.time() + limit_s
    while time.time() < deadline and time.time() - since < settle_s:
        time.sleep(0.1)
        now = loads(server)["total_prefill_uncached_tokens"]
        if now != value:
            value, since = now, time.time()
    return value - before


def test_dependent_pieces_are_loaded_only_after_the_same_context(stores, two_span_servers, hf):
    """PDEP: a dependent piece between two spans is a unit of its own, keyed by a digest of
    everything before it. B asking A's prompt with another final question loads every unit
    (leading piece, spans, the dependent middle piece) and prefills only the question; after
    another first document the middle piece's keys differ, so B computes it. The reference is
    A's own output (A computed every unit itself): the HF reference has a 0.01-logit near-tie
    at the 8th token of the second prompt, which the server's arithmetic breaks the other way
    with or without the store (checked on a fresh server)."""
    a, b = two_span_servers
    tok = hf[0]

    def prompt(first_doc: str, question: str) -> list[int]:
        ids = tok(PREFIXES[0])["input_ids"]
        ids += [SSEP_ID] + tok(" " + first_doc, add_special_tokens=False)["input_ids"]
        ids += [PDEP_ID] + tok(" " + MIDDLE, add_special_tokens=False)["input_ids"]
        ids += [SSEP_ID] + tok(" " + DOCS[0], add_special_tokens=False)["input_ids"]
        return ids + [PDEP_ID] + tok(question, add_special_tokens=False)["input_ids"]

    first_ids = prompt(DOCS[1], QUESTION)
    generate(a, input_ids=first_ids)
    pieces = decode_pieces(layout_prompt(first_ids, marker_ids=(SSEP_ID, PDEP_ID),
                                         page_size=PAGE, pad_id=tok.eos_token_id)[1])
    # everything but the final question
    units = _blocks_of(a, [p.end - p.start for p in pieces[:-1]])
    deadline = time.time() + 60
    while time.time() < deadline and _span_blocks(stores) < units:
        time.sleep(0.5)
    time.sleep(1)  # the last unit's put

    ids = prompt(DOCS[1], "\nQuestion: how high is Mount Quellen?\nAnswer:")
    before = loads(b)["total_prefill_uncached_tokens"]
    out = generate(b, input_ids=ids)
    computed = uncached_since(b, before)
    assert out["meta_info"]["cached_tokens"] >= units
    assert computed < out["meta_info"]["prompt_tokens"] - units + PAGE
    assert out["output_ids"] == generate(a, input_ids=ids)["output_ids"]

    # another first document: the middle piece depends on it, so its stored pages do not apply
    ids = prompt(DOCS[2], QUESTION)
    middle = len(tok(" " + MIDDLE, add_special_tokens=False)["input_ids"])
    before = loads(b)["total_prefill_uncached_tokens"]
    out = generate(b, input_ids=ids)
    computed = uncached_since(b, before)
    assert computed >= middle + len(tok(QUESTION, add_special_tokens=False)["input_ids"])
    assert out["output_ids"] == generate(a, input_ids=ids)["output_ids"]


def test_store_down_means_prefill_not_errors(stores, two_span_servers, hf):
    """With every store server gone, spans are prefilled as without a store: same output, and
    one unanswered lookup pauses lookups instead of costing a time-out per span."""
    a, b = two_span_servers
    for s in stores:
        s.stop()
    tok = hf[0]
    ids = span_ids(tok, PREFIXES[0], [DOCS[1], "A new document: the lighthouse has 77 steps."])
    t0 = time.monotonic()
    out = generate(b, input_ids=ids)
    assert out["output_ids"] == reference(hf, ids)
    log = b.log.read_text(errors="replace")
    assert "a store server did not answer" in log
    assert log.count("a store server did not answer") == 1  # the second span was not looked up
    assert time.monotonic() - t0 < 60


def test_span_store_flag_without_endpoints_is_refused():
    from sglang_pic.launcher.launch_server import build_argv

    with pytest.raises(SystemExit, match="needs store endpoints"):
        build_argv(["--model-path", "x", "--enable-span-cache", "--ptstore", " , "])


def test_span_store_refuses_parallel_ranks_and_other_pools(monkeypatch):
    """Each rank would decide alone whether a span loads; a page-major or quantised pool is not
    copied row by row. Both are refused with the reason, not served wrongly."""
    monkeypatch.setenv(ENV, json.dumps({"servers": ["tcp://127.0.0.1:9"]}))
    with pytest.raises(ValueError, match="--tp-size 1"):
        create_span_store(None, "model", tp_size=2)
    with pytest.raises(ValueError, match="--pp-size 1"):
        create_span_store(None, "model", pp_size=2)
    assert "plain MHA KV pool" in unsupported_pool(object())
    monkeypatch.setenv(ENV, json.dumps({"servers": []}))
    with pytest.raises(ValueError, match="non-empty 'servers'"):
        create_span_store(None, "model")
