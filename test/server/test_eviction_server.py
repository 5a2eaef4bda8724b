"""The ``sae`` eviction policy inside a CPU server: correct outputs under cache pressure with the
policy fed by the tree's events, by SGLang's plain radix cache and by HiCache's tree
(``HiRadixCache`` on 0.5.17, ``UnifiedRadixCache`` on 0.5.23), both of its tiers evicting."""

from __future__ import annotations

import json

import pytest
from conftest import HICACHE_CPU_FLAGS, start_server, stop_server, wait_for_host_memory

pytestmark = pytest.mark.capability("eviction")


@pytest.fixture(scope="module")
def sae_server(tmp_path_factory):
    """A server on ``sae`` that writes what its policy saw to ``srv.stats``."""
    folder = tmp_path_factory.mktemp("sae")
    stats = folder / "sae.json"
    srv = start_server(["--radix-eviction-policy", "sae", "--max-total-tokens", "400",
                        "--sae-stats", str(stats)], folder / "server.log")
    srv.stats = stats
    yield srv
    stop_server(srv)


def test_server_with_sae_under_cache_pressure_serves_correct_outputs(sae_server, server):
    """400-token pool: 8 prompts of ~60 tokens (~45 their own, and 12 generated) force
    evictions; a system prompt shared by all requests and a second round (prefix hits on what
    survived) must not change outputs. Every other request sends no session: its application
    is guessed from its match, through the server's contexts (one per insert, the guess
    carried by request id)."""
    system = "You are a concise assistant who answers in one short sentence. "
    prompts = [f"{system}Question {i}: name a fruit that is {c}. "
               + f"It grows in garden {i}, and its taste is {c} too. " * 3
               for i, c in enumerate(["red", "yellow", "green", "orange", "purple", "brown",
                                      "blue", "pink"])]
    body = {"sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    cached = 0
    refs: dict[str, str] = {}  # the plain server's greedy answer, asked once per prompt
    for round_ in range(2):
        for i, p in enumerate(prompts):
            hints = {"session_id": f"s{i % 3}"} if i % 2 == 0 else {}
            got = sae_server.post("/generate", json={"text": p, **hints, **body})
            if p not in refs:
                ref = server.post("/generate", json={"text": p, **body})
                assert ref.status_code == 200, ref.text
                refs[p] = ref.json()["text"]
            assert got.status_code == 200, got.text
            assert got.json()["text"] == refs[p], (round_, p)
            cached += got.json()["meta_info"]["cached_tokens"]
    assert cached > 0  # the shared system prompt stayed cached through evictions
    assert sae_server.healthy()
    # the policy saw the tree's events (on SGLang 0.5.23 the tree is RadixCache because the
    # policy is ours: its default tree would never call it)
    events = json.loads(sae_server.stats.read_text())["events"]
    assert events.get("inserts", 0) > 10 and events.get("evictions", 0) > 0, events
    assert events.get("hits", 0) > 0, events


def test_sae_learns_from_hicache_tree_events(tmp_path, monkeypatch, server):
    """With HiCache, SGLang's tree is HiRadixCache (0.5.17) or UnifiedRadixCache on its Python
    tree core (0.5.23), whose match/insert/split/evict do not call RadixCache's: the policy
    must still see inserts, hits, evictions and demotions (before the hooks were registered on
    those trees it saw none and ranked blocks by recency only), and outputs stay those of the
    plain server."""
    stats = tmp_path / "sae.json"
    monkeypatch.setenv("SGLANG_PIC_SAE_STATS", str(stats))
    wait_for_host_memory(0.5)
    # a host tier of 2x the pool (1024 tokens): the later requests make it evict too
    srv = start_server([*HICACHE_CPU_FLAGS, "--hicache-ratio", "2", "--radix-eviction-policy",
                        "sae", "--max-total-tokens", "512", "--page-size", "16"],
                       tmp_path / "log")
    try:
        system = "You are a concise assistant who answers in one short sentence. " * 2
        body = {"sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        for i in range(16):  # 16 x ~100 tokens (~70 unique each) through a 512-token pool
            prompt = f"{system}Question {i}: " + f"describe detail {i} of the item. " * 8
            got = srv.post("/generate", json={"text": prompt, "session_id": f"s{i % 2}", **body})
            ref = server.post("/generate", json={"text": prompt, **body})
            assert got.status_code == 200, got.text
            assert got.json()["text"] == ref.json()["text"], i
        dumped = json.loads(stats.read_text())
        events = dumped["events"]
        # write-through: a device eviction keeps the block on the host tier (a demotion); the
        # host tier fills too, and what it evicts has left both tiers (an eviction)
        assert events.get("inserts", 0) > 10 and events.get("demotions", 0) > 0, events
        assert events.get("evictions", 0) > 0, events
        assert events.get("hits", 0) > 0, events  # the shared system prompt
        # with the stats file on, where the policy's time went and the scheduler's steps
        assert dumped["evict"]["passes"] > 0 and dumped["evict"]["seconds"] > 0, dumped
        assert dumped["seconds"]["get_priority"] > 0 and dumped["seconds"]["on_insert"] > 0
        assert dumped["scheduler"]["steps"] > 0, dumped
    finally:
        stop_server(srv)
