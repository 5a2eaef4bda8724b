"""PTStore as HiCache's L3 tier on CPU: a prefix computed by one sglang-pic instance is loaded
from the store by another (cached tokens from storage), with identical output.

Three store servers run in this process (loopback TCP); two CPU servers point at them with
``sglang-pic serve --ptstore`` (HiCache's ``dynamic`` backend, zero-copy ``interface_v1``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from conftest import free_port, start_server, stop_server, wait_for_host_memory
from sglang_pic.store.engine import StoreEngine
from sglang_pic.store.server import StoreServer

TOKEN = "hicache-cpu-test-token"


@pytest.fixture(scope="module")
def store_cluster():
    servers = [StoreServer(StoreEngine(256 << 20), f"tcp://127.0.0.1:{free_port()}", TOKEN)
               .start() for _ in range(3)]
    yield servers
    for s in servers:
        s.stop()


def _instance_args(servers, token_file) -> list[str]:
    # a 10 s store time-out (default 2 s): the three servers share this test process's GIL and the
    # suite's two cores with two CPU engines, and a pool load past its deadline is (rightly) a miss
    return ["--ptstore", ",".join(s.endpoint for s in servers), "--ptstore-token-file", token_file,
            "--hicache-storage-backend-extra-config", '{"timeout_ms": 10000}',
            "--hicache-ratio", "4", "--hicache-storage-prefetch-policy", "wait_complete",
            "--max-total-tokens", "2048", "--page-size", "16"]


def _token_file(folder) -> str:
    token_file = folder / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    return str(token_file)


@pytest.fixture(scope="module")
def instance_a(store_cluster, tmp_path_factory):
    """The instance that computes the prefixes, for the module."""
    logs = tmp_path_factory.mktemp("ptstore")
    wait_for_host_memory(0.5)  # SGLang checks each instance's host tier against its reserve
    a = start_server(_instance_args(store_cluster, _token_file(logs)), logs / "a.log")
    yield a
    stop_server(a)


@pytest.fixture
def two_instances(store_cluster, instance_a, tmp_path):
    """A, and B for one test: B stops before the next test starts its own reader (three HiCache
    instances at once wait longer for SGLang's 10 GiB host reserve on a 24 GiB machine)."""
    wait_for_host_memory(0.5)  # again, with the first instance up
    b = start_server([*_instance_args(store_cluster, _token_file(tmp_path)), "--ptstore-trace"],
                     tmp_path / "b.log")
    yield instance_a, b
    stop_server(b)


def test_prefix_computed_by_one_instance_is_loaded_by_the_other(store_cluster, two_instances):
    a, b = two_instances
    # > 256 tokens: SGLang only prefetches storage hits of at least prefetch_threshold (256)
    prompt = "The history of the Roman Empire spans many centuries of conquest. " * 32
    first = a.generate_text(prompt)

    def stored_pages() -> dict[str, int]:
        """page hash -> blocks stored (zero copy stores each host-pool block of a page)"""
        pages: dict[str, int] = {}
        for s in store_cluster:
            for tid in list(s.engine.owned.entries):
                page = tid.rsplit("#", 1)[0]
                pages[page] = pages.get(page, 0) + 1
        return pages

    deadline = time.time() + 60
    while time.time() < deadline and len(stored_pages()) < 20:  # write-through is asynchronous
        time.sleep(1)
    time.sleep(1)
    pages = stored_pages()
    assert len(pages) >= 20
    assert len(set(pages.values())) == 1 and next(iter(pages.values())) == 2 * 30  # K, V x layers
    assert sum(len(s.engine.owned.entries) > 0 for s in store_cluster) >= 2  # spread by owner
    second = b.generate_text(prompt)
    details = second["meta_info"].get("cached_tokens_details") or {}
    assert details.get("storage", 0) >= 256, second["meta_info"]
    assert second["text"] == first["text"]
    # --ptstore-trace: B's scheduler says when it took the finished prefetch, and its size
    taken = re.findall(r"\[ptstore-trace\] prefetch_done at [0-9.]+: (\d+) tokens",
                       Path(b.log).read_text(errors="replace"))
    assert taken and int(taken[0]) >= 256, taken
    # --ptstore puts B's host pool in shared memory: the servers (this process) wrote the
    # loaded blocks straight into it, K and V of each layer of each loaded page
    assert sum(s.pool_pages for s in store_cluster) >= 2 * 30 * 256 // 16


def test_an_instance_reading_over_the_tcp_data_plane_loads_the_prefix(store_cluster,
                                                                      instance_a, tmp_path):
    """A reader with ``"data_plane": "tcp"`` (what an instance on another node gets: no shared
    memory) loads a prefix instance A computed: pages over the data plane's streams, straight
    into its host pool, same output."""
    a = instance_a
    prompt = "A survey of medieval trade routes across the Mediterranean sea. " * 32
    first = a.generate_text(prompt)
    before = sum(s.data.stats["stream_bytes"] for s in store_cluster)
    pools = sum(s.pool_pages for s in store_cluster)
    args = _instance_args(store_cluster, _token_file(tmp_path))
    args[args.index('{"timeout_ms": 10000}')] = '{"timeout_ms": 10000, "data_plane": "tcp"}'
    deadline = time.time() + 60  # A's write-through is asynchronous: wait for its pages
    while time.time() < deadline and sum(len(s.engine.owned.entries)
                                         for s in store_cluster) < 2 * 2 * 30 * 20:
        time.sleep(1)
    wait_for_host_memory(0.5)
    c = start_server(args, tmp_path / "c.log")
    try:
        second = c.generate_text(prompt)
    finally:
        stop_server(c)
    details = second["meta_info"].get("cached_tokens_details") or {}
    assert details.get("storage", 0) >= 256, second["meta_info"]
    assert second["text"] == first["text"]
    moved = sum(s.data.stats["stream_bytes"] for s in store_cluster) - before
    assert moved > 0 and sum(s.pool_pages for s in store_cluster) == pools  # TCP, not the pool
