"""The span store tier alone (``sglang_pic.spans.store_tier``): span-aware block keys, and
spans saved from a KV pool and loaded back into it through one in-process store server, bit for
bit, on the CPU and (marked ``gpu``) on a GPU, where the copies run asynchronously on the
current stream. The servers' end-to-end path is ``test_spans_store_cpu.py``."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import free_port
from sglang_pic.compat.radix_api import matched_indices
from sglang_pic.spans.store_tier import (
    KEY_PREFIX,
    SpanStoreTier,
    block_keys,
    block_tokens_for,
)
from sglang_pic.store.engine import StoreEngine
from sglang_pic.store.server import StoreServer

pytestmark = pytest.mark.capability("spans")

TOKEN = "span-store-tier-test-token"


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


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def small_tier(request):
    """A span store tier over a small KV pool (2 layers, 2 KV heads of 8; on the CPU, and on a
    GPU where the copies go through pinned memory and events) in a radix tree, writing to one
    in-process store server: 5-token blocks over 1-token pages."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang_pic.store.client import StoreClient

    device = request.param
    pool = MHATokenToKVPool(512, 1, torch.bfloat16, 2, 8, 2, device, False)
    alloc = TokenToKVPoolAllocator(512, torch.bfloat16, device, pool, False)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                       token_to_kv_pool_allocator=alloc, page_size=1))
    server = StoreServer(StoreEngine(64 << 20), f"tcp://127.0.0.1:{free_port()}", TOKEN).start()
    tier = SpanStoreTier(cache, StoreClient([server.endpoint], token=TOKEN, shm=False), "m",
                         block_tokens=5)
    yield tier, cache, alloc, pool
    tier.close()
    assert not tier._writer.is_alive()
    server.stop()


def _fill(cache, alloc, pool, ids, namespace=None):
    """Cache ``ids`` with random KV; returns the rows' K and V, ``[layers, tokens, heads, dim]``."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    rows = alloc.alloc(len(ids))
    for layer in range(len(pool.k_buffer)):
        pool.k_buffer[layer][rows] = torch.randn(len(ids), 2, 8).to(pool.k_buffer[layer])
        pool.v_buffer[layer][rows] = torch.randn(len(ids), 2, 8).to(pool.v_buffer[layer])
    cache.insert(InsertParams(key=RadixKey(list(ids), namespace), value=rows))
    return _kv(pool, rows)


def _kv(pool, rows):
    return (torch.stack([pool.k_buffer[i][rows] for i in range(len(pool.k_buffer))]),
            torch.stack([pool.v_buffer[i][rows] for i in range(len(pool.v_buffer))]))


def _cached_rows(cache, ids, namespace=None):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return matched_indices(cache, cache.match_prefix(MatchPrefixParams(key=RadixKey(list(ids),
                                                                                  namespace))))


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
    token_bytes = tier.rows.token_bytes
    assert tier.stats == {"saved_blocks": len(keys), "saved_bytes": length * token_bytes,
                          "dropped_units": 0, "failed_blocks": 0, "loaded_units": 1,
                          "loaded_tokens": length - keep // 5 * 5, "missed_units": 0}


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
    assert tier.stats["missed_units"] == 1 and tier.stats["loaded_units"] == 0
    assert tier.load(ids[:10], None, 0, 10, first_position=0)
    assert tier.stats["loaded_units"] == 1


def test_saves_past_the_writer_s_queue_are_dropped_and_counted(small_tier, monkeypatch):
    """With the writer's queue full a unit is not saved (the scheduler never waits for the
    store): the save queues nothing and the drop is counted, as a store that refuses blocks
    is."""
    from sglang_pic.spans import store_tier

    tier, cache, alloc, pool = small_tier
    ids = list(range(5000, 5010))
    _fill(cache, alloc, pool, ids)
    monkeypatch.setattr(store_tier, "QUEUED_BYTES", 9 * tier.rows.token_bytes)
    assert tier.save(ids, None, 0, len(ids)) == 0
    assert tier.stats["dropped_units"] == 1 and tier.stats["saved_blocks"] == 0
    monkeypatch.setattr(tier.client, "batch_set", lambda items: (_ for _ in ()).throw(
        ConnectionError("store down")))
    monkeypatch.setattr(store_tier, "QUEUED_BYTES", 1 << 30)
    assert tier.save(ids, None, 0, len(ids)) == 2
    deadline = time.time() + 30
    while tier.stats["failed_blocks"] < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert tier.stats["failed_blocks"] == 2 and tier.pending_bytes() == 0
    assert tier.save(ids, None, 0, len(ids)) == 2  # forgotten: a later save sends them again


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


@pytest.mark.gpu
def test_a_gather_launched_behind_a_write_sees_it_without_a_sync():
    """On a GPU the gather is queued on the current stream and returns at once: rows written
    by a kernel still in flight (a forward, in SGLang) are copied as written, once the event
    fires; a scatter queued before a read on the stream is seen by that read."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang_pic.spans.store_tier import PoolRows

    pool = MHATokenToKVPool(4096, 1, torch.bfloat16, 2, 8, 4, "cuda", False)
    rows = torch.randperm(4096, device="cuda")[:3000]
    big = torch.randn(8192, 8192, device="cuda")
    for layer in range(4):
        big = big @ big / 100  # keep the stream busy, so the gather is queued behind the write
        pool.k_buffer[layer][rows] = torch.full((3000, 2, 8), float(layer + 1),
                                                dtype=torch.bfloat16, device="cuda")
        pool.v_buffer[layer][rows] = torch.full((3000, 2, 8), float(-layer - 1),
                                                dtype=torch.bfloat16, device="cuda")
    copier = PoolRows(pool)
    copier.group = 700  # several staging groups
    host, event = copier.gather(rows)
    assert host.is_pinned() and event is not None
    event.synchronize()
    for layer in range(4):
        assert torch.all(host[:, layer, 0] == layer + 1) and torch.all(host[:, layer, 1] == -layer - 1)
    other = torch.randperm(4096, device="cuda")[:3000]
    copier.scatter(host, other)
    assert torch.equal(pool.k_buffer[3][other].cpu(), host[:, 3, 0])
