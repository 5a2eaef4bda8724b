"""PTStoreHiCacheStorage against a stand-in host KV pool: both interfaces SGLang's cache
controller uses (page copies, and zero copy into the pool's memory) move the exact bytes."""

from __future__ import annotations

import pytest
import torch
from conftest import free_port
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang_pic.store.engine import StoreEngine
from sglang_pic.store.hicache_backend import PTStoreHiCacheStorage
from sglang_pic.store.server import StoreServer

TOKEN = "hicache-backend-test-token"
PAGE, BLOCKS, BLOCK_BYTES = 4, 3, 96


class HostPool:
    """What the backend needs of SGLang's host pool: ``page_size`` and
    ``get_page_buffer_meta`` (pointers and sizes of each page's ``BLOCKS`` memory blocks)."""

    page_size = PAGE

    def __init__(self, pages: int, allocator=None) -> None:
        self.allocator = allocator  # SGLang's host pools keep theirs here
        dims = (BLOCKS, pages, BLOCK_BYTES)
        self.buf = (allocator.allocate(dims, torch.uint8, "cpu") if allocator is not None
                    else torch.zeros(dims, dtype=torch.uint8))

    def get_page_buffer_meta(self, indices: torch.Tensor):
        ptrs = [self.buf[b, int(i) // PAGE].data_ptr()
                for i in indices[::PAGE] for b in range(BLOCKS)]
        return ptrs, [BLOCK_BYTES] * len(ptrs)

    def page(self, index: int) -> torch.Tensor:
        return self.buf[:, index // PAGE]


@pytest.fixture(autouse=True)
def token_in_env(monkeypatch):
    """Where ``sglang-pic serve --ptstore-token-file`` puts the token for SGLang's schedulers."""
    monkeypatch.setenv("SGLANG_PIC_PTSTORE_TOKEN", TOKEN)


@pytest.fixture
def server():
    srv = StoreServer(StoreEngine(1 << 24), f"tcp://127.0.0.1:{free_port()}", TOKEN).start()
    yield srv
    srv.stop()


def _backend(server, zero_copy: bool, pool: HostPool | None = None,
             **extra) -> PTStoreHiCacheStorage:
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, enable_storage_metrics=False, is_mla_model=False,
                               is_page_first_layout=True, model_name="m",
                               extra_config={"servers": [server.endpoint],
                                             "interface_v1": int(zero_copy), **extra})
    backend = PTStoreHiCacheStorage(cfg)
    if pool is not None:
        backend.register_mem_pool_host(pool)
    return backend


def test_zero_copy_moves_pool_pages_between_instances(server):
    src, dst = HostPool(8), HostPool(8)
    src.buf.copy_(torch.randint(0, 256, src.buf.shape, dtype=torch.uint8))
    writer, reader = _backend(server, True, src), _backend(server, True, dst)
    assert writer.blocks == BLOCKS
    keys = ["h0", "h1", "h2"]
    at = torch.arange(2 * PAGE, 5 * PAGE)  # pages 2, 3, 4 of the writer's pool
    assert writer.batch_set_v1(keys, at) == [True] * 3
    assert server.engine.stats["bytes_in"] == 3 * BLOCKS * BLOCK_BYTES
    assert reader.batch_exists(keys + ["h9"]) == 3
    into = torch.cat([torch.arange(6 * PAGE, 7 * PAGE), torch.arange(0, PAGE),
                      torch.arange(5 * PAGE, 6 * PAGE)])  # other pages of the reader's pool
    assert reader.batch_get_v1(keys, into) == [True] * 3
    for k, (w, r) in enumerate(((2, 6), (3, 0), (4, 5))):
        assert torch.equal(dst.page(r * PAGE), src.page(w * PAGE)), keys[k]
    assert dst.buf[:, 1:5].count_nonzero() == 0  # nothing written elsewhere
    assert reader.batch_get_v1(["h0", "nope"], torch.arange(0, 2 * PAGE)) == [True, False]
    # a page stored by the copying interface is not a zero-copy hit (different blocks)
    assert _backend(server, False).batch_exists(keys) == 0


def test_page_copy_interface(server):
    backend = _backend(server, False)
    pages = [torch.randint(0, 256, (BLOCKS * BLOCK_BYTES,), dtype=torch.uint8) for _ in range(2)]
    assert backend.batch_set(["a", "b"], pages)
    assert backend.batch_exists(["a", "b", "c"]) == 2
    out = backend.batch_get(["a", "b"], [torch.empty_like(p) for p in pages])
    assert all(torch.equal(o, p) for o, p in zip(out, pages, strict=True))
    wrong = backend.batch_get(["a"], [torch.empty(5, dtype=torch.uint8)])
    assert wrong == [None]  # a page of another shape is a miss, never a partial write


def test_failures_become_misses_and_the_page_copy_path_works_in_zero_copy_mode(server):
    """SGLang's controller threads die on an exception: the backend turns any failure into
    misses / failed writes. SGLang's draft-model path uses the page-copy methods on a zero-copy
    backend: they store one id per page."""
    pool = HostPool(4)
    backend = _backend(server, True, pool)
    page = torch.arange(BLOCKS * BLOCK_BYTES, dtype=torch.int32).to(torch.uint8)
    assert backend.batch_set(["d0"], [page])
    out = backend.batch_get(["d0"], [torch.empty_like(page)])
    assert torch.equal(out[0], page)

    def broken(*args, **kwargs):
        raise RuntimeError("store unreachable")

    backend.client.batch_get_into = broken
    backend.client.batch_exists = broken
    backend.client.batch_set = broken
    assert backend.batch_get_v1(["a", "b"], torch.arange(2 * PAGE)) == [False, False]
    assert backend.batch_set_v1(["a"], torch.arange(PAGE)) == [False]
    assert backend.batch_exists(["a"]) == 0
    assert backend.batch_set(["d1"], [page]) is False


def test_a_host_pool_from_sglangs_shm_allocator_is_written_by_the_server(server):
    """With ``"allocator": "shm"`` SGLang allocates the host pool with its own
    ``ShmHostTensorAllocator`` (a memfd): the backend hands it to the server, which writes the
    loaded pages into their slots itself."""
    from sglang.srt.mem_cache.pool_host.common import ShmHostTensorAllocator

    src = HostPool(8)
    src.buf.copy_(torch.randint(0, 256, src.buf.shape, dtype=torch.uint8))
    dst = HostPool(8, ShmHostTensorAllocator())
    writer, reader = _backend(server, True, src), _backend(server, True, dst)
    assert reader.client.same_node.pool is not None and reader.client.same_node.pool_ok == {server.endpoint: True}
    assert writer.batch_set_v1(["k0", "k1"], torch.arange(0, 2 * PAGE)) == [True, True]
    into = torch.cat([torch.arange(5 * PAGE, 6 * PAGE), torch.arange(2 * PAGE, 3 * PAGE)])
    assert reader.batch_get_v1(["k0", "k1"], into) == [True, True]
    assert torch.equal(dst.page(5 * PAGE), src.page(0)) and torch.equal(dst.page(2 * PAGE),
                                                                         src.page(PAGE))
    assert server.pool_pages == 2 * BLOCKS and reader.client.stats["pool_pages"] == 2 * BLOCKS


def test_the_gil_switch_interval_is_opt_in_and_bounded(server):
    import sys

    before = sys.getswitchinterval()
    try:
        _backend(server, True)
        assert sys.getswitchinterval() == before
        _backend(server, True, gil_switch_ms=0.5)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        with pytest.raises(ValueError, match="gil_switch_ms"):
            _backend(server, True, gil_switch_ms=50)
    finally:
        sys.setswitchinterval(before)


def test_traced_stores_name_the_pages_each_write_back_stored(server, monkeypatch, capfd):
    """``SGLANG_PIC_STORE_TRACE=1`` (``--ptstore-trace``) logs each store as it logs loads: the
    TTFT benchmark's writer reads from it which write-backs failed (SGLang drops the rest of an
    operation after one) and how long each took."""
    import importlib
    import re

    import sglang_pic.store.hicache_backend as hb

    monkeypatch.setenv("SGLANG_PIC_STORE_TRACE", "1")
    traced = importlib.reload(hb)  # the trace is chosen when the module is imported
    try:
        pool = HostPool(4)

        def backend(endpoint: str):
            cfg = HiCacheStorageConfig(
                tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                enable_storage_metrics=False, is_mla_model=False, is_page_first_layout=True,
                model_name="m", extra_config={"servers": [endpoint], "interface_v1": 1,
                                              "timeout_ms": 300})
            b = traced.PTStoreHiCacheStorage(cfg)
            b.register_mem_pool_host(pool)
            return b

        capfd.readouterr()
        assert backend(server.endpoint).batch_set_v1(["t0", "t1"], torch.arange(2 * PAGE)) \
            == [True, True]
        nobody = f"tcp://127.0.0.1:{free_port()}"  # no server: the store fails, never raises
        assert backend(nobody).batch_set_v1(["t2", "t3", "t4"], torch.arange(3 * PAGE)) \
            == [False] * 3
    finally:
        monkeypatch.delenv("SGLANG_PIC_STORE_TRACE")
        importlib.reload(hb)
    lines = re.findall(r"\[ptstore-trace\] batch_set_v1 at [0-9.]+: (\d+) pages, (\d+) hits, "
                       r"[0-9.]+ ms", capfd.readouterr().err)
    assert lines == [("2", "2"), ("3", "0")]
