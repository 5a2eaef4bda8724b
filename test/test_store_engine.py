"""PTStore storage engine: incremental prefix tensors, GDSF, owned vs replica, SSD tier."""

from __future__ import annotations

from sglang_pic.store.engine import OWNED, REPLICA, GDSFCache, StoreEngine

PAGE = 1024


def _pages(prefix: str, n: int) -> list[tuple[str, bytes]]:
    return [(f"{prefix}{i}", bytes([i % 251]) * PAGE) for i in range(n)]


def test_shared_prefix_pages_are_stored_once():
    eng = StoreEngine(memory_bytes=100 * PAGE)
    shared = _pages("h", 8)
    a = shared + _pages("a", 4)
    b = shared + _pages("b", 2)
    assert eng.put_tensors(a) == 12 * PAGE
    assert eng.put_tensors(b) == 2 * PAGE  # only what lies beyond the common prefix
    assert eng.stats["dedup_bytes"] == 8 * PAGE
    eng.put_object("A", [t for t, _ in a])
    eng.put_object("B", [t for t, _ in b])
    got = eng.get_tensors(eng.get_object("B"))
    assert got == [d for _, d in b]


def test_gdsf_keeps_frequently_read_pages_and_ages_idle_ones():
    cache = GDSFCache(capacity_bytes=3 * PAGE)
    cache.put("hot", b"x" * PAGE)
    for _ in range(5):
        cache.get("hot")
    cache.put("c1", b"y" * PAGE)
    cache.put("c2", b"z" * PAGE)
    cache.put("c3", b"w" * PAGE)  # evicts the least valuable: a cold page, not "hot"
    assert "hot" in cache and cache.evictions == 1
    for i in range(12):  # a stream of new pages raises the inflation until "hot" ages out
        cache.put(f"n{i}", b"v" * PAGE)
        cache.get(f"n{i}")
    assert "hot" not in cache
    assert cache.used <= cache.capacity
    assert not cache.put("huge", b"q" * (4 * PAGE))


def test_replicas_are_dropped_owned_tensors_spill_to_ssd_and_survive_restart(tmp_path):
    eng = StoreEngine(memory_bytes=10 * PAGE, replica_fraction=0.3, ssd_dir=tmp_path)
    owned = _pages("o", 12)  # 7 pages of owned capacity: 5 must spill
    eng.put_tensors(owned, OWNED)
    eng.put_tensors(_pages("r", 5), REPLICA)  # 3 pages of replica capacity: 2 are dropped
    assert eng.stats["spills"] == 5
    assert eng.replica.evictions == 2
    assert all(d is not None for d in eng.get_tensors([t for t, _ in owned]))
    assert eng.stats["ssd_hits"] == 5
    eng.put_object("doc", [t for t, _ in owned])
    eng.flush_to_ssd()

    restarted = StoreEngine(memory_bytes=10 * PAGE, ssd_dir=tmp_path)
    tids = restarted.get_object("doc")
    assert tids == [t for t, _ in owned]
    assert restarted.get_tensors(tids) == [d for _, d in owned]


def test_missing_tensors_are_misses_not_errors():
    eng = StoreEngine(memory_bytes=4 * PAGE)
    assert eng.get_tensors(["nope", "nada"]) == [None, None]
    assert eng.stats["misses"] == 2 and not eng.has("nope")
