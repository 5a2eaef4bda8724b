"""PTStore client: consistent-hash ownership over the servers, one batched RPC per owner.

A tensor id (page hash) is owned by the first server clockwise from its hash on a ring with
``vnodes`` virtual nodes per server. ``batch_get`` / ``batch_set`` / ``batch_exists`` group ids by
owner and send one message to each; the messages to all owners are sent before any reply is
awaited, so the owners serve one batch in parallel. A server that does not answer in time (down,
overloaded; the allowance is ``timeout_ms`` plus the bytes at ``min_gbps``) yields misses for
its ids - never an exception, never a wrong page: payloads whose checksum does not match are
dropped as misses too.

**Zero copy.** Payloads to store may be any buffer (a view of SGLang's host KV pool): zmq sends
them without copying. ``batch_get_into`` copies each received page once, straight into its
destination buffer (the host pool page), after checking it.

**Same node.** Servers on the reader's node (found by a ``probe`` that proves they map the
reader's shared-memory segment) return pages through that segment instead of the socket
(``shm``): the server copies, the reply carries checksums only. Loads go in rounds of at most
``shm_bytes``; other servers are asked over the socket in the first round. Where the reader's
destination buffers lie in a shared-memory file (``use_pool``: SGLang's host pool allocated with
``"allocator": "shm"``), same-node servers write the pages straight into them, all in one
round, and verify them there: the reader copies and hashes nothing. What this path knows and
holds (the probes' answers, the segments, the pool) is the client's ``same_node``
(``same_node.SameNodePlane``).

**Network data plane.** Pages from servers that are not on the reader's node (or every page,
with ``data_plane="tcp"``) travel over ``data_streams`` parallel TCP connections per server
(``datapath``): the get over CURVE returns checksums, lengths and one-time tickets, and
``batch_get_into`` receives each page straight into its destination, then hashes it there. A
server without a data listener (an ``ipc://`` endpoint, ``--no-data-plane``) answers over the
socket as before. ``data_tls`` asks for TLS streams only (a server without a certificate then
answers over the CURVE socket). Puts of at least ``TCP_PUT_MIN_BYTES`` to such a server go
the same way: the put over CURVE carries the pages' lengths and checksums, the server answers
with upload tickets, and the pages go over the streams (``datapath.upload``); a server that
declines (no listener, too much outstanding) gets them over the socket.

**Requests.** One batched request per owner goes over ``channels.ServerChannels``: a socket per
thread and server (CurveZMQ with a token: authenticated and encrypted, requests carry no
credentials), deadlines on every send and reply. A server that does not accept the token never
answers, so its pages are misses.

**Replication onto the reading node.** A client given ``local`` (the store server on its own node)
counts how often it reads each page from a remote owner; once a page has been read
``replicate_after`` times it is copied into the local server's *replica* cache (one batched put),
and later reads of it go to the local server first (the owner only on a local miss, e.g. after the
replica was evicted). Hot prefixes thus end up next to every instance that reads them, and keep
being served when their owner is down.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
import time
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from . import datapath
from .channels import ServerChannels
from .protocol import Buffer, Limits, checksum
from .same_node import SameNodePlane
from .shm import DATA_OFFSET, ClientSegment

Sink = Callable[[int, memoryview, int], None]
"""``sink(position, data, checksum)``: a page as received, with the checksum its server sent;
the sink verifies it (a mismatch is a miss)."""


PUT_CHUNK_BYTES = 8 << 20
"""The most one put request carries (whole pages; a larger page goes alone): the time another
client's lookup can wait behind a write-back on a store server."""


TCP_PUT_MIN_BYTES = 1 << 20
"""A put to one owner smaller than this goes over the CURVE socket even where the data plane
could carry it: one round trip, against a control message, a connection per stream and its
acknowledgement."""
TCP_PUT_CHUNK_BYTES = 256 << 20
"""The most one put over the data plane asks upload tickets for (the server reserves receive
buffers for the whole of it)."""


def byte_chunks(items: list[int], sizes: list[int], limit: int) -> list[list[int]]:
    """``items`` in order, cut into runs whose ``sizes`` add up to at most ``limit`` (an item
    larger than ``limit`` is a run of its own)."""
    runs: list[list[int]] = []
    total = limit + 1
    for item, size in zip(items, sizes, strict=True):
        if total + size > limit:
            runs.append([])
            total = 0
        runs[-1].append(item)
        total += size
    return runs


def _point(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, servers: list[str], vnodes: int = 64) -> None:
        self.ring = sorted((_point(f"{s}#{i}"), s) for s in servers for i in range(vnodes))
        self.keys = [k for k, _ in self.ring]

    def owner(self, tid: str) -> str:
        i = bisect.bisect(self.keys, _point(tid)) % len(self.ring)
        return self.ring[i][1]


# received zmq frames are read-only buffers, which torch.frombuffer warns about; they are only read
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class _PageWriter:
    """The sink of ``batch_get_into``: the pages of one round are verified together (on a thread
    pool) and copied into their destinations in one call (``torch._foreach_copy_``).

    Why batched: the client runs in SGLang's scheduler process, whose main thread holds the GIL
    most of the time. Every call that drops the GIL (a checksum, a copy) waits up to the
    interpreter's switch interval (5 ms) to get it back, so a checksum and a copy per page
    would make each page wait for the GIL twice."""

    def __init__(self, dests: list[memoryview]) -> None:
        self.dests = dests
        self.sizes = [memoryview(d).nbytes for d in dests]
        self.ok = [False] * len(dests)
        self.pending: list[tuple[int, Buffer, int]] = []

    def __call__(self, i: int, data: Buffer, s: int) -> None:
        if memoryview(data).nbytes == self.sizes[i]:  # a page of another shape is a miss
            self.pending.append((i, data, s))

    def placed(self, i: int) -> None:
        """Page ``i`` was written into its destination and verified there by a server."""
        self.ok[i] = True

    def flush(self) -> None:
        if not self.pending:
            return
        import torch

        sums = _parallel_checksums([d for _, d, _ in self.pending])
        good = [(i, d) for (i, d, s), got in zip(self.pending, sums, strict=True) if got == s]
        self.pending.clear()
        if not good:
            return
        src = [torch.frombuffer(d, dtype=torch.uint8) for _, d in good]
        dst = [torch.frombuffer(self.dests[i], dtype=torch.uint8) for i, _ in good]
        torch._foreach_copy_(dst, src)
        for i, _ in good:
            self.ok[i] = True


def _byte_view(buf) -> memoryview:
    """A flat, writable byte view of ``buf``."""
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _found_and_sums(header: dict, n: int) -> tuple[list, list] | None:
    """A get reply's ``found`` flags for ``n`` ids and one checksum per found page, or None when
    they do not add up (the reply is then a miss for all ``n``)."""
    found, sums = header.get("found"), header.get("sums")
    if (not isinstance(found, list) or not isinstance(sums, list) or len(found) != n
            or sum(map(bool, found)) != len(sums)):
        return None
    return found, sums


_HASH_WORKERS = min(8, os.cpu_count() or 1)
_HASH_POOL: ThreadPoolExecutor | None = None


def _hash_pool() -> ThreadPoolExecutor:
    """Checksum workers (XXH3 releases the GIL: pages hash in parallel)."""
    global _HASH_POOL
    if _HASH_POOL is None:
        _HASH_POOL = ThreadPoolExecutor(_HASH_WORKERS, thread_name_prefix="ptstore-hash")
    return _HASH_POOL


def _checksums(pages: list[Buffer]) -> list[int]:
    return [checksum(p) for p in pages]


HASH_INLINE_BYTES = 64 << 10
"""xxhash hashes a page up to this size without giving up the GIL: such a page costs the
calling thread its hashing time only, whatever else wants the interpreter."""
POOL_PAGES_PER_WORKER = 4
"""Pages over ``HASH_INLINE_BYTES`` per hash worker from which the workers hash a batch sooner
than the calling thread beside a busy scheduler thread (on 2 cores and 2 workers, 1 MiB pages:
8 pages take about as long either way, 2 pages 10 ms inline against 18 ms on the workers)."""


def _parallel_checksums(pages: list[Buffer]) -> list[int]:
    """``checksum`` of each page, on the hash workers when enough pages are large. Why not
    always in the calling thread: each hash of a large page releases the GIL and must take it
    back, which beside SGLang's busy scheduler thread waits up to the interpreter's switch
    interval; the workers' waits overlap (128 pages of 4 MiB: 0.51 s in one thread beside a busy
    one, 0.16 s on 8 workers, 13 ms alone). Few or small pages are hashed in the calling thread:
    handing them out would cost a wait for nothing. One task per worker, not per page."""
    large = sum(memoryview(p).nbytes > HASH_INLINE_BYTES for p in pages)
    if large < POOL_PAGES_PER_WORKER * _HASH_WORKERS:
        return _checksums(pages)
    step = -(-len(pages) // _HASH_WORKERS) or 1
    parts = _hash_pool().map(_checksums, [pages[k:k + step] for k in range(0, len(pages), step)])
    return [s for part in parts for s in part]


class StoreClient:
    TRACKED_PAGES = 1 << 20
    """Bound on the pages whose remote reads (or local replicas) the client remembers."""
    POOL_GRACE_S = 2.0
    """How long past a pool get's ``until`` the reader still waits before the load's slots may be
    reused: a server starts no page copy after ``until``, and one begun just before takes a
    millisecond; a server stalled longer than this in the middle of one page (stopped, swapping)
    is the residual risk. Only failed loads wait this long."""

    def __init__(self, servers: list[str], token: str | None = None, timeout_ms: int = 2000,
                 local: str | None = None, replicate_after: int = 2, min_gbps: float = 0.5,
                 shm: bool = True, shm_bytes: int = 256 << 20,
                 server_key: str | None = None, data_plane: str = "auto",
                 data_streams: int = 4, data_tls: bool = False,
                 limits: Limits | None = None):
        if not servers:
            raise ValueError("PTStore client needs at least one server endpoint")
        if data_plane not in datapath.MODES:
            raise ValueError(f"data_plane must be one of {', '.join(datapath.MODES)}, "
                             f"got {data_plane!r}")
        if not 1 <= data_streams <= 64:
            raise ValueError("data_streams must be within 1..64")
        if replicate_after < 1:
            raise ValueError("replicate_after must be >= 1")
        self.servers = list(servers)
        self.ring = HashRing(self.servers)
        self.channels = ServerChannels(self.servers, token, server_key, timeout_ms, min_gbps)
        self.page_bytes = 0  # the largest page seen: sizes the allowance of a get
        self.local = local
        self.replicate_after = replicate_after
        self._local = threading.local()  # .last_failed: this thread's
        # "tcp" and "zmq" move no page through shared memory
        self.same_node = SameNodePlane(self.channels, self.servers,
                                       shm and data_plane in ("auto", "shm"), shm_bytes)
        self.data_plane, self.data_streams, self.data_tls = data_plane, data_streams, data_tls
        self.limits = limits or Limits()
        # server -> host of its data listener (None: the socket only)
        self._tcp_host = {s: datapath.endpoint_host(s) if data_plane in ("auto", "tcp")
                          else None for s in self.servers}
        self.remote_reads: OrderedDict[str, int] = OrderedDict()
        self.replicated: OrderedDict[str, None] = OrderedDict()
        self.stats = {"replicated_pages": 0, "replica_hits": 0, "shm_pages": 0, "pool_pages": 0,
                      "tcp_pages": 0, "tcp_misses": 0, "tcp_put_pages": 0}

    @property
    def last_failed(self) -> list[str]:
        """Ids the last ``batch_set`` of this thread could not store, or the last
        ``batch_exists`` could not ask about (their owner did not answer)."""
        return getattr(self._local, "last_failed", [])

    def _by_owner(self, tids: list[str], owners: list[str] | None = None,
                  positions: list[int] | None = None) -> dict[str, list[int]]:
        """Positions of ``tids`` (all, or ``positions``) grouped by owner (``owners[i]``, or the
        ring's answer)."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i in range(len(tids)) if positions is None else positions:
            groups[owners[i] if owners is not None else self.ring.owner(tids[i])].append(i)
        return groups

    def batch_set(self, items: list[tuple[str, Buffer]], kind: str | None = None) -> int:
        """Store pages on their owners (``kind="replica"``: the replica cache of the local
        server); returns bytes the servers actually added (pages they already held add nothing).
        Ids whose owner failed are in ``self.last_failed`` (per thread).

        An owner with a data listener gets its pages over the data plane when they add up to
        ``TCP_PUT_MIN_BYTES`` or more (a control message per ``TCP_PUT_CHUNK_BYTES``, then the
        pages over its streams). Otherwise, and for what an owner declines to take that way, the
        pages travel inside CURVE puts: a server handles one request at a time, so one put of a
        whole write-back (1 GiB for 8K tokens of Llama-3-8B) would hold every other client's
        lookup behind it, and each owner gets its pages in puts of at most ``PUT_CHUNK_BYTES``,
        all sent before the first reply is awaited (pipelined)."""
        tids = [t for t, _ in items]
        sizes = [len(p) for _, p in items]
        groups = ({self.local: list(range(len(items)))} if kind == "replica"
                  else self._by_owner(tids))
        if items:
            self.page_bytes = max(self.page_bytes, max(sizes))
        sums = _parallel_checksums([p for _, p in items])
        extra = {"kind": kind} if kind else {}
        over_tcp: list[tuple[str, list[int]]] = []
        over_socket: list[tuple[str, list[int]]] = []
        for server, idx in groups.items():
            if self._tcp_host.get(server) is not None \
                    and sum(sizes[i] for i in idx) >= TCP_PUT_MIN_BYTES:
                over_tcp += [(server, c) for c in byte_chunks(idx, [sizes[i] for i in idx],
                                                              TCP_PUT_CHUNK_BYTES)]
            else:
                over_socket.append((server, idx))
        added, failed = 0, []
        uploads: list[tuple[datapath.Upload, list[int]]] = []
        if over_tcp:
            offers = self.channels.pipelined([(server, {
                "op": "put", "tids": [tids[i] for i in chunk], "sums": [sums[i] for i in chunk],
                "tcp": {"streams": self.data_streams, "lengths": [sizes[i] for i in chunk],
                        "tls": self.data_tls}, **extra}, None) for server, chunk in over_tcp], 0)
            for (server, chunk), reply in zip(over_tcp, offers, strict=True):
                offer = reply[0].get("tcp") if reply is not None and reply[0].get("ok") else None
                if reply is None:
                    failed += [tids[i] for i in chunk]
                elif offer is None or datapath.check_offer(
                        offer, [sizes[i] for i in chunk], self.data_streams) is not None:
                    over_socket.append((server, chunk))  # declined: over the CURVE socket
                else:
                    uploads.append((datapath.Upload(self._tcp_host[server], offer,
                                                    [items[i][1] for i in chunk]), chunk))
        if uploads:  # every owner's streams at once
            results = datapath.upload([u for u, _ in uploads], self.channels.deadline(
                sum(sizes[i] for _, c in uploads for i in c)))
            for (_, chunk), (n, ok) in zip(uploads, results, strict=True):
                added += n
                failed += [tids[i] for i, stored in zip(chunk, ok, strict=True) if not stored]
            self.stats["tcp_put_pages"] += sum(len(c) for _, c in uploads)
        requests, chunks = [], []
        for server, idx in over_socket:
            for chunk in byte_chunks(idx, [sizes[i] for i in idx], PUT_CHUNK_BYTES):
                requests.append((server, {"op": "put", "tids": [tids[i] for i in chunk],
                                          "sums": [sums[i] for i in chunk], **extra},
                                 [items[i][1] for i in chunk]))
                chunks.append(chunk)
        replies = self.channels.pipelined(requests, sum(sizes[i] for c in chunks for i in c)) \
            if requests else []
        for chunk, reply in zip(chunks, replies, strict=True):
            stored = reply[0].get("added_bytes") if reply is not None and reply[0].get("ok") \
                else None
            if isinstance(stored, int):
                added += stored
            else:
                failed += [tids[i] for i in chunk]
        self._local.last_failed = failed
        return added

    def prepare_shm(self) -> None:
        """Probe the servers for the same-node path now (``SameNodePlane.prepare``)."""
        self.same_node.prepare()

    def use_pool(self, fd: int, address: int, size: int) -> None:
        """Destinations in ``[address, address + size)`` are the shared-memory file ``fd`` of
        this process (SGLang's host pool with ``"allocator": "shm"``): servers on this node
        write pages there directly (``SameNodePlane.use_pool``)."""
        self.same_node.use_pool(fd, address, size)

    def _fetch(self, groups: dict[str, list[int]], tids: list[str],
               sink: Sink, nbytes: int | None = None,
               sizes: list[int] | None = None, addrs: list[int] | None = None) -> None:
        """Ask every owner for its ids (all requests out first) and hand each page received to
        ``sink(position, data, checksum)``; a reply that does not add up is a miss for its ids.
        With the pages' ``sizes`` known, same-node owners answer through a pooled segment, or
        (``addrs`` inside our pool) write straight into the destinations (``sink.placed``)."""
        pool = self.same_node.in_pool(groups, addrs, sizes)
        if pool:
            placed = {s: set(idx) for s, idx in pool.items()}
            groups = {s: [i for i in idx if i not in placed.get(s, ())]
                      for s, idx in groups.items()}
        rest = any(groups.values())
        seg = self.same_node.acquire() if sizes is not None and rest else None
        try:
            self._fetch_with(groups, tids, sink, nbytes, sizes, seg, pool, addrs)
        finally:
            self.same_node.release(seg)

    def _fetch_with(self, groups: dict[str, list[int]], tids: list[str],
                    sink: Sink, nbytes: int | None,
                    sizes: list[int] | None, seg: ClientSegment | None,
                    pool: dict[str, list[int]], addrs: list[int] | None) -> None:
        rounds: list[dict[str, list[tuple[int, int]]]] = []  # server -> [(position, offset)]
        if seg is not None:
            near = self.same_node.near(groups, seg)
            order = sorted((i, s) for s in near for i in groups[s])  # owners interleave by page
            used = seg.capacity
            for i, server in order:
                if sizes[i] > seg.capacity:
                    continue  # larger than the segment: over the socket
                if used + sizes[i] > seg.capacity:
                    rounds.append(defaultdict(list))
                    used = 0
                rounds[-1][server].append((i, used))
                used += sizes[i]
        in_shm = {i for r in rounds for items in r.values() for i, _ in items}
        sockets = {s: [i for i in idx if i not in in_shm] for s, idx in groups.items()}
        # the socket requests join the first round, except to a server already in it (one
        # request per server and round: its replies come back on one socket, in order)
        plan: list[dict[str, tuple[str, list]]] = [
            {server: ("shm", items) for server, items in r.items()} for r in rounds] or [{}]
        later: dict[str, tuple[str, list]] = {}
        for server, idx in sockets.items():
            if idx:
                (later if server in plan[0] else plan[0])[server] = ("socket", idx)
        if later:
            plan.append(later)
        for server, idx in pool.items():  # one request per server and step
            step = next((st for st in plan if server not in st), None)
            if step is None:
                step = {}
                plan.append(step)
            step[server] = ("pool", idx)
        count = sum(len(i) for i in groups.values()) + sum(len(i) for i in pool.values())
        budget = nbytes if nbytes is not None else self.page_bytes * count
        for step in plan:
            requests: dict[str, tuple[dict, None]] = {}
            deadline = until = self.channels.deadline(budget)  # monotonic: the node's shared clock
            for server, (how, items) in step.items():
                if how == "pool":
                    spec, base, _ = self.same_node.pool
                    requests[server] = ({"op": "get", "tids": [tids[i] for i in items],
                                         "shm": {"pool": spec,
                                                 "offsets": [addrs[i] - base for i in items],
                                                 "sizes": [sizes[i] for i in items],
                                                 "until": until}}, None)
                elif how == "shm":
                    requests[server] = ({"op": "get", "tids": [tids[i] for i, _ in items],
                                         "shm": {"name": seg.name, "nonce": seg.nonce.hex(),
                                                 "offsets": [DATA_OFFSET + o for _, o in items],
                                                 "sizes": [sizes[i] for i, _ in items]}}, None)
                else:
                    header = {"op": "get", "tids": [tids[i] for i in items]}
                    if self._tcp_host.get(server) is not None:
                        header["tcp"] = {"streams": self.data_streams,
                                         **({"sizes": [sizes[i] for i in items]}
                                            if sizes is not None else {}),
                                         **({"tls": True} if self.data_tls else {})}
                    requests[server] = (header, None)
            writers = [s for s, (how, _) in step.items() if how == "pool"]
            replies: dict = {}
            try:
                replies = self.channels.round_trips(
                    requests, budget, deadline + (self.POOL_GRACE_S if writers else 0.0))
            finally:
                if any(replies.get(s) is None for s in writers):
                    # a server may still be writing into slots SGLang will reuse once this
                    # load is reported: wait until no server may write any more
                    time.sleep(max(0.0, until + self.POOL_GRACE_S - time.monotonic()))
            transfers = []
            for server, (how, items) in step.items():
                reply = replies.get(server)
                if reply is None or not reply[0].get("ok"):
                    if how == "pool" and reply is not None:
                        # probe again before the next load
                        self.same_node.pool_ok.pop(server, None)
                    continue
                if how == "pool":
                    self._take_placed(reply, items, sink)
                elif how == "shm":
                    self._take_segment(reply, items, seg, sizes, sink)
                elif "tcp" in reply[0]:
                    transfer = self._tcp_transfer(server, reply[0], items, sink, sizes)
                    if transfer is not None:
                        transfers.append(transfer)
                else:
                    self._take_payloads(reply, items, sink)
            if transfers:
                self._run_transfers(transfers, sink)
            flush = getattr(sink, "flush", None)
            if flush is not None:  # before the next round reuses the segment
                flush()

    def _tcp_transfer(self, server: str, header: dict, idx: list[int], sink: Sink,
                      sizes: list[int] | None) -> tuple[datapath.Transfer, list[int]] | None:
        """The data-plane transfer a get reply offers, with the positions of its pages; None
        (every page a miss) when the reply does not add up: lengths that are not the sizes
        asked for, a page or a total over the limits, tickets that do not fit the pages."""
        checked = _found_and_sums(header, len(idx))
        lengths = header.get("lengths")
        if checked is None or not isinstance(lengths, list) or len(lengths) != len(checked[1]):
            return None
        found, sums = checked
        if not all(isinstance(n, int) and not isinstance(n, bool)
                   and 0 < n <= self.limits.max_tensor_bytes for n in lengths) \
                or sum(lengths) > self.limits.max_message_bytes \
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in sums):
            return None
        where = [i for i, present in zip(idx, found, strict=True) if present]
        if sizes is not None and any(sizes[i] != n for i, n in zip(where, lengths, strict=True)):
            return None
        if datapath.check_offer(header["tcp"], lengths, self.data_streams) is not None:
            return None
        dests = getattr(sink, "dests", None)
        if dests is not None:  # straight into the destinations (batch_get_into)
            views = [_byte_view(dests[i]) for i in where]
        else:
            views = [memoryview(bytearray(n)) for n in lengths]
        return datapath.Transfer(self._tcp_host[server], header["tcp"], views, sums), where

    def _run_transfers(self, transfers: list[tuple[datapath.Transfer, list[int]]],
                       sink: Sink) -> None:
        """Receive every offered page (all servers' streams at once) and hand the ones that
        arrived whole and verified to ``sink``."""
        nbytes = sum(len(v) for t, _ in transfers for v in t.views)
        results = datapath.fetch([t for t, _ in transfers], self.channels.deadline(nbytes))
        placed = getattr(sink, "placed", None)
        for (t, where), ok in zip(transfers, results, strict=True):
            for i, view, s, good in zip(where, t.views, t.sums, ok, strict=True):
                if not good:
                    self.stats["tcp_misses"] += 1
                    continue
                self.stats["tcp_pages"] += 1
                self.page_bytes = max(self.page_bytes, len(view))
                if placed is not None and getattr(sink, "dests", None) is not None:
                    placed(i)  # received and verified in its destination
                else:
                    sink(i, view, s)

    def _take_payloads(self, reply: tuple[dict, list], idx: list[int],
                       sink: Sink) -> None:
        header, payloads = reply
        checked = _found_and_sums(header, len(idx))
        if checked is None or len(checked[1]) != len(payloads):
            return
        found, sums = checked
        it = iter(zip(payloads, sums, strict=True))
        for i, present in zip(idx, found, strict=True):
            if present:
                data, s = next(it)
                self.page_bytes = max(self.page_bytes, len(data))
                sink(i, data, s)

    def _take_segment(self, reply: tuple[dict, list], items: list[tuple[int, int]],
                      seg: ClientSegment, sizes: list[int],
                      sink: Sink) -> None:
        checked = _found_and_sums(reply[0], len(items))
        if checked is None:
            return
        found, sums = checked
        it = iter(sums)
        for (i, off), present in zip(items, found, strict=True):
            if present:
                sink(i, seg.view(off, sizes[i]), next(it))
                self.stats["shm_pages"] += 1

    def _take_placed(self, reply: tuple[dict, list], idx: list[int], sink: Sink) -> None:
        """A pool get's reply: ``found`` pages were written and verified in place by the
        server (``"verified"``), so nothing is hashed here."""
        found = reply[0].get("found")
        if not reply[0].get("verified") or not isinstance(found, list) or len(found) != len(idx):
            return
        for i, present in zip(idx, found, strict=True):
            if present is True:
                sink.placed(i)
                self.stats["pool_pages"] += 1

    def batch_get(self, tids: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(tids)

        def keep(i: int, data: memoryview, s: int) -> None:
            if checksum(data) == s:
                out[i] = bytes(data)

        self._get(tids, keep, lambda i: out[i] is not None, lambda i: out[i])
        return out

    def batch_get_into(self, tids: list[str], dests: list[memoryview],
                       addrs: list[int] | None = None) -> list[bool]:
        """Read pages straight into ``dests`` (writable buffers of the pages' sizes; one copy
        each, after the checksum; ``addrs``: their addresses, which lets same-node servers write
        into those inside ``use_pool``'s file); True where the page was found whole."""
        writer = _PageWriter(dests)
        self._get(tids, writer, writer.ok.__getitem__, lambda i: dests[i],
                  nbytes=sum(writer.sizes), sizes=writer.sizes, addrs=addrs)
        return writer.ok

    def _get(self, tids: list[str], sink: Sink,
             have: Callable[[int], bool], data_of: Callable[[int], Buffer | None],
             nbytes: int | None = None, sizes: list[int] | None = None,
             addrs: list[int] | None = None) -> None:
        # each id is asked for once (a server refuses a get naming one twice); a repeat takes
        # its first's page
        firsts: dict[str, int] = {}
        repeats = [(j, firsts[t]) for j, t in enumerate(tids) if firsts.setdefault(t, j) != j]
        if self.local is not None:
            near = [i for i, t in enumerate(tids) if t in self.replicated and firsts[t] == i]
            if near:
                self._fetch({self.local: near}, tids, sink, nbytes, sizes, addrs)
                for i in near:
                    if not have(i):  # the replica was evicted: ask the owner again
                        self.replicated.pop(tids[i], None)
                    else:
                        self.stats["replica_hits"] += 1
        owners = [self.ring.owner(t) for t in tids]
        missing = [i for i in range(len(tids)) if not have(i) and firsts[tids[i]] == i]
        self._fetch(self._by_owner(tids, owners, missing), tids, sink, nbytes, sizes, addrs)
        if repeats:
            for j, i in repeats:
                if have(i):
                    page = data_of(i)
                    sink(j, memoryview(page), checksum(page))
            flush = getattr(sink, "flush", None)
            if flush is not None:
                flush()
        if self.local is not None:
            self._replicate_hot(tids, owners, [data_of(i) if have(i) else None
                                               for i in range(len(tids))])

    def _replicate_hot(self, tids: list[str], owners: list[str],
                       data: list[Buffer | None]) -> None:
        """Copy pages read often enough from remote owners into the local replica cache."""
        hot: list[tuple[str, Buffer]] = []
        for t, owner, d in zip(tids, owners, data, strict=True):
            if d is None or t in self.replicated or owner == self.local:
                continue
            n = self.remote_reads.pop(t, 0) + 1
            if n >= self.replicate_after:
                hot.append((t, d))
            else:
                self.remote_reads[t] = n
                if len(self.remote_reads) > self.TRACKED_PAGES:
                    self.remote_reads.popitem(last=False)
        if not hot:
            return
        self.batch_set(hot, kind="replica")
        if self.last_failed:
            return
        for t, _ in hot:
            self.replicated[t] = None
            if len(self.replicated) > self.TRACKED_PAGES:
                self.replicated.popitem(last=False)
        self.stats["replicated_pages"] += len(hot)

    def batch_exists(self, tids: list[str]) -> list[bool]:
        out = [False] * len(tids)
        groups = self._by_owner(tids)
        replies = self.channels.round_trips(
            {server: ({"op": "exists", "tids": [tids[i] for i in idx]}, None)
             for server, idx in groups.items()}, 0)
        failed = []
        for server, idx in groups.items():
            reply = replies.get(server)
            found = reply[0].get("found") if reply is not None and reply[0].get("ok") else None
            if isinstance(found, list) and len(found) == len(idx):
                for i, f in zip(idx, found, strict=True):
                    out[i] = bool(f)
            else:
                failed += [tids[i] for i in idx]
        self._local.last_failed = failed
        return out

    def leading_found(self, tids: list[str]) -> int:
        """How many of ``tids``, from the first, the store holds. SGLang's question before a
        prefetch: its page ids are chained hashes, so a page can only be a hit when every page
        before it is one. The first id is asked alone first: a prefix the store lacks (every
        cold prompt) then costs one small round trip to one owner, instead of a round trip to
        every owner carrying every id, while the request waits; a hit pays that round trip
        more, before a load of megabytes."""
        if not tids or not self.batch_exists(tids[:1])[0]:
            return 0
        rest = self.batch_exists(tids[1:]) if len(tids) > 1 else []
        return 1 + next((i for i, f in enumerate(rest) if not f), len(rest))

    def status(self, server: str) -> dict | None:
        reply = self.channels.call(server, {"op": "status"})
        return reply[0].get("status") if reply else None

    def close(self) -> None:
        self.channels.close()
        self.same_node.close()
        self._local = threading.local()
