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
import torch
from conftest import free_port, start_servers, stop_server
from sglang_pic.spans.request import PDEP_ID, SSEP_ID, layout_prompt
from sglang_pic.spans.segments import decode_pieces
from sglang_pic.spans.store_tier import (
    ENV,
    KEY_PREFIX,
    SpanStoreTier,
    block_keys,
    block_tokens_for,
    create_span_store,
    unsupported_pool,
)
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

__all__ = ["hf"]  # the HF reference fixture, shared with test_spans_cpu

TOKEN = "span-store-test-token"
MIDDLE = "The documents above and below come from the town archive of Brill."


def test_span_block_keys_follow_ssep_and_pdep():
    span = list(range(100, 164))  # 4 blocks of 16
    keys = block_keys(span, None, 16, "tag")
    assert len(keys) == 4 and all(k.startswith(KEY_PREFIX) for k in keys)
    assert len(set(keys)) == 4
    # SSEP: the span's own chain; the same tokens give the same keys wherever the span stands
    assert block_keys(span, None, 16, "tag") == keys
    # a shorter last block has a key of its own; a block's key depends on the blocks before it
    longer = block_keys(span + [7] * 5, None, 16, "tag")
    assert longer[:4] == keys and len(longer) == 5 and longer[4] not in keys
    assert block_keys(span[:-3], None, 16, "tag")[3] != keys[3]
    assert block_keys([1] * 16 + span, None, 16, "tag")[1:] != keys
    # PDEP: a dependent piece lives under a digest namespace of what precedes it
    assert block_keys(span, "\x1fpic-dep:aa", 16, "tag") != block_keys(span, "\x1fpic-dep:bb", 16, "tag")
    # another model / layout never shares blocks
    assert block_keys(span, None, 16, "other") != keys
    # blocks of about 4 MiB in whole pool pages: Llama-3-8B's 128 KiB tokens, SmolLM2's 22.5 KiB
    assert block_tokens_for(128 << 10, 1) == 32
    assert block_tokens_for(23040, 16) == 176
    assert block_tokens_for(8 << 20, 16) == 16  # never less than a page


@pytest.fixture
def small_tier():
    """A span store tier over a small CPU KV pool (2 layers, 2 KV heads of 8) in a radix tree,
    writing to one in-process store server: 5-token blocks over 1-token pages."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang_pic.store.client import StoreClient

    pool = MHATokenToKVPool(512, 1, torch.bfloat16, 2, 8, 2, "cpu", False)
    alloc = TokenToKVPoolAllocator(512, torch.bfloat16, "cpu", pool, False)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                       token_to_kv_pool_allocator=alloc, page_size=1))
    server = StoreServer(StoreEngine(64 << 20), f"tcp://127.0.0.1:{free_port()}", TOKEN).start()
    tier = SpanStoreTier(cache, StoreClient([server.endpoint], token=TOKEN, shm=False), "m",
                         block_tokens=5)
    yield tier, cache, alloc, pool
    server.stop()


def _fill(cache, alloc, pool, ids, namespace=None):
    """Cache ``ids`` with random KV; returns the rows' K and V, ``[layers, tokens, heads, dim]``."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    rows = alloc.alloc(len(ids))
    for layer in range(len(pool.k_buffer)):
        pool.k_buffer[layer][rows] = torch.randn(len(ids), 2, 8).to(torch.bfloat16)
        pool.v_buffer[layer][rows] = torch.randn(len(ids), 2, 8).to(torch.bfloat16)
    cache.insert(InsertParams(key=RadixKey(list(ids), namespace), value=rows))
    return _kv(pool, rows)


def _kv(pool, rows):
    return (torch.stack([pool.k_buffer[i][rows] for i in range(len(pool.k_buffer))]),
            torch.stack([pool.v_buffer[i][rows] for i in range(len(pool.v_buffer))]))


def _cached_rows(cache, ids, namespace=None):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return cache.match_prefix(MatchPrefixParams(key=RadixKey(list(ids), namespace))).device_indices


def _wait_stored(tier, keys, limit_s=30.0):
    deadline = time.time() + limit_s
    while time.time() < deadline and not all(tier.client.batch_exists(keys)):
        time.sleep(0.05)
    assert all(tier.client.batch_exists(keys))


@pytest.mark.parametrize("length", [5, 12, 23])  # one block; a shorter last block; several
def test_a_saved_span_loads_back_bit_for_bit_in_blocks(small_tier, length):
    """A span saved in 5-token blocks (the last one shorter) is loaded into new pool rows with
    the same K and V; when the tree still holds the first blocks and part of the next, only the
    rest is read, and rows the tree already had go back to the allocator."""
    tier, cache, alloc, pool = small_tier
    ids = list(range(1000, 1000 + length))
    k, v = _fill(cache, alloc, pool, ids)
    queued = tier.save(ids, None, 0, length)
    keys = block_keys(ids, None, 5, tier.tag)
    assert queued == len(keys) == -(-length // 5)
    _wait_stored(tier, keys)
    assert tier.save(ids, None, 0, length) == 0  # known stored: nothing sent again

    keep = min(length - 1, 7)  # the tree keeps a block and two tokens of the next, or less
    cache.reset()
    _fill(cache, alloc, pool, ids[:keep])
    kept = _cached_rows(cache, ids[:keep]).clone()
    free_before = alloc.available_size()
    assert tier.load(ids, None, 0, length, first_position=0)
    rows = _cached_rows(cache, ids)
    assert len(rows) == length and torch.equal(rows[:keep], kept)
    got_k, got_v = _kv(pool, rows)
    assert torch.equal(got_k[:, keep:], k[:, keep:]) and torch.equal(got_v[:, keep:], v[:, keep:])
    assert free_before - alloc.available_size() == length - keep  # no row lost


def test_a_span_the_store_lacks_a_block_of_is_not_loaded(small_tier):
    """The store holds the first two blocks of a 12-token span (a 10-token span was saved), not
    its last: the load is a miss and takes no pool row."""
    tier, cache, alloc, pool = small_tier
    ids = list(range(2000, 2012))
    _fill(cache, alloc, pool, ids[:10])
    tier.save(ids[:10], None, 0, 10)
    _wait_stored(tier, block_keys(ids[:10], None, 5, tier.tag))
    cache.reset()
    free_before = alloc.available_size()
    assert not tier.load(ids, None, 0, len(ids), first_position=0)
    assert alloc.available_size() == free_before and len(_cached_rows(cache, ids)) == 0
    assert tier.load(ids[:10], None, 0, 10, first_position=0)


def test_a_saved_span_is_keyed_by_its_namespace(small_tier):
    """A dependent piece saved under one context is not loaded under another."""
    tier, cache, alloc, pool = small_tier
    ids = list(range(4000, 4010))
    _fill(cache, alloc, pool, ids, namespace="\x1fpic-dep:aa")
    tier.save(ids, "\x1fpic-dep:aa", 0, len(ids))
    _wait_stored(tier, block_keys(ids, "\x1fpic-dep:aa", 5, tier.tag))
    cache.reset()
    assert not tier.load(ids, "\x1fpic-dep:bb", 0, len(ids), first_position=0)
    assert tier.load(ids, "\x1fpic-dep:aa", 0, len(ids), first_position=0)


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
