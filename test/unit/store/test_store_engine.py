"""PTStore storage engine: incremental prefix tensors, GDSF, owned vs replica, SSD tier."""

from __future__ import annotations

from pathlib import Path

from conftest import REPO
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


def test_tiny_pages_count_as_their_id_and_entry():
    """Empty or few-byte pages under long ids: each counts at least as its id plus an entry's
    cost, so a 1 MiB cache keeps at most a few thousand of them, not every one sent."""
    from sglang_pic.store.gdsf import ENTRY_BYTES

    cache = GDSFCache(capacity_bytes=1 << 20)
    for i in range(5000):
        cache.put(f"{i:0900d}", b"")
    assert len(cache.entries) == (1 << 20) // (900 + ENTRY_BYTES)
    assert cache.used <= cache.capacity
    cache.put("page", b"p" * PAGE)  # a page of kilobytes counts as its bytes
    assert cache.entries["page"].size == PAGE


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


# ---- server + client over zmq (loopback) --------------------------------------------------
import pytest  # noqa: E402
import zmq  # noqa: E402
from sglang_pic.store.auth import secure_client  # noqa: E402
from sglang_pic.store.client import StoreClient  # noqa: E402
from sglang_pic.store.protocol import Limits  # noqa: E402
from sglang_pic.store.server import StoreServer  # noqa: E402

TOKEN = "s3cret"


@pytest.fixture
def cluster(tmp_path):
    # 1024 pages each: a get's reply may carry a tenant's half of a quarter of a server's memory
    # (128 pages), above any one owner's share of the reads here, wherever the ring puts them
    servers = [StoreServer(StoreEngine(1024 * PAGE), f"ipc://{tmp_path}/s{i}.sock", TOKEN,
                           Limits(max_tensor_bytes=4 * PAGE)).start() for i in range(3)]
    yield servers
    for s in servers:
        s.stop()


def test_batched_puts_and_gets_one_rpc_per_owner(cluster):
    client = StoreClient([s.endpoint for s in cluster], TOKEN)
    pages = _pages("p", 60)
    assert client.batch_set(pages) == 60 * PAGE
    owners = {s.endpoint: s.engine for s in cluster}
    assert sum(len(e.owned.entries) for e in owners.values()) == 60
    assert all(len(e.owned.entries) > 0 for e in owners.values())  # spread over all servers
    before = client.channels.rpcs
    got = client.batch_get([t for t, _ in pages])
    assert got == [d for _, d in pages]
    assert client.channels.rpcs - before == 3  # one message per owner
    assert client.batch_exists(["p0", "zz"]) == [True, False]
    assert client.batch_set(pages[:10]) == 0  # already stored: nothing added twice
    client.close()


def test_an_id_asked_for_twice_is_fetched_once_and_given_at_both_places(cluster):
    """A server refuses a get naming an id twice (each repeat would be read and sent again);
    the client asks for each id once and gives its page at every place it was asked."""
    client = StoreClient([s.endpoint for s in cluster], TOKEN)
    pages = _pages("r", 4)
    assert client.batch_set(pages) == 4 * PAGE
    tids = ["r0", "r1", "r0", "absent", "r3", "r1", "absent"]
    want = {t: d for t, d in pages}
    assert client.batch_get(tids) == [want.get(t) for t in tids]
    dests = [memoryview(bytearray(PAGE)) for _ in tids]
    assert client.batch_get_into(tids, dests) == [t in want for t in tids]
    assert [bytes(d) for d, t in zip(dests, tids, strict=True) if t in want] == [
        want[t] for t in tids if t in want]
    assert sum(s.rejected for s in cluster) == 0
    client.close()


def test_a_prefix_lookup_asks_the_first_page_alone_first(cluster):
    """``leading_found`` (HiCache's lookup before a prefetch): a prefix whose first page is
    missing costs one RPC; otherwise the leading pages found, the first missing one ending it."""
    client = StoreClient([s.endpoint for s in cluster], TOKEN)
    pages = _pages("lead", 30)
    client.batch_set(pages)
    tids = [t for t, _ in pages]
    before = client.channels.rpcs
    assert client.leading_found(["absent"] + tids) == 0
    assert client.channels.rpcs - before == 1  # a cold prompt's lookup: one small round trip
    assert client.leading_found(tids) == 30
    assert client.leading_found(tids[:12] + ["gap"] + tids[12:]) == 12
    assert client.leading_found(tids[:1]) == 1 and client.leading_found([]) == 0
    client.close()


def test_bad_requests_are_rejected_and_the_server_keeps_serving(cluster):
    srv = cluster[0]
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    secure_client(raw, TOKEN)  # authenticated: the requests themselves are bad
    raw.connect(srv.endpoint)
    import json

    def ask(frames):
        raw.send_multipart(frames)
        assert raw.poll(2000)
        return json.loads(raw.recv_multipart()[0])

    assert "malformed" in ask([b"{not json"])["error"]
    big = b"x" * (5 * PAGE)
    reply = ask([json.dumps({"op": "put", "tids": ["big"], "sums": [0]}).encode(), big])
    assert reply["error"] == "tensor too large"
    reply = ask([json.dumps({"op": "put", "tids": ["t"], "sums": [123]}).encode(), b"abc"])
    assert reply["error"] == "checksum mismatch"
    assert ask([json.dumps({"op": "drop_all"}).encode()])["ok"] is False
    raw.close(0)
    client = StoreClient([srv.endpoint], TOKEN)
    assert client.batch_set(_pages("ok", 2)) == 2 * PAGE  # still serving
    assert client.status(srv.endpoint)["rejected"] == 4
    assert "ptstore_rejected 4" in srv.metrics_text()


def test_dead_server_gives_misses_not_errors(cluster):
    client = StoreClient([s.endpoint for s in cluster], TOKEN, timeout_ms=300)
    pages = _pages("q", 30)
    client.batch_set(pages)
    dead = cluster[1]
    dead.stop()
    got = client.batch_get([t for t, _ in pages])
    lost = {t for t, _ in pages if client.ring.owner(t) == dead.endpoint}
    assert lost and all((d is None) == (t in lost) for (t, _), d in zip(pages, got, strict=True))
    assert all(d == want for (t, want), d in zip(pages, got, strict=True) if d is not None)
    client.close()


def test_wrong_token_client_gets_nothing(cluster):
    client = StoreClient([s.endpoint for s in cluster], "wrong", timeout_ms=300)
    assert client.batch_set(_pages("w", 3)) == 0
    assert client.batch_get(["w0"]) == [None]
    assert sum(s.requests for s in cluster) == 0  # refused at the handshake: no request at all
    client.close()


def test_store_cli_serves_reports_status_and_recovers(tmp_path):
    """`sglang-pic store` runs a server; `store-status` reads it; SIGTERM flushes to SSD and a
    restart recovers the objects."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import free_port

    ep = f"tcp://127.0.0.1:{free_port()}"
    token = "cli-test-token-0123456789"
    env = dict(os.environ, SGLANG_PIC_STORE_TOKEN=token)
    cmd = [sys.executable, "-m", "sglang_pic", "store", "--endpoint", ep, "--memory-gb", "0.01",
           "--ssd-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert "PTStore server on" in proc.stdout.readline()
    client = StoreClient([ep], token)
    pages = _pages("c", 4)
    assert client.batch_set(pages) == 4 * PAGE
    client.channels.call(ep, {"op": "put_object", "key": "doc", "tids": [t for t, _ in pages]})
    st = subprocess.run([sys.executable, "-m", "sglang_pic", "store-status", ep],
                        capture_output=True, text=True, timeout=60, env=env)
    assert st.returncode == 0 and '"owned_tensors": 4' in st.stdout
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    client.close()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert "1 objects recovered" in proc.stdout.readline()
    client = StoreClient([ep], token)
    reply = client.channels.call(ep, {"op": "get_object", "key": "doc"})
    assert reply[0]["tids"] == [t for t, _ in pages]
    assert client.batch_get(reply[0]["tids"]) == [d for _, d in pages]  # from the SSD tier
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def test_hot_pages_are_replicated_onto_the_reading_node(cluster):
    """Pages read twice from a remote owner are copied into the local server's replica cache;
    later reads are served locally, also when the owner is down."""
    local, others = cluster[0], cluster[1:]
    writer = StoreClient([s.endpoint for s in cluster], TOKEN)
    pages = _pages("hot", 40)
    writer.batch_set(pages)
    ring = writer.ring
    remote = [(t, d) for t, d in pages if ring.owner(t) != local.endpoint]
    assert remote
    reader = StoreClient([s.endpoint for s in cluster], TOKEN, local=local.endpoint,
                         replicate_after=2)
    tids = [t for t, _ in remote]
    assert reader.batch_get(tids) == [d for _, d in remote]
    assert len(local.engine.replica.entries) == 0  # read once: not hot yet
    assert reader.batch_get(tids) == [d for _, d in remote]
    assert len(local.engine.replica.entries) == len(remote)  # read twice: replicated
    owner_requests = sum(s.requests for s in others)
    before = reader.channels.rpcs
    assert reader.batch_get(tids) == [d for _, d in remote]
    assert reader.channels.rpcs - before == 1  # one RPC, to the local server
    assert sum(s.requests for s in others) == owner_requests
    assert reader.stats["replica_hits"] == len(remote)
    for s in others:  # the owners go down: the replicas still serve
        s.stop()
    assert reader.batch_get(tids) == [d for _, d in remote]
    assert local.status()["replica_tensors"] == len(remote)


def test_one_client_used_from_several_threads_gets_its_own_answers(cluster):
    """SGLang's cache controller calls the backend from three threads at once: every thread
    must get the reply to its own request (zmq sockets are per thread)."""
    import threading

    client = StoreClient([s.endpoint for s in cluster], TOKEN)
    errors: list[str] = []

    def worker(name: str) -> None:
        pages = _pages(name, 20)
        try:
            for _ in range(15):
                client.batch_set(pages)
                ids = [t for t, _ in pages]
                if client.batch_exists(ids + [name + "-none"]) != [True] * 20 + [False]:
                    errors.append(f"{name}: exists")
                if client.batch_get(ids) != [d for _, d in pages]:
                    errors.append(f"{name}: get")
        except Exception as e:  # a reply meant for another thread breaks the parsing
            errors.append(f"{name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(f"w{i}-",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:5]
    client.close()


def test_a_page_is_always_served_with_the_checksum_of_its_own_bytes(tmp_path):
    """Recomputed KV is not bit-exact: the same id can arrive with other bytes after its first
    copy went to SSD. Whatever copy a get returns must carry its own checksum (the client drops
    a mismatch as a miss forever, since `exists` keeps saying yes)."""
    srv = StoreServer(StoreEngine(2 * PAGE, replica_fraction=0.0, ssd_dir=tmp_path),
                      f"ipc://{tmp_path}/c.sock", TOKEN).start()
    client = StoreClient([srv.endpoint], TOKEN)
    try:
        client.batch_set([("t", b"A" * PAGE)])
        client.batch_set([("x", b"x" * PAGE), ("y", b"y" * PAGE)])  # "t" (bytes A) spills
        client.batch_set([("t", b"B" * PAGE)])  # back in memory with other bytes
        assert client.batch_get(["t"]) == [b"B" * PAGE]
        client.batch_set([("u", b"u" * PAGE), ("v", b"v" * PAGE)])  # B evicted; SSD keeps A
        assert client.batch_get(["t"]) == [b"A" * PAGE]  # served, not dropped as corrupt
    finally:
        client.close()
        srv.stop()


def test_a_reply_that_does_not_add_up_is_a_miss_and_the_next_request_works(tmp_path):
    """A peer answering with a malformed reply (an old protocol, a bug) gives misses and no
    exception, and the next request to it starts on a fresh socket."""
    import json
    import threading

    endpoint = f"ipc://{tmp_path}/bad.sock"
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    replies = [[b'{"ok": true, "found": [true], "crc": [1]}', b"zz"],  # no "sums"
               [b"not json"],
               [json.dumps({"ok": True, "found": [False]}).encode()]]

    def serve():
        for reply in replies:
            ident, *_ = router.recv_multipart()
            router.send_multipart([ident, *reply])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    client = StoreClient([endpoint], None, timeout_ms=2000)  # the peer speaks without CURVE
    assert client.batch_get(["a"]) == [None]
    assert client.batch_exists(["a"]) == [False]
    assert client.batch_get(["a"]) == [None]
    t.join(timeout=10)
    client.close()
    router.close(0)


# ---- same-node shared-memory path -------------------------------------------------------
def _get_into(client: StoreClient, tids: list[str]) -> tuple[list[bool], list[bytes]]:
    dests = [memoryview(bytearray(PAGE)) for _ in tids]
    ok = client.batch_get_into(tids, dests)
    return ok, [bytes(d) for d in dests]


def test_same_node_reads_go_through_shared_memory_in_rounds(cluster):
    """A server that maps the reader's segment copies pages into it (no payload frames); a load
    bigger than the segment goes in rounds; the bytes are the stored ones."""
    writer = StoreClient([s.endpoint for s in cluster], TOKEN, shm=False)
    pages = _pages("m", 40)
    writer.batch_set(pages)
    reader = StoreClient([s.endpoint for s in cluster], TOKEN, shm_bytes=7 * PAGE)
    before = reader.channels.rpcs
    ok, got = _get_into(reader, [t for t, _ in pages] + ["absent"])
    assert ok == [True] * 40 + [False]
    assert got[:40] == [d for _, d in pages]
    assert reader.stats["shm_pages"] == 40
    assert reader.channels.rpcs - before >= 3 + 40 // 7  # 3 probes, then at least 6 rounds
    names = [seg.name for seg in reader.same_node.segments]
    reader.close()
    assert names and not any(Path("/dev/shm", n).exists() for n in names)  # unlinked on close
    writer.close()


def test_a_server_that_cannot_map_the_segment_is_read_over_the_socket(cluster, monkeypatch):
    writer = StoreClient([s.endpoint for s in cluster], TOKEN, shm=False)
    pages = _pages("n", 30)
    writer.batch_set(pages)

    def elsewhere(name):  # a server in another container / on another host
        raise FileNotFoundError(name)

    monkeypatch.setattr(cluster[0].segments, "mapping", elsewhere)
    reader = StoreClient([s.endpoint for s in cluster], TOKEN)
    ok, got = _get_into(reader, [t for t, _ in pages])
    assert all(ok) and got == [d for _, d in pages]
    assert reader.same_node.shm_ok == {cluster[0].endpoint: False, cluster[1].endpoint: True,
                              cluster[2].endpoint: True}
    owned_by_0 = len(cluster[0].engine.owned.entries)
    assert 0 < owned_by_0 < 30 and reader.stats["shm_pages"] == 30 - owned_by_0
    reader.close()
    writer.close()


def test_a_page_corrupted_in_the_segment_is_a_miss(cluster):
    writer = StoreClient([s.endpoint for s in cluster], TOKEN, shm=False)
    writer.batch_set(_pages("c", 6))
    for s in cluster:  # every remembered checksum is wrong: what lands in the segment is not
        for e in s.engine.owned.entries.values():  # what was verified
            e.checksum ^= 1
    reader = StoreClient([s.endpoint for s in cluster], TOKEN)
    ok, _ = _get_into(reader, [f"c{i}" for i in range(6)])
    assert ok == [False] * 6 and reader.stats["shm_pages"] == 6  # received, rejected
    reader.close()
    writer.close()


def _raw_asker(endpoint: str, token: str | None = TOKEN):
    """A bare socket to a server and ``ask(header) -> reply header`` (authenticated with
    ``token``)."""
    import json

    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    secure_client(raw, token)
    raw.connect(endpoint)

    def ask(header):
        raw.send_multipart([json.dumps(header).encode()])
        assert raw.poll(2000)
        return json.loads(raw.recv_multipart()[0])

    return raw, ask


def test_bad_segment_requests_are_rejected_and_the_server_keeps_serving(cluster):
    from sglang_pic.store.shm import ClientSegment

    srv = cluster[0]
    raw, ask = _raw_asker(srv.endpoint)

    seg = ClientSegment(4 * PAGE)
    try:
        shm = {"name": seg.name, "nonce": seg.nonce.hex(), "offsets": [64], "sizes": [PAGE]}
        assert "unavailable" in ask({"op": "get", "tids": ["a"],
                                     "shm": {**shm, "name": "../../etc/passwd"}})["error"]
        assert "unavailable" in ask({"op": "get", "tids": ["a"],
                                     "shm": {**shm, "name": "ptstore-none"}})["error"]
        assert "outside" in ask({"op": "get", "tids": ["a"],
                                 "shm": {**shm, "offsets": [4 * PAGE]}})["error"]
        assert "outside" in ask({"op": "get", "tids": ["a"], "shm": {**shm, "offsets": [0]}})[
            "error"]  # would overwrite the nonce
        assert "one offset" in ask({"op": "get", "tids": ["a", "b"], "shm": shm})["error"]
        assert "`$.shm.sizes[0]`" in ask({"op": "get", "tids": ["a"],
                                          "shm": {**shm, "sizes": [-1]}})["error"]
        assert "unknown field `shm`" in ask({"op": "exists", "tids": ["a"], "shm": shm})["error"]
        no_nonce = {k: v for k, v in shm.items() if k != "nonce"}
        assert "nonce" in ask({"op": "get", "tids": ["a"], "shm": no_nonce})["error"]
        assert "nonce" in ask({"op": "get", "tids": ["a"],
                               "shm": {**shm, "nonce": "zz" * 16}})["error"]
        assert ask({"op": "probe", "shm": {"name": seg.name, "nonce": "00" * 16}})["shm"] is False
        assert ask({"op": "probe", "shm": {"name": seg.name, "nonce": seg.nonce.hex()}})["shm"]
    finally:
        seg.close()
        raw.close(0)
    client = StoreClient([srv.endpoint], TOKEN)
    assert client.batch_set(_pages("ok", 2)) == 2 * PAGE  # still serving
    client.close()


def test_segments_of_killed_processes_are_reaped(tmp_path):
    """SGLang's schedulers are killed, never closed: their segments (tmpfs memory) must not
    accumulate. A segment whose creator is gone is unlinked by the next one created; a live
    process's segment is left alone, and a closed one is gone at once."""
    import os
    import signal
    import subprocess
    import sys

    from sglang_pic.store.shm import SHM_DIR, ClientSegment

    code = ("import time;"
            "from sglang_pic.store.shm import ClientSegment;"
            "s = ClientSegment(1 << 20); print(s.name, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=REPO)
    name = child.stdout.readline().strip()
    assert (SHM_DIR / name).exists()
    mine = ClientSegment(1 << 20)  # the child is alive: its segment stays
    assert (SHM_DIR / name).exists()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert (SHM_DIR / name).exists()  # nobody unlinked it on the way out
    other = ClientSegment(1 << 20)
    assert not (SHM_DIR / name).exists() and (SHM_DIR / mine.name).exists()
    for seg in (mine, other):
        seg.close()
        assert not seg.path.exists()


# ---- same node, host pool in shared memory: servers write into it ------------------------
def _memfd_pool(nbytes: int):
    import mmap
    import os

    fd = os.memfd_create("ptstore-test-pool")
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes)


def test_same_node_servers_write_straight_into_a_shared_host_pool(cluster):
    """With the destinations inside a memfd the reader names (SGLang's host pool with
    ``"allocator": "shm"``), same-node servers copy each page into its slot: the exact bytes,
    one request per server, nothing through the staging segment or the socket."""
    import os

    from sglang_pic.store.shm import address_of

    writer = StoreClient([s.endpoint for s in cluster], TOKEN, shm=False)
    pages = _pages("q", 30)
    writer.batch_set(pages)
    fd, mm = _memfd_pool(40 * PAGE)
    base = address_of(mm)
    reader = StoreClient([s.endpoint for s in cluster], TOKEN)
    reader.use_pool(fd, base, len(mm))
    assert reader.same_node.pool_ok == {s.endpoint: True for s in cluster}
    slots = [(7 * i + 3) % 40 for i in range(30)]  # scattered, as host-pool slots are
    dests = [memoryview(mm)[k * PAGE:(k + 1) * PAGE] for k in slots]
    before = reader.channels.rpcs
    ok = reader.batch_get_into([t for t, _ in pages] + ["absent"],
                               dests + [memoryview(bytearray(PAGE))],
                               [base + k * PAGE for k in slots] + [0])
    assert ok == [True] * 30 + [False]
    assert [bytes(d) for d in dests] == [d for _, d in pages]
    untouched = set(range(40)) - set(slots)
    assert all(mm[k * PAGE:(k + 1) * PAGE] == bytes(PAGE) for k in untouched)
    assert reader.stats["pool_pages"] == 30 and reader.stats["shm_pages"] == 0
    assert sum(s.pool_pages for s in cluster) == 30
    assert sum(s.status()["pool_pages"] for s in cluster) == 30
    # one get per owner; the page outside the pool probes the staging path (3) and asks its owner
    assert reader.channels.rpcs - before <= 3 + 3 + 1
    del dests
    reader.close()
    writer.close()
    mm.close()
    os.close(fd)


def test_a_page_corrupted_on_its_way_into_the_pool_is_a_miss(cluster):
    import os

    from sglang_pic.store.shm import address_of

    writer = StoreClient([s.endpoint for s in cluster], TOKEN, shm=False)
    writer.batch_set(_pages("z", 6))
    for s in cluster:
        for e in s.engine.owned.entries.values():
            e.checksum ^= 1
    fd, mm = _memfd_pool(6 * PAGE)
    base = address_of(mm)
    reader = StoreClient([s.endpoint for s in cluster], TOKEN)
    reader.use_pool(fd, base, len(mm))
    dests = [memoryview(mm)[k * PAGE:(k + 1) * PAGE] for k in range(6)]
    ok = reader.batch_get_into([f"z{i}" for i in range(6)], dests,
                               [base + k * PAGE for k in range(6)])
    assert ok == [False] * 6 and reader.stats["pool_pages"] == 0  # written, verified, rejected
    assert sum(s.pool_pages for s in cluster) == 0
    del dests
    reader.close()
    writer.close()
    mm.close()
    os.close(fd)


def test_bad_pool_requests_are_rejected_and_late_gets_write_nothing(cluster, tmp_path, caplog):
    """A pool must be a shared-memory file of the named process with the named identity;
    offsets stay inside it; a get past its ``until`` copies nothing (the reader has stopped
    waiting and may have reused the slots). The server keeps serving. Why a pool cannot be
    used goes to the server's debug log, never to the client (it would tell a tenant about
    the node's processes)."""
    import logging
    import os
    import time

    from sglang_pic.store.shm import pool_spec

    srv = cluster[0]
    writer = StoreClient([srv.endpoint], TOKEN, shm=False)
    writer.batch_set([("late", b"L" * PAGE)])
    raw, ask = _raw_asker(srv.endpoint)

    fd, mm = _memfd_pool(4 * PAGE)
    plain = os.open(tmp_path / "not-shm", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(plain, 4 * PAGE)
    try:
        spec = pool_spec(fd)
        get = {"op": "get", "tids": ["late"]}
        shm = {"pool": spec, "offsets": [0], "sizes": [PAGE], "until": time.monotonic() + 5}

        def err(**kw):
            return ask({**get, "shm": {**shm, **kw}})["error"]

        for bad, why in ((pool_spec(plain), "not a shared-memory file"),
                         ({**spec, "ino": spec["ino"] + 1}, "not the reader's pool"),
                         ({**spec, "pid": 2 ** 22 + 7}, "")):  # no such process
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="sglang_pic.store.server"):
                assert err(pool=bad) == "shm segment unavailable"
            assert why in caplog.text and "unavailable" in caplog.text
        assert "`$.shm.pool.fd`" in err(pool={**spec, "fd": "3"})
        assert "outside" in err(offsets=[4 * PAGE])
        assert "finite 'until'" in ask({**get, "shm": {"pool": spec, "offsets": [0],
                                                       "sizes": [PAGE]}})["error"]
        assert ask({"op": "probe", "shm": {"pool": pool_spec(plain)}})["shm"] is False
        assert ask({"op": "probe", "shm": {"pool": spec}})["shm"] is True
        assert "`$.shm.until`" in err(until=True)
        assert "malformed" in ask({**get, "shm": {**shm, "until": float("nan")}})["error"]
        assert "`$.shm.pool`" in err(pool="ptstore-y", name="ptstore-x")
        late = ask({**get, "shm": {**shm, "until": time.monotonic() - 1}})
        assert late["ok"] and late["found"] == [False] and mm[:PAGE] == bytes(PAGE)
        on_time = ask({**get, "shm": shm})
        assert on_time["found"] == [True] and mm[:PAGE] == b"L" * PAGE
    finally:
        raw.close(0)
        mm.close()
        os.close(fd)
        os.close(plain)
    assert writer.batch_set(_pages("ok", 2)) == 2 * PAGE  # still serving
    writer.close()


def test_a_server_without_a_token_writes_into_no_pool(tmp_path):
    """Anyone who reaches an unauthenticated server could name another process's memfd: such a
    server declines the pool path (readers fall back to staging) and refuses pool gets."""
    import os
    import time

    from sglang_pic.store.shm import pool_spec

    srv = StoreServer(StoreEngine(64 * PAGE), f"ipc://{tmp_path}/open.sock").start()
    fd, mm = _memfd_pool(PAGE)
    raw, ask = _raw_asker(srv.endpoint, None)
    try:
        reply = ask({"op": "probe", "shm": {"pool": pool_spec(fd)}})
        assert reply["shm"] is False and "token" in reply["reason"]
        got = ask({"op": "get", "tids": ["a"], "shm": {"pool": pool_spec(fd), "offsets": [0],
                                                       "sizes": [PAGE],
                                                       "until": time.monotonic() + 5}})
        assert "needs a server token" in got["error"]
    finally:
        raw.close(0)
        srv.stop()
        mm.close()
        os.close(fd)


def test_a_server_writes_only_into_pools_of_its_own_user(monkeypatch):
    import os

    from sglang_pic.store.shm import SegmentCache, pool_spec

    fd, mm = _memfd_pool(PAGE)
    try:
        spec = pool_spec(fd)
        assert len(SegmentCache().mapping(spec)[0]) == PAGE
        monkeypatch.setattr(os, "getuid", lambda: os.stat(f"/proc/{os.getpid()}").st_uid + 1)
        with pytest.raises(ValueError, match="another user"):
            SegmentCache().mapping(spec)
    finally:
        mm.close()
        os.close(fd)


def test_a_server_lets_go_of_the_pools_of_processes_that_are_gone():
    """A killed scheduler's host pool (tens of GB) is freed only once no server maps it."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from sglang_pic.store.shm import SegmentCache

    code = ("import json, os, time;"
            "from sglang_pic.store.shm import pool_spec;"
            "fd = os.memfd_create('pool'); os.ftruncate(fd, 1 << 20);"
            "print(json.dumps(pool_spec(fd)), flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=REPO)
    try:
        spec = json.loads(child.stdout.readline())
        cache = SegmentCache()
        assert len(cache.mapping(spec)[0]) == 1 << 20
        assert cache.reap() == 0 and len(cache.pools) == 1  # alive: kept
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert cache.reap() == 1 and not cache.pools


def test_a_load_whose_pool_writer_does_not_answer_waits_until_it_may_not_write(tmp_path):
    """SGLang reuses the slots of a failed load: the reader must not report the load before
    every server it asked to write into the pool is past its deadline (and the grace)."""
    import json
    import os
    import threading
    import time

    from sglang_pic.store.shm import address_of

    endpoint = f"ipc://{tmp_path}/silent.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    seen = []

    def serve():  # answers the probe, never the get
        for _ in range(2):
            ident, body = router.recv_multipart()
            header = json.loads(body)
            seen.append(header)
            if header["op"] == "probe":
                router.send_multipart([ident, b'{"ok": true, "shm": true}'])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    fd, mm = _memfd_pool(2 * PAGE)
    base = address_of(mm)
    client = StoreClient([endpoint], None, timeout_ms=200)  # the peer speaks without CURVE
    client.POOL_GRACE_S = 0.4
    client.use_pool(fd, base, len(mm))
    t0 = time.monotonic()
    ok = client.batch_get_into(["a"], [memoryview(mm)[:PAGE]], [base])
    waited = time.monotonic() - t0
    assert ok == [False]
    until = seen[1]["shm"]["until"]
    assert time.monotonic() >= until + 0.4 and waited >= 0.6
    t.join(timeout=5)
    client.close()
    router.close(0)
    mm.close()
    os.close(fd)


def test_a_put_is_freed_before_the_server_waits_for_the_next_request(tmp_path):
    """A put's frames are its pages. The server lets go of them once it has replied: holding
    them until the next request arrived made that request free them first (after a 1 GiB
    write-back, a lookup of the next prompt waited ~5-20 ms for it)."""
    import time
    import weakref

    srv = StoreServer(StoreEngine(64 * PAGE), f"ipc://{tmp_path}/free.sock", TOKEN)
    received: list[weakref.ref] = []
    recv = srv.sock.recv_multipart

    def recording(*args, **kwargs):
        frames = recv(*args, **kwargs)
        received.extend(weakref.ref(f) for f in frames)
        return frames

    srv.sock.recv_multipart = recording
    srv.start()
    client = StoreClient([srv.endpoint], TOKEN)
    try:
        assert client.batch_set([(f"p{i}", bytes([i]) * PAGE) for i in range(8)]) == 8 * PAGE
        assert received, "the server's receive was not recorded"
        deadline = time.monotonic() + 5
        while any(r() is not None for r in received) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(r() is None for r in received), "the put's frames outlive its reply"
        assert client.batch_get([f"p{i}" for i in range(8)])[3] == bytes([3]) * PAGE
    finally:
        client.close()
        srv.stop()


def test_byte_chunks_cut_in_order_within_the_limit():
    from sglang_pic.store.client import byte_chunks

    assert byte_chunks([0, 1, 2, 3, 4], [4, 4, 4, 9, 1], 8) == [[0, 1], [2], [3], [4]]
    assert byte_chunks([], [], 8) == []
    assert byte_chunks([7], [100], 8) == [[7]]  # larger than the limit: alone


def test_a_large_put_goes_in_chunks_and_a_failed_owner_fails_only_its_pages(tmp_path,
                                                                             monkeypatch):
    """A write-back larger than PUT_CHUNK_BYTES reaches its owner as several pipelined puts (the
    server answers other clients between them), every page stored; an owner that refuses one
    chunk fails that chunk's pages only (it answers the rest), and nothing of the other
    owner's."""
    import sglang_pic.store.client as client_mod

    monkeypatch.setattr(client_mod, "PUT_CHUNK_BYTES", 4 * PAGE)
    servers = [StoreServer(StoreEngine(256 * PAGE), f"ipc://{tmp_path}/c{i}.sock", TOKEN).start()
               for i in range(2)]
    client = StoreClient([s.endpoint for s in servers], TOKEN)
    try:
        items = [(f"k{i}", bytes([i]) * PAGE) for i in range(32)]
        before = [s.requests for s in servers]
        assert client.batch_set(items) == 32 * PAGE and client.last_failed == []
        owners = [client.ring.owner(t) for t, _ in items]
        for s, b in zip(servers, before, strict=True):
            pages = owners.count(s.endpoint)
            assert s.requests - b == -(-pages // 4)  # ceil: puts of at most 4 pages each
        assert client.batch_get([t for t, _ in items]) == [p for _, p in items]

        # the first owner refuses its second put: that put's pages and the rest of its own fail
        bad = servers[0]
        real, calls = bad._dispatch, []

        def refuse_second_put(header, payloads, *args):
            if header["op"] == "put":
                calls.append(header["tids"])
                if len(calls) == 2:
                    raise client_mod.zmq.ZMQError("refused")  # any error: the server's reply
            return real(header, payloads, *args)

        bad._dispatch = refuse_second_put
        # 12 pages on each owner (the ring's split depends on the endpoints' temporary paths):
        # three puts to the first owner, the second of them refused
        by_owner: dict[str, list[str]] = {s.endpoint: [] for s in servers}
        i = 0
        while min(len(v) for v in by_owner.values()) < 12:
            tid = f"m{i}"
            if len(by_owner[client.ring.owner(tid)]) < 12:
                by_owner[client.ring.owner(tid)].append(tid)
            i += 1
        more = [(t, bytes([n]) * PAGE) for n, t in enumerate(sum(by_owner.values(), []))]
        client.batch_set(more)
        mine = by_owner[bad.endpoint]
        assert len(calls) == 3
        second = {t.split("\0", 1)[-1] for t in calls[1]}
        assert len(second) == 4 and second <= set(mine)
        assert set(client.last_failed) == second  # the refused chunk only: the server went on
        assert not set(client.last_failed) & {t for t, _ in more if t not in mine}
    finally:
        client.close()
        for s in servers:
            s.stop()


def test_the_client_encrypts_on_its_own_io_threads_and_works_after_close(tmp_path):
    """One ZMQ I/O thread per server (up to ZMQ_IO_THREADS_MAX), on a context of the client's
    own (not the process-wide one, where one thread encrypted every server's puts); close ends
    it, and the client makes a new one if used again."""
    import zmq
    from sglang_pic.store.channels import ZMQ_IO_THREADS_MAX

    servers = [StoreServer(StoreEngine(64 * PAGE), f"ipc://{tmp_path}/t{i}.sock", TOKEN).start()
               for i in range(2)]
    client = StoreClient([s.endpoint for s in servers], TOKEN)
    try:
        assert client.batch_set([("a", b"x" * PAGE), ("b", b"y" * PAGE)]) == 2 * PAGE
        assert client.channels.ctx is not zmq.Context.instance()
        assert client.channels.ctx.get(zmq.IO_THREADS) == min(2, ZMQ_IO_THREADS_MAX)
        first = client.channels.ctx
        client.close()
        assert first.closed
        assert client.batch_exists(["a", "b", "c"]) == [True, True, False]
        assert client.channels.ctx is not first
    finally:
        client.close()
        for s in servers:
            s.stop()


_DROPPED_IN_A_CYCLE = """
import gc, sys
from sglang_pic.store.client import StoreClient
from sglang_pic.store.engine import StoreEngine
from sglang_pic.store.server import StoreServer

folder = sys.argv[1]
server = StoreServer(StoreEngine(1 << 20), f"ipc://{folder}/s.sock", "tok").start()
client = StoreClient([server.endpoint], "tok")
assert client.batch_set([("p", b"x" * 64)]) == 64
assert client.batch_get(["p"]) == [b"x" * 64]
client.me = client  # only the cycle collector can free it
idle = StoreServer(StoreEngine(1 << 20), f"ipc://{folder}/idle.sock", "tok")  # never started
idle.me = idle
del client, idle
gc.collect()
server.stop()
print("collected")
"""


def test_clients_and_servers_dropped_in_a_reference_cycle_are_collected(tmp_path):
    """A store client or server dropped without ``close``/``stop`` inside a reference cycle is
    collected: its sockets are closed and its ZMQ context terminated. Left to pyzmq, the
    collector finds the context's socket set already cleared and its ``term`` waits forever for
    the sockets, hanging whatever test the collection runs in. Run in a child process: a hang
    fails this test at its time-out instead of hanging the suite."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _DROPPED_IN_A_CYCLE, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "collected"
