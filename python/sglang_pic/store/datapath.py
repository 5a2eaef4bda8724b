"""PTStore's network data plane: pages of a get over K parallel TCP connections.

The control plane stays zmq + CurveZMQ (``auth``, ``protocol``): a get that asks for the data
plane (``"tcp": {"streams": K}``) is answered over CURVE with the pages' lengths and XXH3
checksums and K one-time **tickets**; the reader then opens K TCP connections to the server's
data listener, sends one ticket on each, and receives that stream's pages straight into their
destinations (``recvmsg_into`` with ``MSG_WAITALL``: one system call, and one wait for the GIL,
for up to ``IOV_PAGES`` pages). There is no framing on the wire: a stream is the concatenation of
its pages, in the order ``split`` assigns them, so both sides know every byte's place from the
reply header alone. The server sends each page from the bytes it stores (``sendall`` of the
stored object, no copy in Python).

**Puts** travel the same way in the other direction: a put that asks for the data plane
(``"tcp": {"streams": K, "lengths": [...]}``, the pages' XXH3 checksums in its header) is answered
with K upload tickets; the writer sends each stream's pages after its ticket, the server receives
them into buffers reserved when it issued the tickets, stores each page that arrived whole and
matches the checksum sent over CURVE, and answers on the stream with the bytes it added and one
byte per page (1: stored). A page cut short or corrupted is not stored; the writer counts it as
failed, as a put that got no reply.

**Tickets.** 32 random bytes: an 8-byte slot that names the offer and a 24-byte secret compared
with ``hmac.compare_digest``. A ticket exists only in the memory of the server process that
issued it, opens exactly the pages of the request that issued it (pages of that request's
tenant, recorded with the offer), is redeemed at most once (its slot is removed on the first
attempt, right or wrong), and expires ``ticket_ttl_s`` after issue. A connection that has not
finished its TLS handshake (with TLS) and presented a valid ticket ``io_timeout_s`` after it
was accepted - however it trickles its bytes - is closed without a byte sent.

**Integrity and confidentiality.** Plain TCP by default: the checksums travel over the
authenticated, encrypted CURVE channel and every page is hashed where it landed, so a page
corrupted on the way (or a stream cut short) is a miss, never wrong KV. That is integrity against
corruption, not against an attacker on the path: XXH3 is not a MAC (a page with a given XXH3 can
be computed), and the pages are readable by anyone who can see the traffic. For networks that
are not private, configure a certificate and key (``tls_cert`` / ``tls_key``): streams are then
TLS 1.3 (Python ``ssl``), the reply carries the certificate's SHA-256, which the reader pins (no
CA involved), and the ticket travels inside TLS.

**Faults.** Every wait is bounded: connecting, the TLS handshake and every receive stop at the
load's deadline; a server waits at most ``io_timeout_s`` for a ticket or for the reader to take
more bytes. A stream that ends early or stalls past the deadline yields misses for the pages it
did not deliver whole, and a page whose checksum does not match is a miss; pages received whole
and verified stay hits. The reader writes into its destinations only itself, inside ``fetch``, so
once ``fetch`` returns nothing writes there any more.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import mmap
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from .protocol import Buffer, checksum

logger = logging.getLogger(__name__)

TICKET_BYTES = 32
SLOT_BYTES = 8
IOV_PAGES = 512  # buffers per recvmsg_into call (Linux allows 1024)
MODES = ("auto", "tcp", "shm", "zmq")
"""A reader's data plane: ``auto`` - same-node servers through shared memory, the others over
TCP; ``tcp`` - every page over TCP (no shared memory); ``shm`` - same-node servers through shared
memory, the others over the zmq socket; ``zmq`` - every page over the zmq socket."""


@dataclass(frozen=True)
class DataPlaneConfig:
    """A server's data listener. ``host`` None: the host of the server's control endpoint
    (``tcp://127.0.0.1:7400`` binds loopback, ``tcp://0.0.0.0:7400`` every interface)."""

    host: str | None = None
    port: int = 0  # 0: any free port (readers learn it from the reply)
    tls_cert: str | None = None
    tls_key: str | None = None
    ticket_ttl_s: float = 10.0
    io_timeout_s: float = 10.0
    max_streams: int = 16
    max_offers: int = 4096  # outstanding tickets
    max_connections: int = 64
    # page bytes held for outstanding tickets and streams (upload buffers are reserved in full
    # when their tickets are issued); a StoreServer lowers it to PENDING_FRACTION of its
    # engine's memory budget (``within_memory``)
    max_pending_bytes: int = 16 << 30


PENDING_FRACTION = 0.25
"""The share of a server's memory budget (``--memory-gb``) that transfers in flight may hold:
upload buffers are memory the page caches do not see, so without a bound tied to the budget a
store of 0.1 GB held 3.1 GB of stalled uploads."""


def within_memory(config: DataPlaneConfig, memory_bytes: int) -> DataPlaneConfig:
    """``config`` with ``max_pending_bytes`` at most ``PENDING_FRACTION`` of ``memory_bytes``
    (a server whose budget is that memory then holds at most a quarter more for transfers)."""
    cap = max(0, int(PENDING_FRACTION * memory_bytes))
    if config.max_pending_bytes <= cap:
        return config
    return replace(config, max_pending_bytes=cap)


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://host:port`` zmq endpoint (``*`` is every interface), else None."""
    if not endpoint.startswith("tcp://"):
        return None
    try:
        host = urlsplit(endpoint).hostname
    except ValueError:
        return None
    if host in (None, ""):
        return None
    return "0.0.0.0" if host == "*" else host


def split(lengths: Sequence[int], streams: int) -> list[tuple[int, int]]:
    """The pages each stream carries, as ``(first, count)`` ranges in page order, balanced by
    bytes: both sides compute it from the reply header, so nothing on the wire names a page.
    At most ``streams`` ranges, none empty."""
    n = len(lengths)
    streams = max(1, min(streams, n))
    total = sum(lengths)
    out, first, sent = [], 0, 0
    for k in range(streams):
        if first >= n:
            break
        if k == streams - 1:
            out.append((first, n - first))
            break
        goal = total * (k + 1) / streams
        last = first + 1  # at least one page per range
        sent += lengths[first]
        while last < n - (streams - k - 1) and sent + lengths[last] / 2 <= goal:
            sent += lengths[last]
            last += 1
        out.append((first, last - first))
        first = last
    return out


# ---- server -------------------------------------------------------------------------------


@dataclass
class _Upload:
    """What an upload ticket lets its connection send: pages of ``lengths`` (positions
    ``first ..`` of the put), each kept only if it matches its checksum in ``sums``, then given
    to ``store(positions, pages)``, which returns the bytes the store added."""

    first: int
    lengths: list[int]
    sums: list[int]
    store: Callable[[list[int], list[Buffer]], int]


@dataclass
class _Offer:
    secret: bytes
    tenant: str  # whose get issued it: the pages are that tenant's
    pages: list  # the stream's pages (bytes), in wire order; empty for an upload
    nbytes: int  # bytes held for it: the pages sent, or the receive buffers of an upload
    expires: float  # monotonic
    upload: _Upload | None = None


class DataServer:
    """A store server's data listener: ``offer`` issues tickets for pages (called by the
    control loop), one thread per data connection sends them."""

    def __init__(self, config: DataPlaneConfig, host: str) -> None:
        self.config = config
        self.tls: ssl.SSLContext | None = None
        self.cert_sha256: str | None = None
        if bool(config.tls_cert) != bool(config.tls_key):
            raise ValueError("the data plane's TLS needs both a certificate and a key")
        if config.tls_cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            ctx.load_cert_chain(config.tls_cert, config.tls_key)
            with open(config.tls_cert) as f:
                der = ssl.PEM_cert_to_DER_cert(f.read())
            self.tls, self.cert_sha256 = ctx, hashlib.sha256(der).hexdigest()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, config.port), family=family, backlog=128)
        self.port = self.sock.getsockname()[1]
        self._offers: dict[bytes, _Offer] = {}
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._connections = 0
        self.stats = {
            "offers": 0,
            "streams": 0,
            "stream_bytes": 0,
            "refused": 0,
            "expired": 0,
            "dropped": 0,
            "uploads": 0,  # upload streams received to their end
            "upload_bytes": 0,  # bytes of pages received whole
            "upload_bad_pages": 0,  # received whole but not matching their checksum
            "declined": 0,  # gets over the budget for outstanding offers: sent over the socket
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="ptstore-data", daemon=True)
        self._thread.start()

    # -- control side --
    def offer(self, tenant: str, pages: list, streams: int) -> dict | None:
        """Tickets for ``pages`` (bytes, in the reply's order) split over at most ``streams``
        connections: ``{"port", "tickets": [hex], "cert": hex | None}``; None when the server
        holds too much for outstanding transfers already (the server then sends the pages over
        the socket)."""
        lengths = [len(p) for p in pages]
        ranges = split(lengths, min(streams, self.config.max_streams)) if pages else []
        return self._issue(tenant, [(pages[first : first + count],
                                     sum(lengths[first : first + count]), None)
                                    for first, count in ranges])

    def offer_upload(self, tenant: str, lengths: list[int], sums: list[int], streams: int,
                     store: Callable[[list[int], list[Buffer]], int]) -> dict | None:
        """Upload tickets for a put of pages of ``lengths`` (checksums ``sums``) over at most
        ``streams`` connections, in ``offer``'s reply form; ``store(positions, pages)`` keeps
        the verified pages of each stream (positions in the put). None when the receive
        buffers would take the server past ``max_pending_bytes`` (the writer then puts over the
        socket)."""
        ranges = split(lengths, min(streams, self.config.max_streams)) if lengths else []
        return self._issue(tenant, [([], sum(lengths[first : first + count]), _Upload(
            first, lengths[first : first + count], sums[first : first + count], store))
            for first, count in ranges])

    def _issue(self, tenant: str, parts: list[tuple[list, int, _Upload | None]]) -> dict | None:
        """One ticket per stream ``(pages to send, bytes held, upload)``, or None (counted as
        refused) when they would take the server past its outstanding offers or bytes."""
        nbytes = sum(size for _, size, _ in parts)
        now = time.monotonic()
        tickets = []
        with self._lock:
            self._expire(now)
            if (
                len(self._offers) + len(parts) > self.config.max_offers
                or self._pending_bytes + nbytes > self.config.max_pending_bytes
            ):
                self.stats["refused"] += 1
                return None
            for pages, size, upload in parts:
                slot = os.urandom(SLOT_BYTES)
                while slot in self._offers:
                    slot = os.urandom(SLOT_BYTES)
                secret = os.urandom(TICKET_BYTES - SLOT_BYTES)
                self._offers[slot] = _Offer(
                    secret, tenant, pages, size, now + self.config.ticket_ttl_s, upload
                )
                tickets.append((slot + secret).hex())
            self._pending_bytes += nbytes
            self.stats["offers"] += 1
        return {"port": self.port, "tickets": tickets, "cert": self.cert_sha256}

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:  # counters are bumped from every connection's thread
            self.stats[key] += n

    def _expire(self, now: float) -> None:
        """Drop offers past their time (under the lock)."""
        dead = [s for s, o in self._offers.items() if o.expires < now]
        for s in dead:
            self._pending_bytes -= self._offers.pop(s).nbytes
        self.stats["expired"] += len(dead)

    def _redeem(self, ticket: bytes) -> _Offer | None:
        """The offer of ``ticket``, removed: a ticket opens one connection at most, and a
        wrong secret burns its slot too. None for an unknown, wrong or expired ticket."""
        if len(ticket) != TICKET_BYTES:
            return None
        with self._lock:
            offer = self._offers.pop(ticket[:SLOT_BYTES], None)
            if offer is None:
                return None
            if (
                not hmac.compare_digest(offer.secret, ticket[SLOT_BYTES:])
                or offer.expires < time.monotonic()
            ):
                self._pending_bytes -= offer.nbytes
                return None
        return offer

    # -- data side --
    def _accept_loop(self) -> None:
        last_sweep = time.monotonic()
        # poll, not select: select refuses descriptors past 1024, and the store raises its
        # open-file limit far beyond (``cli._raise_open_files``)
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_sweep > 1.0:
                with self._lock:
                    self._expire(now)
                last_sweep = now
            try:
                ready = poller.poll(200)
            except OSError:
                return
            if not ready:
                continue
            if ready[0][1] & select.POLLNVAL:
                return  # closed
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with self._lock:
                full = self._connections >= self.config.max_connections
                if not full:
                    self._connections += 1
            if full:
                self._count("dropped")
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="ptstore-data-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        offer = None
        sent = 0
        try:
            conn.settimeout(self.config.io_timeout_s)  # each wait of the TLS handshake
            # the TLS handshake and the ticket within one deadline: a receive's timeout starts
            # again with every byte, so a peer trickling them would hold a connection slot
            until = time.monotonic() + self.config.io_timeout_s
            watchdog = _Watchdog(conn, until)
            try:
                if self.tls is not None:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                ticket = bytearray(TICKET_BYTES)
                try:
                    whole = _recv_until(conn, memoryview(ticket), until,
                                        self.config.io_timeout_s)
                except OSError:  # reset, or shut by the watchdog
                    whole = False
            finally:
                watchdog.cancel()
            conn.settimeout(self.config.io_timeout_s)  # every send within this (the ticket's
            # receive left a shorter one)
            if not whole:
                self._count("refused")
                return
            offer = self._redeem(bytes(ticket))
            if offer is None:
                self._count("refused")
                return  # closed without a byte sent
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if offer.upload is not None:
                self._receive_upload(conn, offer.upload)
                return
            for page in offer.pages:
                conn.sendall(page)
                sent += len(page)
            self._count("streams")
        except (OSError, ssl.SSLError):
            self._count("dropped")  # the reader went away or stopped reading
        finally:
            with self._lock:
                self.stats["stream_bytes"] += sent
                self._connections -= 1
                if offer is not None:
                    self._pending_bytes -= offer.nbytes
            try:
                conn.close()
            except OSError:
                pass

    def _receive_upload(self, conn: socket.socket, up: _Upload) -> None:
        """An upload stream: its pages into fresh buffers (within ``io_timeout_s`` per wait and
        ``io_timeout_s`` plus the pages at ``UPLOAD_MIN_BPS`` in all, so a writer trickling
        bytes cannot hold the buffers), the verified ones stored, then the acknowledgement."""
        until = time.monotonic() + self.config.io_timeout_s + sum(up.lengths) / UPLOAD_MIN_BPS
        good: list[int] = []
        pages: list[Buffer] = []
        received = 0
        try:
            for i, n in enumerate(up.lengths):
                buf = _upload_buffer(n)
                if not _recv_until(conn, memoryview(buf), until, self.config.io_timeout_s):
                    break  # the writer closed or stalled: what arrived whole stays
                received += n
                if checksum(buf) == up.sums[i]:
                    good.append(i)
                    pages.append(buf if isinstance(buf, mmap.mmap) else bytes(buf))
                else:
                    self._count("upload_bad_pages")
                del buf
        finally:
            added = up.store([up.first + i for i in good], pages) if good else 0
            del pages
            self._count("upload_bytes", received)
        flags = bytearray(len(up.lengths))
        for i in good:
            flags[i] = 1
        conn.settimeout(self.config.io_timeout_s)  # the last receive may have left it short
        conn.sendall(struct.pack("<Q", added) + bytes(flags))
        self._count("uploads")

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass
        self._thread.join(timeout=5)
        with self._lock:
            self._offers.clear()
            self._pending_bytes = 0


class _Watchdog:
    """Shuts a connection down at a monotonic deadline unless cancelled first: a blocked
    receive (a TLS handshake's among them) then returns. It holds a duplicate of the socket,
    since TLS takes the original over; a shutdown acts on the connection, whatever its fd."""

    def __init__(self, conn: socket.socket, until: float) -> None:
        self._dup = conn.dup()
        self._timer = threading.Timer(max(0.0, until - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        try:
            self._dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def cancel(self) -> None:
        self._timer.cancel()
        self._timer.join()  # a shutdown under way ends before its socket is closed
        self._dup.close()


UPLOAD_MIN_BPS = 50e6
"""The slowest an upload stream may send, on average, before the server gives up on the rest
of its pages (and their buffers)."""


MMAP_PAGE_BYTES = 1 << 20
"""Uploaded pages of at least this size are received into memory of their own
(``_upload_buffer``)."""


def _upload_buffer(n: int) -> bytearray | mmap.mmap:
    """A buffer for an uploaded page of ``n`` bytes, which the store keeps once verified.

    Why an anonymous mapping for large pages: every kept page is fresh memory, and its page
    faults are most of what receiving it costs. A ``bytearray`` takes them zero-filling itself
    while its thread holds the GIL, so the connections' threads queued behind each other
    (uploads of 4 MiB pages ran at 0.7 GiB/s on loopback on a 2-core machine, 1.9 GiB/s into
    reused buffers); a mapping takes them inside ``recv_into``, with the GIL released (1.2
    GiB/s). Small pages stay ``bytes``: a mapping per page would be a kernel mapping each."""
    return mmap.mmap(-1, n) if n >= MMAP_PAGE_BYTES else bytearray(n)


def _recv_until(sock, mv: memoryview, until: float, wait_s: float) -> bool:
    """Fill ``mv`` from ``sock`` by the monotonic ``until``, each wait at most ``wait_s``;
    False if the peer closed or the time ran out."""
    got = 0
    while got < len(mv):
        left = until - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(min(wait_s, left))
        try:
            n = sock.recv_into(mv[got:])
        except TimeoutError:
            return False
        if not n:
            return False
        got += n
    return True


def recv_exact(sock, mv: memoryview) -> bool:
    """Fill ``mv`` from ``sock`` (its own timeout bounds each wait); False if the peer closed."""
    got = 0
    while got < len(mv):
        n = sock.recv_into(mv[got:])
        if not n:
            return False
        got += n
    return True


# ---- reader -------------------------------------------------------------------------------


def check_offer(offer, lengths: Sequence[int], streams: int) -> str | None:
    """Why a server's ``"tcp"`` reply cannot be used (None: it can): a port, and one ticket of
    64 hex digits per stream of ``split(lengths, ...)``, at most ``streams``."""
    if not isinstance(offer, dict):
        return "not an offer"
    port, tickets, cert = offer.get("port"), offer.get("tickets"), offer.get("cert")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return "bad port"
    if not isinstance(tickets, list) or not all(
        isinstance(t, str) and len(t) == 2 * TICKET_BYTES for t in tickets
    ):
        return "bad tickets"
    try:
        for t in tickets:
            bytes.fromhex(t)
    except ValueError:
        return "bad tickets"
    want = len(split(lengths, min(streams, len(tickets)))) if lengths else 0
    if len(tickets) != want or len(tickets) > streams:
        return "tickets do not match the pages"
    if cert is not None and not (isinstance(cert, str) and len(cert) == 64):
        return "bad certificate digest"
    return None


def _timeval(seconds: float) -> bytes:
    sec = max(0.001, seconds)
    return struct.pack("ll", int(sec), int((sec % 1) * 1e6))


def _set_rcvtimeo(sock: socket.socket, seconds: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


_ADDRESSES: dict[tuple[str, int], tuple] = {}  # (host, port) -> getaddrinfo's first answer


def _connect_blocking(host: str, port: int, seconds: float) -> socket.socket:
    """A connected blocking socket whose sends and receives (and the connect itself: Linux
    applies ``SO_SNDTIMEO`` to it) wait at most ``seconds``. Blocking, because every system
    call of a socket with a Python timeout is two (a ``poll``, then the call), and each lets go
    of the GIL, which in SGLang's scheduler process costs up to 5 ms to get back; the address
    is resolved once per server."""
    addr = _ADDRESSES.get((host, port))
    if addr is None:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[
            0
        ]
        if len(_ADDRESSES) > 1024:
            _ADDRESSES.clear()
        addr = _ADDRESSES[(host, port)] = (family, kind, proto, sockaddr)
    family, kind, proto, sockaddr = addr
    sock = socket.socket(family, kind, proto)
    try:
        if sock.gettimeout() is not None:  # a process-wide default timeout (setdefaulttimeout)
            sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))
        _set_rcvtimeo(sock, seconds)
        sock.connect(sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


def _receive_plain(sock: socket.socket, views: list[memoryview], deadline: float,
                   on_whole: Callable[[int], None]) -> int:
    """Receive ``views`` in order with ``MSG_WAITALL`` (the socket blocking, ``SO_RCVTIMEO``
    bounding each wait by the deadline); returns how many arrived whole. ``on_whole(i)`` runs as
    page ``i`` completes, between receives: a stream verifies its pages while the other streams
    receive and verify theirs (receives and hashes both let go of the GIL)."""
    page, offset = 0, 0
    while page < len(views):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        _set_rcvtimeo(sock, left)
        bufs = [views[page][offset:], *views[page + 1 : page + IOV_PAGES]]
        try:
            n = sock.recvmsg_into(bufs, 0, socket.MSG_WAITALL)[0]
        except (BlockingIOError, TimeoutError, InterruptedError):
            continue  # the wait ran out (or a signal): the deadline decides
        except OSError:
            break  # reset: the pages received whole before it still count
        if n == 0:
            break  # the server closed (or died) before sending every page
        while n > 0:
            room = len(views[page]) - offset
            if n >= room:
                n -= room
                on_whole(page)
                page, offset = page + 1, 0
            else:
                offset += n
                n = 0
    return page


def _receive_tls(sock: ssl.SSLSocket, views: list[memoryview], deadline: float,
                 on_whole: Callable[[int], None]) -> int:
    """``_receive_plain`` over TLS, a page at a time (``on_whole`` as there)."""
    page = 0
    for v in views:
        got = 0
        while got < len(v):
            left = deadline - time.monotonic()
            if left <= 0:
                return page
            sock.settimeout(left)
            try:
                n = sock.recv_into(v[got:])
            except OSError:  # timed out or reset: what arrived whole still counts
                return page
            if not n:
                return page
            got += n
        on_whole(page)
        page += 1
    return page


def _stream(
    host: str,
    port: int,
    ticket: bytes,
    cert: str | None,
    views: list[memoryview],
    sums: Sequence[int],
    deadline: float,
) -> list[bool]:
    """One data connection: present the ticket, receive the stream's pages, verify each."""
    ok = [False] * len(views)

    def verify(i: int) -> None:
        # As each page lands, in one call that lets go of the GIL for the whole page, so the
        # streams of a load hash in parallel, one core each. Feeding the hash in small chunks
        # would keep the GIL for each chunk, so the streams would hash one at a time and the
        # checksum, not the copy, would set a load's rate
        # (benchmark/store/bench_checksum_threads.py compares the two).
        ok[i] = checksum(views[i]) == sums[i]

    try:
        with _connection(host, port, ticket, cert, deadline) as sock:
            if sock is None:
                return ok
            if cert is not None:
                _receive_tls(sock, views, deadline, on_whole=verify)
            else:
                _receive_plain(sock, views, deadline, on_whole=verify)
    except (OSError, ssl.SSLError):  # refused, reset, timed out: every page of it is a miss
        return [False] * len(views)
    return ok


@contextlib.contextmanager
def _connection(host: str, port: int, ticket: bytes, cert: str | None,
                deadline: float) -> Iterator[socket.socket | None]:
    """``_open``'s connection (or None), closed when the block ends."""
    sock = _open(host, port, ticket, cert, deadline)
    try:
        yield sock
    finally:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


def _open(host: str, port: int, ticket: bytes, cert: str | None,
          deadline: float) -> socket.socket | None:
    """A data connection with ``ticket`` presented: plain TCP, or TLS 1.3 with the server's
    certificate pinned to the digest ``cert``. None past the deadline or for another
    certificate; raises ``OSError`` / ``ssl.SSLError`` when it cannot connect."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    if cert is None:
        sock = _connect_blocking(host, port, left)
        try:
            sock.sendall(ticket)  # blocking, bounded by SO_SNDTIMEO: a single send
        except BaseException:
            sock.close()
            raise
        return sock
    sock = socket.create_connection((host, port), timeout=left)
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # pinned by digest below, not by a CA
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock = ctx.wrap_socket(sock)
        der = sock.getpeercert(binary_form=True) or b""
        if not hmac.compare_digest(hashlib.sha256(der).hexdigest(), cert):
            logger.warning("PTStore data plane: %s:%d presented another certificate", host, port)
            sock.close()
            return None
        sock.sendall(ticket)
    except BaseException:
        sock.close()
        raise
    return sock


SENDMSG_BUFFERS = 512
"""Pages handed to one ``sendmsg`` (below the kernel's IOV_MAX of 1024)."""


def _send_pages(sock: socket.socket, pages: list, deadline: float, tls: bool) -> None:
    """Every page of an upload stream, bounded by the deadline (raises ``TimeoutError`` /
    ``OSError`` when it cannot).

    Without TLS the pages go in as few ``sendmsg`` calls as the kernel takes them in: the
    writer runs in SGLang's scheduler process, whose main thread holds the GIL most of the time,
    and every call that drops the GIL waits up to the interpreter's switch interval to get it
    back, so a call per page is a wait per page."""
    if tls:  # an SSL socket has no sendmsg: a send per page
        for page in pages:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("upload past its deadline")
            sock.settimeout(left)
            sock.sendall(page)
        return
    views = [memoryview(p).cast("B") for p in pages]
    while views:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("upload past its deadline")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(left))
        sent = sock.sendmsg(views[:SENDMSG_BUFFERS])  # blocks until all, or the timeout
        while sent:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0], sent = views[0][sent:], 0


def _upload_stream(host: str, port: int, ticket: bytes, cert: str | None, pages: list,
                   deadline: float) -> tuple[int, list[bool]]:
    """One upload connection: present the ticket, send the pages, read the server's answer
    (bytes added, and which pages it stored). Nothing stored on any failure."""
    failed = (0, [False] * len(pages))
    try:
        with _connection(host, port, ticket, cert, deadline) as sock:
            if sock is None:
                return failed
            _send_pages(sock, pages, deadline, cert is not None)
            ack = bytearray(8 + len(pages))
            left = deadline - time.monotonic()
            if left <= 0:
                return failed
            if cert is not None:
                sock.settimeout(left)
            else:
                _set_rcvtimeo(sock, left)
            if not recv_exact(sock, memoryview(ack)):
                return failed
    except (OSError, ssl.SSLError):  # refused, reset, timed out: no page counts as stored
        return failed
    return struct.unpack_from("<Q", ack)[0], [b == 1 for b in ack[8:]]


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_POOL_WORKERS = 64


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(_POOL_WORKERS, thread_name_prefix="ptstore-tcp")
        return _POOL


def _stream_jobs(offer: dict, lengths: list[int]) -> list[tuple[int, int, bytes]]:
    """``(first page, pages, ticket)`` per stream of ``offer`` over pages of ``lengths``: the
    ranges ``split`` gives both sides, in ticket order."""
    tickets = [bytes.fromhex(x) for x in offer["tickets"]]
    return [(first, count, ticket) for (first, count), ticket
            in zip(split(lengths, len(tickets)), tickets, strict=True)]


@dataclass
class Upload:
    """The pages one server agreed to receive: where to connect, its offer, the pages."""

    host: str
    offer: dict
    pages: list  # bytes-like, in the put's order


def upload(uploads: list[Upload], deadline: float) -> list[tuple[int, list[bool]]]:
    """Run every upload's streams at once; per upload, the bytes its server added and which
    pages it stored. Returns once every stream has ended (each bounded by ``deadline``)."""
    jobs = [(k, u, *job) for k, u in enumerate(uploads)
            for job in _stream_jobs(u.offer, [len(p) for p in u.pages])]
    added = [0] * len(uploads)
    stored = [[False] * len(u.pages) for u in uploads]
    results = _run_all([(_upload_stream, (
        u.host, u.offer["port"], ticket, u.offer.get("cert"), u.pages[first : first + count],
        deadline)) for _, u, first, count, ticket in jobs],
        "an upload stream")  # one that failed oddly stored nothing, as far as we know
    for (k, _, first, _, _), result in zip(jobs, results, strict=True):
        if result is not None:
            added[k] += result[0]
            stored[k][first : first + len(result[1])] = result[1]
    return list(zip(added, stored, strict=True))


def _run_all(calls: list[tuple[Callable, tuple]], what: str) -> list:
    """Every ``fn(*args)`` of ``calls`` at once on the data plane's threads; each one's result,
    or None where it raised (logged as ``what`` failing). Returns only once every call has
    ended, whatever happened: none may still be writing into destinations (or reading pages)
    the caller is about to report on and SGLang to reuse."""
    if not calls:
        return []
    pool = _pool()
    futures = []
    try:
        for fn, args in calls:
            futures.append(pool.submit(fn, *args))
    finally:
        wait(futures)
    results = []
    for fut in futures:
        try:
            results.append(fut.result())
        except Exception:
            logger.exception("PTStore data plane: %s failed", what)
            results.append(None)
    return results


@dataclass
class Transfer:
    """The pages one server offered: where to connect, the offer, and where each page goes."""

    host: str
    offer: dict
    views: list[memoryview]  # destinations, one per page, of the page's length
    sums: list[int]


def fetch(transfers: list[Transfer], deadline: float) -> list[list[bool]]:
    """Run every transfer's streams at once (one connection per ticket); per transfer, which
    pages arrived whole and match their checksum. Returns by ``deadline`` plus the time a
    blocked system call takes to notice it (every wait is bounded by it)."""
    jobs = [(t, *job) for t in transfers
            for job in _stream_jobs(t.offer, [len(v) for v in t.views])]
    out = [[False] * len(t.views) for t in transfers]
    index = {id(t): k for k, t in enumerate(transfers)}
    results = _run_all([(_stream, (
        t.host, t.offer["port"], ticket, t.offer.get("cert"), t.views[first : first + count],
        t.sums[first : first + count], deadline)) for t, first, count, ticket in jobs],
        "a stream")  # one that failed oddly is a miss, never an error of the load
    for (t, first, _, _), ok in zip(jobs, results, strict=True):
        if ok is not None:
            out[index[id(t)]][first : first + len(ok)] = ok
    return out
