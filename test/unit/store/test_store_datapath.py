"""PTStore's TCP data plane (``sglang_pic.store.datapath``): pages over K parallel connections
opened with one-time tickets, received straight into their destinations and verified there.

Every fault (a peer that dies mid-transfer, a stalled transfer, a page corrupted after the
transport, sizes over the limits, wrong / reused / expired tickets) must end in misses for the
affected pages, never in wrong bytes or a hang. Servers bind port 0; timeouts are generous for
a busy 2-core machine, and every wait is bounded.
"""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import free_port
from sglang_pic.store import datapath
from sglang_pic.store.client import StoreClient
from sglang_pic.store.datapath import DataPlaneConfig, DataServer, Transfer, split
from sglang_pic.store.engine import StoreEngine
from sglang_pic.store.protocol import Limits, checksum
from sglang_pic.store.server import DEFAULT_DATA_PLANE, StoreServer

TOKEN = "datapath-test-token-0123456789"
PAGE = 64 << 10


def _pages(prefix: str, n: int, size: int = PAGE) -> list[tuple[str, bytes]]:
    return [(f"{prefix}{i}", os.urandom(size)) for i in range(n)]


def _server(data_plane: DataPlaneConfig | None = DEFAULT_DATA_PLANE, **kw) -> StoreServer:
    return StoreServer(
        StoreEngine(256 << 20), f"tcp://127.0.0.1:{free_port()}", TOKEN, data_plane=data_plane, **kw
    ).start()


@pytest.fixture
def servers():
    srvs = [_server() for _ in range(2)]
    yield srvs
    for s in srvs:
        s.stop()


def _eventually(check, timeout_s: float = 10.0) -> bool:
    """``check()`` became true within ``timeout_s`` (counters the server bumps in its own
    threads)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _get_into(
    client: StoreClient, tids: list[str], size: int = PAGE
) -> tuple[list[bool], list[bytes]]:
    buf = bytearray(size * len(tids))
    mv = memoryview(buf)
    ok = client.batch_get_into(tids, [mv[i * size : (i + 1) * size] for i in range(len(tids))])
    return ok, [bytes(mv[i * size : (i + 1) * size]) for i in range(len(tids))]


def test_many_pages_travel_over_k_streams_into_the_buffer_verified(servers):
    client = StoreClient([s.endpoint for s in servers], TOKEN, data_plane="tcp", data_streams=4)
    pages = _pages("p", 120)
    assert client.batch_set(pages) == 120 * PAGE
    before = client.channels.rpcs
    ok, got = _get_into(client, [t for t, _ in pages])
    assert all(ok) and got == [d for _, d in pages]
    assert client.channels.rpcs - before == 2  # one control message per owner, pages over the streams
    assert client.stats["tcp_pages"] == 120 and client.stats["tcp_misses"] == 0
    # each owner served its share over 4 connections, and sent exactly the pages' bytes (the
    # servers count a stream once its last send returned: maybe after the reader has it all)
    assert _eventually(lambda: [s.data.stats["streams"] for s in servers] == [4, 4])
    assert sum(s.data.stats["stream_bytes"] for s in servers) == 120 * PAGE
    # the copying interface too, and a miss in the middle stays a miss
    tids = [pages[0][0], "absent", pages[7][0]]
    assert client.batch_get(tids) == [pages[0][1], None, pages[7][1]]
    # nothing stays held once the streams are done
    deadline = time.monotonic() + 10
    while any(s.data._pending_bytes or s.data._connections for s in servers):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.close()


def test_the_data_plane_serves_from_a_listening_descriptor_past_1024():
    """``sglang-pic store`` raises its open-file limit far past 1024; the data listener's
    accept loop used ``select``, which refuses such descriptors, and then ended without a word
    (gets fell back to the socket)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no descriptor past 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    held = []
    try:
        while not held or held[-1] < 1100:  # the listener is opened past them
            held.append(os.open(os.devnull, os.O_RDONLY))
        srv = _server()
    finally:
        for fd in held:
            os.close(fd)
    client = StoreClient([srv.endpoint], TOKEN, data_plane="tcp", data_streams=2)
    try:
        assert srv.data.sock.fileno() > 1024
        pages = _pages("far", 8)
        assert client.batch_set(pages) == 8 * PAGE
        ok, got = _get_into(client, [t for t, _ in pages])
        assert all(ok) and got == [d for _, d in pages]
        assert client.stats["tcp_pages"] == 8
    finally:
        client.close()
        srv.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_split_covers_every_page_once_balanced_by_bytes():
    for lengths, k in [([5] * 10, 4), ([100, 1, 1, 1, 1], 2), ([7], 4), ([3, 9, 1, 8, 2], 3)]:
        ranges = split(lengths, k)
        assert len(ranges) == min(k, len(lengths)) and all(c > 0 for _, c in ranges)
        assert [i for f, c in ranges for i in range(f, f + c)] == list(range(len(lengths)))
    assert split([5] * 8, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]


def test_auto_reads_a_server_without_a_data_plane_over_the_socket():
    srv = _server(data_plane=None)
    try:
        client = StoreClient([srv.endpoint], TOKEN, data_plane="auto", shm=False)
        pages = _pages("s", 6)
        client.batch_set(pages)
        ok, got = _get_into(client, [t for t, _ in pages])
        assert all(ok) and got == [d for _, d in pages]
        assert client.stats["tcp_pages"] == 0
        # a reader that insists on TLS is answered over the CURVE socket by a plain-TCP server
        tls_only = StoreClient([srv.endpoint], TOKEN, data_plane="tcp", data_tls=True)
        assert tls_only.batch_get([pages[0][0]]) == [pages[0][1]]
        assert tls_only.stats["tcp_pages"] == 0
    finally:
        srv.stop()


def _ticket_of(offer: dict, k: int = 0) -> bytes:
    return bytes.fromhex(offer["tickets"][k])


def _read_all(port: int, ticket: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(ticket)
        out = bytearray()
        while chunk := s.recv(1 << 16):
            out += chunk
        return bytes(out)


@pytest.fixture
def data_server():
    srv = DataServer(DataPlaneConfig(ticket_ttl_s=0.5, io_timeout_s=2.0), "127.0.0.1")
    yield srv
    srv.close()


def test_a_ticket_opens_one_connection_only(data_server):
    pages = [os.urandom(1000), os.urandom(3000)]
    offer = data_server.offer("alice", pages, 1)
    ticket = _ticket_of(offer)
    assert _read_all(offer["port"], ticket) == b"".join(pages)
    assert _read_all(offer["port"], ticket) == b""  # reused: closed without a byte


def test_wrong_and_expired_tickets_are_refused_without_a_byte(data_server):
    pages = [os.urandom(2000)]
    port = data_server.port
    # a ticket that names a live offer with the wrong secret burns the offer
    offer = data_server.offer("alice", pages, 1)
    good = _ticket_of(offer)
    wrong = good[: datapath.SLOT_BYTES] + bytes(len(good) - datapath.SLOT_BYTES)
    assert _read_all(port, wrong) == b""
    assert _read_all(port, good) == b""
    # unknown, short and expired tickets
    assert _read_all(port, os.urandom(datapath.TICKET_BYTES)) == b""
    assert _read_all(port, b"short") == b""
    late = _ticket_of(data_server.offer("alice", pages, 1))
    time.sleep(0.8)  # ttl 0.5 s
    assert _read_all(port, late) == b""
    assert data_server.stats["refused"] >= 4 and data_server.stats["streams"] == 0
    assert data_server._pending_bytes == 0  # nothing held for refused or expired tickets


def _fake_peer(script: str) -> tuple[subprocess.Popen, int]:
    """A data server in its own process running ``script`` on the accepted connection ``conn``
    (after reading the 32-byte ticket); returns the process and its port."""
    code = textwrap.dedent("""
        import os, signal, socket, sys, time
        PAGES = [bytes([i]) * int(sys.argv[1]) for i in range(int(sys.argv[2]))]
        lsock = socket.create_server(("127.0.0.1", 0))
        print(lsock.getsockname()[1], flush=True)
        conn, _ = lsock.accept()
        conn.settimeout(30)
        ticket = b""
        while len(ticket) < 32:
            ticket += conn.recv(32 - len(ticket))
    """) + textwrap.dedent(script)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(PAGE), "8"], stdout=subprocess.PIPE, text=True
    )
    port = int(proc.stdout.readline())
    return proc, port


def _fake_transfer(port: int, pages: int = 8, corrupt: int | None = None) -> Transfer:
    data = [bytes([i]) * PAGE for i in range(pages)]
    sums = [checksum(d) for d in data]
    if corrupt is not None:
        sums[corrupt] ^= 1
    offer = {"port": port, "tickets": [os.urandom(32).hex()], "cert": None}
    return Transfer("127.0.0.1", offer, [memoryview(bytearray(PAGE)) for _ in data], sums)


def test_a_peer_killed_mid_transfer_gives_misses_for_what_it_did_not_send():
    # three pages and half of the fourth, then the process kills itself
    proc, port = _fake_peer("""
        for p in PAGES[:3]:
            conn.sendall(p)
        conn.sendall(PAGES[3][:len(PAGES[3]) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    try:
        t = _fake_transfer(port)
        t0 = time.monotonic()
        ok = datapath.fetch([t], time.monotonic() + 30)[0]
        assert time.monotonic() - t0 < 20  # ended by the peer's death, not the deadline
        assert ok == [True] * 3 + [False] * 5
        assert all(bytes(v) == bytes([i]) * PAGE for i, v in enumerate(t.views[:3]))
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_peer_that_resets_mid_transfer_keeps_the_pages_it_sent_whole():
    proc, port = _fake_peer("""
        import struct
        for p in PAGES[:3]:
            conn.sendall(p)
        time.sleep(0.5)  # the reader has taken them
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # RST, not FIN
        time.sleep(30)
    """)
    try:
        ok = datapath.fetch([_fake_transfer(port)], time.monotonic() + 30)[0]
        assert ok == [True] * 3 + [False] * 5
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_stalled_transfer_times_out_into_misses():
    proc, port = _fake_peer("""
        conn.sendall(PAGES[0])
        conn.sendall(PAGES[1][:100])
        time.sleep(60)
    """)
    try:
        t = _fake_transfer(port)
        t0 = time.monotonic()
        ok = datapath.fetch([t], time.monotonic() + 1.5)[0]
        took = time.monotonic() - t0
        assert 1.0 < took < 10, took
        assert ok == [True] + [False] * 7
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_page_corrupted_on_the_wire_is_a_miss():
    # the peer flips one byte of page 2; the checksums came over CURVE, intact
    proc, port = _fake_peer("""
        for i, p in enumerate(PAGES):
            conn.sendall(p if i != 2 else b"\\xff" + p[1:])
        conn.close()
    """)
    try:
        ok = datapath.fetch([_fake_transfer(port)], time.monotonic() + 30)[0]
        assert ok == [True, True, False] + [True] * 5
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_page_corrupted_after_the_transport_is_a_miss_end_to_end(servers, monkeypatch):
    client = StoreClient([s.endpoint for s in servers], TOKEN, data_plane="tcp")
    pages = _pages("c", 20)
    client.batch_set(pages)
    receive = datapath._receive_plain
    hit = []

    def corrupting(sock, views, deadline, on_whole=None):  # a byte of a page flips as it lands
        def flip_then_verify(i):
            if i == 0 and not hit:
                hit.append(bytes(views[0]))
                views[0][0] ^= 0xFF
            on_whole(i)

        return receive(sock, views, deadline, on_whole=flip_then_verify)

    monkeypatch.setattr(datapath, "_receive_plain", corrupting)
    ok, got = _get_into(client, [t for t, _ in pages])
    assert ok.count(False) == 1 and client.stats["tcp_misses"] == 1
    bad = ok.index(False)
    assert hit[0] == pages[bad][1]
    assert all(g == d for g, (_, d), good in zip(got, pages, ok, strict=True) if good)
    client.close()


def test_a_server_killed_mid_load_gives_misses_and_the_reader_goes_on(tmp_path):
    """A store server process dies while the reader is loading from it: the pages it owned are
    misses, the other server's arrive, within the load's deadline."""
    env = dict(os.environ, SGLANG_PIC_STORE_TOKEN=TOKEN)
    procs, endpoints = [], []
    for _ in range(2):
        ep = f"tcp://127.0.0.1:{free_port()}"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "sglang_pic", "store", "--endpoint", ep, "--memory-gb", "1"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        endpoints.append(ep)
    try:
        client = StoreClient(endpoints, TOKEN, timeout_ms=20_000, data_plane="tcp")
        deadline = time.monotonic() + 60
        while any(client.status(ep) is None for ep in endpoints):
            assert time.monotonic() < deadline, "store servers did not start"
        # 32 MiB per stream of the victim: far more than its sockets' buffers hold, so its
        # death cuts streams short (bytes already buffered still arrive after a kill)
        pages = _pages("k", 64, 4 << 20)
        assert client.batch_set(pages) == 256 << 20
        victim = procs[0]
        receive = datapath._receive_plain

        def slow_then_kill(sock, views, deadline, on_whole=None):  # the owner dies mid-load
            if victim.poll() is None:
                victim.kill()
                victim.wait(timeout=10)
            return receive(sock, views, deadline, on_whole)

        datapath._receive_plain = slow_then_kill
        try:
            t0 = time.monotonic()
            ok, got = _get_into(client, [t for t, _ in pages], 4 << 20)
            assert time.monotonic() - t0 < 30
        finally:
            datapath._receive_plain = receive
        owned = [client.ring.owner(t) == endpoints[0] for t, _ in pages]
        assert any(owned) and not all(owned)
        # whatever arrived is exact; the dead owner's pages are (mostly) misses - a stream it
        # had sent before dying may still be read from the socket buffer, and is verified
        assert all(g == d for g, (_, d), good in zip(got, pages, ok, strict=True) if good)
        assert all(good for good, mine in zip(ok, owned, strict=True) if not mine)
        assert not all(ok)
        client.close()
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_oversize_lengths_are_refused_before_any_byte_is_read(servers):
    client = StoreClient([servers[0].endpoint], TOKEN, data_plane="tcp")
    pages = _pages("o", 4)
    client.batch_set(pages)
    small = StoreClient(
        [servers[0].endpoint], TOKEN, data_plane="tcp", limits=Limits(max_tensor_bytes=PAGE // 2)
    )
    assert small.batch_get([t for t, _ in pages]) == [None] * 4
    total = StoreClient(
        [servers[0].endpoint], TOKEN, data_plane="tcp", limits=Limits(max_message_bytes=3 * PAGE)
    )
    assert total.batch_get([t for t, _ in pages]) == [None] * 4
    assert servers[0].data.stats["streams"] == 0  # no connection was opened for them
    # sizes the reader did not ask for are not sent at all
    ok, _ = _get_into(client, [t for t, _ in pages], PAGE * 2)
    assert ok == [False] * 4
    # a reply whose lengths disagree with the sizes asked for is refused as a whole
    assert (
        datapath.check_offer({"port": 1, "tickets": ["00" * 32] * 5, "cert": None}, [PAGE] * 4, 4)
        is not None
    )
    for c in (client, small, total):
        c.close()


def test_a_server_over_its_pending_bytes_sends_the_pages_over_the_socket():
    """The data plane's budget for outstanding offers is the server's, whoever holds it: a get
    over it is answered over the CURVE socket, with its pages, not with misses."""
    srv = _server(data_plane=DataPlaneConfig(max_pending_bytes=PAGE * 3))
    try:
        client = StoreClient([srv.endpoint], TOKEN, data_plane="tcp")
        pages = _pages("b", 4)
        client.batch_set(pages)
        assert client.batch_get([t for t, _ in pages]) == [d for _, d in pages]
        assert srv.data.stats["declined"] == 1 and srv.data.stats["offers"] == 0
        assert client.batch_get([t for t, _ in pages[:2]]) == [d for _, d in pages[:2]]
        assert srv.data.stats["offers"] == 1  # within the budget: the data plane
        client.close()
    finally:
        srv.stop()


# ---- puts over the data plane ----------------------------------------------------------


def test_puts_travel_over_the_streams_and_are_stored_verified(servers):
    client = StoreClient([s.endpoint for s in servers], TOKEN, data_plane="tcp", data_streams=4)
    pages = _pages("u", 120)  # 7.5 MiB: each owner's share is over TCP_PUT_MIN_BYTES
    before = client.channels.rpcs
    assert client.batch_set(pages) == 120 * PAGE and client.last_failed == []
    assert client.channels.rpcs - before == 2  # one control message per owner, no page inside one
    assert client.stats["tcp_put_pages"] == 120
    # (a server counts an upload once its acknowledgement is sent: maybe after the writer read it)
    assert _eventually(lambda: [s.data.stats["uploads"] for s in servers] == [4, 4])
    assert sum(s.data.stats["upload_bytes"] for s in servers) == 120 * PAGE
    assert sum(s.engine.stats["bytes_in"] for s in servers) == 120 * PAGE
    ok, got = _get_into(client, [t for t, _ in pages])
    assert all(ok) and got == [d for _, d in pages]
    # stored again: the servers add nothing, and say so
    assert client.batch_set(pages) == 0 and client.last_failed == []
    assert _eventually(lambda: not any(s.data._pending_bytes or s.data._connections
                                       for s in servers))
    # a small put goes inside one CURVE message
    small = _pages("small", 3, 1024)
    client.batch_set(small)
    assert client.stats["tcp_put_pages"] == 240
    assert client.batch_get([t for t, _ in small]) == [d for _, d in small]
    client.close()


def test_large_uploaded_pages_are_kept_as_mappings_and_read_back_by_every_path(servers):
    """Pages of at least ``MMAP_PAGE_BYTES`` arrive over the data plane into mappings of their
    own (their page faults taken with the GIL released); the store hands them out like any
    page: over the streams, inside zmq replies, and copied into a same-node segment."""
    size = datapath.MMAP_PAGE_BYTES
    pages = _pages("m", 6, size)
    tids = [t for t, _ in pages]
    writer = StoreClient([s.endpoint for s in servers], TOKEN, data_plane="tcp", data_streams=2)
    assert writer.batch_set(pages) == 6 * size and writer.stats["tcp_put_pages"] == 6
    kept = [e.data for s in servers for key, e in s.engine.owned.entries.items()
            if key.endswith(tuple(f"\0{t}" for t in tids))]  # keys are the tenant's and the id
    assert len(kept) == 6 and all(isinstance(d, mmap.mmap) for d in kept)
    for plane, stat in (("tcp", "tcp_pages"), ("zmq", None), ("shm", "shm_pages")):
        reader = StoreClient([s.endpoint for s in servers], TOKEN, data_plane=plane)
        ok, got = _get_into(reader, tids, size)
        assert all(ok) and got == [d for _, d in pages], plane
        assert stat is None or reader.stats[stat] == 6, (plane, reader.stats)
        reader.close()
    writer.close()


def test_a_put_the_server_declines_goes_over_the_socket():
    srv = _server(data_plane=DataPlaneConfig(max_pending_bytes=PAGE * 3))  # no room for 1 MiB
    try:
        client = StoreClient([srv.endpoint], TOKEN, data_plane="tcp")
        pages = _pages("d", 32)  # 2 MiB
        assert client.batch_set(pages) == 32 * PAGE and client.last_failed == []
        assert srv.data.stats["refused"] == 1 and srv.data.stats["uploads"] == 0
        assert client.stats["tcp_put_pages"] == 0
        assert client.batch_get([t for t, _ in pages[:2]]) == [d for _, d in pages[:2]]
        client.close()
    finally:
        srv.stop()


class _Stored:
    """An upload offer's ``store`` callback that records what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[bytes]]] = []

    def __call__(self, positions: list[int], pages: list[bytes]) -> int:
        self.calls.append((positions, pages))
        return sum(len(p) for p in pages)


def _send_upload(port: int, ticket: bytes, data: bytes, ack_bytes: int,
                 close_write: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(ticket + data)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        out = bytearray()
        while len(out) < ack_bytes and (chunk := s.recv(1 << 16)):
            out += chunk
        return bytes(out)


def test_an_upload_page_corrupted_on_the_way_is_not_stored(data_server):
    pages = [os.urandom(1000), os.urandom(3000), os.urandom(500)]
    stored = _Stored()
    offer = data_server.offer_upload("alice", [len(p) for p in pages],
                                     [checksum(p) for p in pages], 1, stored)
    bad = bytearray(pages[1])
    bad[7] ^= 1
    ack = _send_upload(offer["port"], _ticket_of(offer), pages[0] + bytes(bad) + pages[2], 8 + 3)
    assert ack == (1500).to_bytes(8, "little") + bytes([1, 0, 1])
    assert stored.calls == [([0, 2], [pages[0], pages[2]])]
    assert data_server.stats["upload_bad_pages"] == 1
    assert _eventually(lambda: data_server._pending_bytes == 0 == data_server._connections)


def test_an_upload_cut_short_stores_only_its_whole_pages(data_server):
    pages = [os.urandom(1000), os.urandom(3000)]
    stored = _Stored()
    offer = data_server.offer_upload("alice", [1000, 3000], [checksum(p) for p in pages], 1,
                                     stored)
    ack = _send_upload(offer["port"], _ticket_of(offer), pages[0] + pages[1][:100], 8 + 2)
    assert ack == (1000).to_bytes(8, "little") + bytes([1, 0])
    assert stored.calls == [([0], [pages[0]])]
    # stalled instead of closed (io_timeout_s 2 s): the same, and the buffers are let go
    stored2 = _Stored()
    offer = data_server.offer_upload("alice", [1000, 3000], [checksum(p) for p in pages], 1,
                                     stored2)
    ack = _send_upload(offer["port"], _ticket_of(offer), pages[0][:10], 8 + 2, close_write=False)
    assert ack == bytes(8) + bytes([0, 0]) and stored2.calls == []
    assert _eventually(lambda: data_server._pending_bytes == 0 == data_server._connections)


def test_upload_tickets_split_over_streams_and_open_one_connection_each(data_server):
    pages = [os.urandom(2000) for _ in range(6)]
    stored = _Stored()
    offer = data_server.offer_upload("alice", [2000] * 6, [checksum(p) for p in pages], 3, stored)
    assert len(offer["tickets"]) == 3
    results = datapath.upload([datapath.Upload("127.0.0.1", offer, pages)],
                              time.monotonic() + 10)
    assert results == [(12000, [True] * 6)]
    assert sorted(i for positions, _ in stored.calls for i in positions) == list(range(6))
    # the tickets are spent: a second upload with the same offer stores nothing
    assert datapath.upload([datapath.Upload("127.0.0.1", offer, pages)],
                           time.monotonic() + 10) == [(0, [False] * 6)]
    assert _eventually(lambda: data_server.stats["uploads"] == 3)
    assert data_server.stats["refused"] == 3


def test_a_put_over_the_data_plane_is_checked_before_tickets_are_issued(servers):
    from sglang_pic.store.protocol import encode

    srv = servers[0]

    def reply(header: dict, payloads=None) -> dict:
        import json

        return json.loads(srv.handle([memoryview(f) for f in encode(header, payloads)])[0])

    put = {"op": "put", "tids": ["a", "b"], "sums": [1, 2],
           "tcp": {"streams": 2, "lengths": [10, 20]}}
    assert reply(put)["tcp"]["tickets"]
    assert "no payload" in reply(put, [b"x" * 10, b"y" * 20])["error"]
    assert "one length per tensor id" in reply({**put, "tcp": {"streams": 2,
                                                               "lengths": [10]}})["error"]
    big = srv.limits.max_tensor_bytes + 1
    assert "too large" in reply({**put, "tcp": {"streams": 2, "lengths": [10, big]}})["error"]
    assert "one checksum" in reply({**put, "sums": [1]})["error"]
    # TLS asked of a plain listener: put over the socket
    assert reply({**put, "tcp": {"streams": 2, "lengths": [10, 20], "tls": True}})["tcp"] is None


def test_uploads_land_in_their_tenant_only():
    other = "datapath-other-tenant-token-987654"
    srv = StoreServer(StoreEngine(256 << 20), f"tcp://127.0.0.1:{free_port()}",
                      {TOKEN: "alice", other: "bob"}).start()
    try:
        alice = StoreClient([srv.endpoint], TOKEN, data_plane="tcp")
        bob = StoreClient([srv.endpoint], other, data_plane="tcp", server_key=srv.server_key)
        pages = _pages("t", 20)  # 1.25 MiB: over the data plane
        assert alice.batch_set(pages) == 20 * PAGE and alice.stats["tcp_put_pages"] == 20
        assert bob.batch_get([t for t, _ in pages]) == [None] * 20
        assert alice.batch_get([t for t, _ in pages]) == [d for _, d in pages]
        alice.close()
        bob.close()
    finally:
        srv.stop()


def _self_signed(tmp_path) -> tuple[str, str] | None:
    if shutil.which("openssl") is None:
        return None
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            "/CN=ptstore-test",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


def test_tls_streams_with_a_pinned_certificate(tmp_path):
    material = _self_signed(tmp_path)
    if material is None:
        pytest.skip("no openssl CLI to make a certificate")
    cert, key = material
    srv = _server(data_plane=DataPlaneConfig(tls_cert=cert, tls_key=key))
    try:
        client = StoreClient([srv.endpoint], TOKEN, data_plane="tcp", data_tls=True)
        pages = _pages("t", 20)
        client.batch_set(pages)  # 1.25 MiB: up over TLS streams too
        assert client.stats["tcp_put_pages"] == 20
        assert _eventually(lambda: srv.data.stats["uploads"] == 4)
        pages = pages[:10]
        ok, got = _get_into(client, [t for t, _ in pages])
        assert all(ok) and got == [d for _, d in pages]
        assert client.stats["tcp_pages"] == 10
        assert _eventually(lambda: srv.data.stats["streams"] == 4)
        # a certificate other than the pinned one: every page a miss
        offer = srv.data.offer("", [d for _, d in pages[:2]], 1)
        offer["cert"] = "0" * 64
        views = [memoryview(bytearray(PAGE)) for _ in range(2)]
        t = Transfer("127.0.0.1", offer, views, [checksum(d) for _, d in pages[:2]])
        assert datapath.fetch([t], time.monotonic() + 10)[0] == [False, False]
        client.close()
    finally:
        srv.stop()


def test_the_hicache_backend_takes_the_data_plane_from_its_config(servers, monkeypatch):
    pytest.importorskip("sglang")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang_pic.store.hicache_backend import PTStoreHiCacheStorage

    monkeypatch.setenv("SGLANG_PIC_PTSTORE_TOKEN", TOKEN)

    def backend(**extra):
        cfg = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            enable_storage_metrics=False,
            is_mla_model=False,
            is_page_first_layout=True,
            model_name="m",
            extra_config={"servers": [s.endpoint for s in servers], **extra},
        )
        return PTStoreHiCacheStorage(cfg)

    b = backend(data_plane="tcp", data_streams=2)
    assert (b.client.data_plane, b.client.data_streams, b.client.same_node.enabled) == ("tcp", 2, False)
    b.close()
    with pytest.raises(ValueError, match="data_plane"):
        backend(data_plane="rdma")


def test_fetch_returns_by_its_deadline_with_many_silent_peers():
    """Streams that never get a byte (a listener that accepts and says nothing) all end at the
    deadline, in parallel: a load never hangs on its data plane."""
    lsock = socket.create_server(("127.0.0.1", 0))
    held = []
    stop = threading.Event()

    def accept():
        lsock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(lsock.accept()[0])
            except OSError:
                continue

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        port = lsock.getsockname()[1]
        transfers = [_fake_transfer(port) for _ in range(6)]
        for t in transfers:
            t.offer["tickets"] = [os.urandom(32).hex() for _ in range(4)]
        t0 = time.monotonic()
        out = datapath.fetch(transfers, time.monotonic() + 1.5)
        assert time.monotonic() - t0 < 10
        assert all(not any(ok) for ok in out)
    finally:
        stop.set()
        th.join(timeout=5)
        for c in held:
            c.close()
        lsock.close()


def test_a_stream_that_fails_oddly_is_a_miss_after_every_stream_has_ended(servers, monkeypatch):
    """An unexpected error in one stream must not end the load while other streams still write
    into the destinations (which the load then reports, and SGLang reuses)."""
    client = StoreClient([servers[0].endpoint], TOKEN, data_plane="tcp", data_streams=4)
    pages = _pages("e", 16)
    client.batch_set(pages)
    receive = datapath._receive_plain
    calls, ended = [], []

    def flaky(sock, views, deadline, on_whole=None):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("odd")
        time.sleep(0.3)  # the others finish well after the failing one
        got = receive(sock, views, deadline, on_whole)
        ended.append(time.monotonic())
        return got

    monkeypatch.setattr(datapath, "_receive_plain", flaky)
    ok, got = _get_into(client, [t for t, _ in pages])
    returned = time.monotonic()
    assert len(ended) == 3 and all(e <= returned for e in ended)
    assert ok.count(False) == 4  # the failing stream's pages (16 pages over 4 streams)
    assert all(g == d for g, (_, d), good in zip(got, pages, ok, strict=True) if good)
    client.close()


# ---- the TTFT benchmark's bookkeeping (benchmark/store/bench_store_ttft.py) ----------------
def _bench():
    import importlib
    return importlib.import_module("benchmark.store.bench_store_ttft")


def test_the_ttft_benchmark_fits_prefixes_in_the_context_and_reads_its_load_trace():
    b = _bench()
    params = {**b.PARAMS, "lengths": [8192, 32768, 131072]}
    assert [b.prefix_tokens(n, params) for n in params["lengths"]] == [8192, 32768, 130944]
    assert b.page_bytes(str(b.REPO / "benchmark/models/llama3-8b"), 64) == 8 << 20
    text = (
        "[ptstore-trace] batch_exists at 10.000: 128 pages, 128 hits, 2.0 ms\n"
        "[ptstore-trace] batch_get_v1 at 10.010: 128 pages, 128 hits, 50.5 ms\n"
        "noise\n[ptstore-trace] batch_get_v1 at 10.070: 64 pages, 60 hits, 30.0 ms\n"
        "[ptstore-trace] batch_get_v1 at 99.000: 1 pages, 1 hits, 1.0 ms\n"
    )
    trace = b.parse_trace(text)
    assert len(trace) == 3
    assert b.loads_in(trace, 9.95, 10.2) == (188, 80.5)
    # where a request's TTFT went: asked the store at +2 ms, loaded from +10 to +100 ms
    phases = b.phases_in(b.parse_trace(text, b.TRACE_EXISTS), trace, 9.998, 0.142)
    assert phases == {"lookup_ms": 2.0, "to_load_ms": 12.0, "loading_ms": 90.0,
                      "after_load_ms": 40.0}
    assert b.phases_in([], trace, 50.0, 1.0) is None
    done = "[ptstore-trace] prefetch_done at 10.105: 8192 tokens\n"
    taken = [float(t) for t, _ in b.TRACE_DONE.findall(text + done)]
    split = b.phases_in(b.parse_trace(text, b.TRACE_EXISTS), trace, 9.998, 0.142, taken)
    assert split["to_take_ms"] == 5.0 and split["after_take_ms"] == 35.0
    # what each reader asks of the backend
    base = {"servers": ["tcp://127.0.0.1:1"], "data_streams": 4}
    tcp = b.extra_config("sglang-pic-ptstore-tcp", base)
    assert tcp["data_plane"] == "tcp" and "allocator" not in tcp and tcp["data_streams"] == 4
    assert b.extra_config("sglang-pic-ptstore-socket", base)["data_plane"] == "zmq"
    assert b.extra_config("sglang-pic-ptstore", base)["allocator"] == "shm"
    assert b.extra_config("sglang-pic-ptstore-staging", base)["data_plane"] == "shm"
    assert "sglang-pic-ptstore-tcp" in b.VARIANTS
    fast = b.extra_config("sglang-pic-ptstore-tcp-fastgil", base)
    assert fast["data_plane"] == "tcp" and fast["gil_switch_ms"] == 0.5
