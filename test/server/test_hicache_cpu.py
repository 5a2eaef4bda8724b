"""HiCache on CPU: a prefix evicted from the device pool is served from the host tier (L2).

The server runs with ``--insecure`` (no API key), so it also shows that opt-out working: its
requests carry no ``Authorization`` header.
"""

from __future__ import annotations

import pytest
from conftest import HICACHE_CPU_FLAGS, start_server, stop_server, wait_for_host_memory


@pytest.fixture(scope="module")
def hicache_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("hicache") / "server.log"
    wait_for_host_memory(0.5)
    srv = start_server([*HICACHE_CPU_FLAGS, "--max-total-tokens", "512", "--page-size", "16",
                        "--insecure"], log, pass_key=False)
    yield srv
    stop_server(srv)


def test_evicted_prefix_is_loaded_from_host(hicache_server):
    target = "The history of the Roman Empire spans many centuries. " * 12
    first = hicache_server.generate_text(target)
    for i in range(6):  # ~830 tokens of other prompts through a 512-token device pool
        hicache_server.generate_text(f"Topic {i}: " + f"another sentence about subject {i}. " * 14)
    again = hicache_server.generate_text(target)
    details = again["meta_info"]["cached_tokens_details"]
    assert details["host"] >= 96, details
    assert again["text"] == first["text"]


def test_insecure_serves_without_a_key_and_says_so(hicache_server):
    assert hicache_server.api_key is None  # the helpers send no Authorization header
    r = hicache_server.post("/v1/chat/completions", json={
        "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    log = hicache_server.log.read_text(errors="replace")
    assert "sglang-pic serve: warning: --insecure: no API key" in log
    assert "API key generated" not in log
