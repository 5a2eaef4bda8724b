"""PTStore as HiCache's L3 tier on CPU: a prefix computed by one sglang-pic instance is loaded
from the store by another (cached tokens from storage), with identical output.

Three store servers run in this process (loopback TCP); two CPU servers point at them through
HiCache's ``dynamic`` storage backend.
"""

from __future__ import annotations

import json
import time

import pytest
from conftest import HICACHE_CPU_FLAGS, free_port, start_server, stop_server
from sglang_pic.store.engine import StoreEngine
from sglang_pic.store.server import StoreServer

TOKEN = "test-token"


@pytest.fixture(scope="module")
def store_cluster():
    servers = [StoreServer(StoreEngine(256 << 20), f"tcp://127.0.0.1:{free_port()}", TOKEN)
               .start() for _ in range(3)]
    yield servers
    for s in servers:
        s.stop()


def _instance_args(servers) -> list[str]:
    extra = {"backend_name": "ptstore", "module_path": "sglang_pic.store.hicache_backend",
             "class_name": "PTStoreHiCacheStorage", "token": TOKEN,
             "servers": [s.endpoint for s in servers]}
    return [*HICACHE_CPU_FLAGS, "--hicache-write-policy", "write_through",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra),
            "--max-total-tokens", "2048", "--page-size", "16"]


@pytest.fixture(scope="module")
def two_instances(store_cluster, tmp_path_factory):
    logs = tmp_path_factory.mktemp("ptstore")
    a = start_server(_instance_args(store_cluster), logs / "a.log")
    b = start_server(_instance_args(store_cluster), logs / "b.log")
    yield a, b
    stop_server(a)
    stop_server(b)


def test_prefix_computed_by_one_instance_is_loaded_by_the_other(store_cluster, two_instances):
    a, b = two_instances
    # > 256 tokens: SGLang only prefetches storage hits of at least prefetch_threshold (256)
    prompt = "The history of the Roman Empire spans many centuries of conquest. " * 32
    first = a.generate_text(prompt)
    deadline = time.time() + 60
    while time.time() < deadline:  # write-through to L3 is asynchronous
        if sum(s.engine.stats["bytes_in"] for s in store_cluster) > 0 and \
                sum(len(s.engine.owned.entries) for s in store_cluster) >= 20:
            break
        time.sleep(1)
    stored_pages = sum(len(s.engine.owned.entries) for s in store_cluster)
    assert stored_pages >= 20
    assert sum(len(s.engine.owned.entries) > 0 for s in store_cluster) >= 2  # spread by owner
    second = b.generate_text(prompt)
    details = second["meta_info"].get("cached_tokens_details") or {}
    assert details.get("storage", 0) >= 256, second["meta_info"]
    assert second["text"] == first["text"]
