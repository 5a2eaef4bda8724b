"""A PTStore server: a zmq ROUTER socket in front of a :class:`StoreEngine`.

One request = one multipart message (``protocol``); a batched get or put for many pages is one
round trip. Bad input (malformed, oversized, wrong checksum, invalid ids) is answered with an
error and counted; the server keeps serving. ``status`` returns counters; ``metrics_text()``
renders them in the Prometheus exposition format.

Authentication is the connection's (``auth``): with tokens the socket is a CurveZMQ server whose
ZAP handler admits only clients of those tokens, before any of their messages is accepted, and
names each connection's tenant. Every id and object key a request names is prefixed with its
tenant's name (``tenant \0 id``) before it reaches the engine, so a tenant can neither read nor
overwrite another's pages, whatever ids it sends. Within a tenant every writer is trusted: any
client of a token may overwrite what another client of the same token stored. Without tokens
(``--insecure``) there is one anonymous tenant and no writes into readers' host pools.

A server on a ``tcp://`` endpoint also runs a data listener (``datapath``) on the same host, on
its own port: a get that asks for it is answered with checksums and one-time tickets, and its
pages go over parallel TCP connections instead of inside the CURVE reply. A put that asks for
it is answered with upload tickets, and its pages arrive on the data listener's connections,
which store them (the engine takes its own lock).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import zmq

from .auth import ServerAuth, tenant_of
from .datapath import DataPlaneConfig, DataServer, endpoint_host, within_memory
from .engine import OWNED, REPLICA, StoreEngine
from .protocol import Buffer, Limits, ProtocolError, checksum, decode_request, encode
from .shm import DATA_OFFSET, SegmentCache

logger = logging.getLogger(__name__)
# bytes CurveZMQ adds to a message frame: a MESSAGE command's name, nonce and box (~33-40)
CURVE_FRAME_OVERHEAD = 64
DEFAULT_DATA_PLANE = DataPlaneConfig()  # plain TCP, on the control endpoint's host, any port
REPLY_SHARE = 0.25
"""The share of the memory budget that get replies waiting in the socket may hold together
(pages read from SSD for them, and stored pages they keep alive), a tenant's at most half of it:
a client that asks and never reads must not grow the server without bound, nor starve the other
tenants. Past it, a get's pages are misses (a reader computes them again)."""


def _checksum_of(data: bytes, known: int | None) -> int:
    """The checksum remembered since the put, or (a page read back from SSD) computed now."""
    return checksum(data) if known is None else known


def _pages_reply(found: list[bool], pages: list[tuple[bytes, int | None]]) -> list[bytes]:
    """A get answered over the socket: which ids were found, the found pages' checksums, and
    the pages (``(bytes, checksum or None)``, in id order) as payload frames."""
    return encode({"ok": True, "found": found, "sums": [_checksum_of(d, s) for d, s in pages]},
                  [d for d, _ in pages])


def _nonce_of(shm: dict) -> bytes | None:
    """The segment nonce a probe or get names (None for a pool: its proof is in its spec)."""
    return None if "pool" in shm else bytes.fromhex(shm["nonce"])


def _copy_pages(task: tuple[list[tuple[int, Buffer, int, int | None]], float, bool]) -> list[int]:
    """Copy ``(position, data, address, checksum)`` jobs in order while the node's monotonic clock
    is before the deadline; with ``verify``, hash each page where it landed and keep it only if it matches
    (the checksum of a page read back from SSD is computed from its bytes). Returns the positions
    copied (and verified)."""
    jobs, until, verify = task
    done = []
    for i, data, addr, known in jobs:
        if time.monotonic() > until:  # the node's clock, shared with the reader
            break
        n = len(data)
        # a large page stored from an upload is a writable mapping, which memmove takes as
        # a ctypes view; bytes it takes as they are
        ctypes.memmove(addr, data if isinstance(data, bytes) else
                       (ctypes.c_char * n).from_buffer(data), n)
        if verify and checksum((ctypes.c_char * n).from_address(addr)) != _checksum_of(data,
                                                                                        known):
            continue
        done.append(i)
    return done


def _close_socket(sock: zmq.Socket, auth: ServerAuth, ctx: zmq.Context) -> None:
    """Close the server's socket, stop its authenticator and terminate its context, in that
    order: a context left to the garbage collector in a reference cycle hangs the collecting
    thread (its ``term`` waits for sockets only the collector would close)."""
    if not sock.closed:
        sock.close(0)
    auth.stop()
    ctx.term()


class StoreServer:
    """``tokens``: the accepted tokens, ``{token: tenant name}`` (a single token is a tenant
    named by its digest); None serves without authentication (``--insecure``). ``data_plane``:
    the TCP data listener's settings (its host by default that of ``endpoint``; its
    ``max_pending_bytes`` at most a quarter of the engine's memory budget), or None for none;
    only a ``tcp://`` endpoint gets one."""

    def __init__(self, engine: StoreEngine, endpoint: str,
                 tokens: str | Mapping[str, str] | None = None,
                 limits: Limits | None = None, copy_threads: int = 4,
                 data_plane: DataPlaneConfig | None = DEFAULT_DATA_PLANE) -> None:
        limits = limits or Limits()
        self.engine = engine
        self.endpoint = endpoint
        self.limits = limits
        if isinstance(tokens, str):
            tokens = {tokens: tenant_of(tokens)}
        # a context of its own: the ZAP handler that authenticates this socket is per context
        self.ctx = zmq.Context()
        self.auth = ServerAuth(self.ctx, tokens)
        self.sock = self.ctx.socket(zmq.ROUTER)
        # every frame zero-copy, so a reply's tracker (``_replies``) covers all its pages: pyzmq
        # would copy those under 64 KiB into buffers of its own, out of sight
        self.sock.copy_threshold = 0
        # per frame: the largest a request holds (a page, or the header), plus what CURVE adds
        # to a frame on the wire (zmq compares the encrypted frame): a page at the limit must
        # reach the protocol's checks, not be dropped with its connection
        self.sock.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes + CURVE_FRAME_OVERHEAD)
        self.sock.setsockopt(zmq.LINGER, 0)
        # the socket, its authenticator and the context: closed by ``stop``, or when this
        # server is collected without one
        self._close_socket = weakref.finalize(self, _close_socket, self.sock, self.auth,
                                              self.ctx)
        self._close_socket.atexit = False  # the serving thread may still be polling then
        try:
            self.auth.apply(self.sock)
            self.sock.bind(endpoint)
        except BaseException:
            self._close_socket()
            raise
        self.data: DataServer | None = None
        host = endpoint_host(endpoint)
        if data_plane is not None and host is not None:
            # transfers in flight count against the memory budget, whatever the config says
            data_plane = within_memory(data_plane, engine.memory_bytes)
            try:
                self.data = DataServer(data_plane, data_plane.host or host)
            except OSError as e:  # e.g. an endpoint naming an interface, not a host
                logger.warning("PTStore: no TCP data plane (cannot listen on %s: %s); remote "
                               "readers get pages over the socket", data_plane.host or host, e)
            except BaseException:
                self._close_socket()
                raise
        self.segments = SegmentCache()  # readers' shared-memory segments on this node
        # copies into readers' memory: a memmove drops the GIL, so pages copy in parallel
        self.copy_threads = max(1, copy_threads)
        self.copiers = ThreadPoolExecutor(self.copy_threads, thread_name_prefix="ptstore-copy")
        self.pool_pages = 0
        # get replies zmq may still hold (their trackers and payload bytes), and their sum
        self.reply_budget = max(int(REPLY_SHARE * engine.memory_bytes),
                                2 * limits.max_tensor_bytes)
        self._replies: deque[tuple[zmq.MessageTracker, int, str]] = deque()
        self.reply_bytes = 0
        self.requests = 0
        self.rejected = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StoreServer:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the socket and segments (a second call does nothing)."""
        if self.sock.closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._close_socket()
        self.copiers.shutdown(wait=True)
        self.segments.close()
        if self.data is not None:
            self.data.close()

    @property
    def server_key(self) -> str | None:
        """The server's public CURVE key (z85), which clients of tokens other than the first
        need; None without authentication."""
        return self.auth.public.decode() if self.auth.secure else None

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        reaped = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - reaped > 1.0:  # however busy: a dead reader's pool is GBs
                self.segments.reap()
                reaped = time.monotonic()
            if not poller.poll(100):
                continue
            frames = self.sock.recv_multipart(copy=False)
            # the tenant ZAP named for this connection (its token's)
            tenant = frames[0].get("User-Id") if self.auth.secure else ""
            ident, body = frames[0], [f.buffer for f in frames[1:]]
            reply = self.handle(body, tenant)
            pages = sum(len(f) for f in reply[1:])
            try:
                if pages:  # the routing frame as bytes: a received frame cannot be tracked
                    tracker = self.sock.send_multipart([ident.bytes, *reply], copy=False,
                                                       track=True)
                    self._replies.append((tracker, pages, tenant))
                    self.reply_bytes += pages
                else:
                    self.sock.send_multipart([ident, *reply], copy=False)
            except (zmq.ZMQError, ValueError):  # one reply lost, never the server
                logger.exception("PTStore: sending a reply failed")
            del reply
            # a put's frames are its pages: freed now, not when the next request rebinds
            # these names (freeing a large put takes milliseconds the next lookup would wait)
            del frames, ident, body

    def handle(self, body: list, tenant: str = "") -> list[bytes]:
        """The reply to one request of ``tenant``."""
        self.requests += 1
        try:
            header, payloads = decode_request(body, self.limits)
            return self._dispatch(header, payloads, tenant + "\0", tenant)
        except ProtocolError as e:
            self.rejected += 1
            return encode({"ok": False, "error": str(e)})
        except Exception as e:  # never let one request take the server down
            logger.exception("store request failed")
            self.rejected += 1
            return encode({"ok": False, "error": f"internal error: {type(e).__name__}"})

    def _dispatch(self, header: dict, payloads: list, ns: str, tenant: str = "") -> list[bytes]:
        op = header["op"]
        tids = [ns + t for t in header.get("tids", [])]  # the tenant's namespace
        eng = self.engine
        if op == "put":
            kind = REPLICA if header.get("kind") == REPLICA else OWNED
            if "tcp" in header:
                return self._put_over_tcp(tids, header, tenant, kind)
            # the checksums were verified on arrival (decode_request): kept with the bytes, so a
            # get does not hash them again
            added = eng.put_tensors([(t, bytes(p)) for t, p in zip(tids, payloads, strict=True)],
                                    kind, header["sums"])
            return encode({"ok": True, "added_bytes": added})
        if op == "probe":
            shm = header["shm"]
            if "pool" in shm and not self.auth.secure:
                return encode({"ok": True, "shm": False,
                               "reason": "writing into a reader's pool needs a server token"})
            try:
                self.segments.mapping(shm.get("pool", shm.get("name")), _nonce_of(shm))
                same = True
            except (OSError, ValueError):
                same = False
            return encode({"ok": True, "shm": same})
        if op == "get" and "shm" in header:
            return self._get_into_segment(tids, header["shm"])
        tcp = header.get("tcp")
        if op == "get" and tcp is not None and self.data is not None \
                and (self.data.tls is not None or not tcp.get("tls", False)):
            return self._get_over_tcp(tids, tcp, tenant)
        if op == "get":
            got = eng.get_tensors_checked(tids, self.reply_room(tenant))
            return _pages_reply([g is not None for g in got], [g for g in got if g is not None])
        if op == "exists":
            return encode({"ok": True, "found": [eng.has(t) for t in tids]})
        if op == "put_object":  # an object lists the tenant's own ids, as the tenant named them
            eng.put_object(ns + header["key"], header.get("tids", []))
            return encode({"ok": True})
        if op == "get_object":
            return encode({"ok": True, "tids": eng.get_object(ns + header["key"])})
        return encode({"ok": True, "status": self.status()})

    def _get_over_tcp(self, tids: list[str], tcp: dict, tenant: str) -> list[bytes]:
        """Checksums, lengths and tickets for the found pages (of the size the reader expects,
        when it names them); the pages go over the data listener. A server holding too much for
        outstanding transfers (offers not redeemed yet: another tenant's, perhaps) sends them
        over the socket instead, as a get without the data plane: slower, but no page lost."""
        got = self.engine.get_tensors_checked(tids, self.limits.max_message_bytes)
        sizes = tcp.get("sizes")
        found = [g is not None and (sizes is None or len(g[0]) == sizes[i])
                 for i, g in enumerate(got)]
        pages = [got[i] for i in range(len(tids)) if found[i]]
        offer = self.data.offer(tenant, [d for d, _ in pages], tcp["streams"])
        if offer is None:
            self.data._count("declined")
            room, kept = self.reply_room(tenant), 0
            for i, g in enumerate(got):  # over the socket: the pages that fit the reply room
                if found[i]:
                    room -= len(g[0])
                    found[i] = room >= 0
                    kept += found[i]
            return _pages_reply(found, pages[:kept])
        return encode({"ok": True, "found": found, "sums": [_checksum_of(d, s) for d, s in pages],
                       "lengths": [len(d) for d, _ in pages], "tcp": offer})

    def _put_over_tcp(self, tids: list[str], header: dict, tenant: str,
                      kind: str) -> list[bytes]:
        """Upload tickets for a put's pages (``"tcp": null``: put them over the socket)."""
        tcp = header["tcp"]
        if self.data is None or (tcp.get("tls", False) and self.data.tls is None):
            return encode({"ok": True, "tcp": None})
        sums = header["sums"]

        def store(positions: list[int], pages: list[Buffer]) -> int:
            # an upload stream's verified pages, from its connection's thread
            return self.engine.put_tensors([(tids[i], p) for i, p in zip(
                positions, pages, strict=True)], kind, [sums[i] for i in positions])

        offer = self.data.offer_upload(tenant, tcp["lengths"], sums, tcp["streams"], store)
        return encode({"ok": True, "tcp": offer})

    def _get_into_segment(self, tids: list[str], shm: dict) -> list[bytes]:
        """Copy each found page of the expected size to its offset in the reader's segment (or
        host pool); the reply names which were found, with their checksums. Into a pool, nothing
        is written after ``until`` (the reader has stopped waiting and may reuse the slots), and
        each page is verified where it landed, so the reply needs no checksums: the reader's
        process is SGLang's scheduler, where every hashing thread waits for the GIL."""
        pool = "pool" in shm
        if pool and not self.auth.secure:  # unauthenticated peers must not write into processes
            raise ProtocolError("writing into a reader's pool needs a server token")
        try:
            mm, base = self.segments.mapping(shm["pool"] if pool else shm["name"],
                                             _nonce_of(shm))
        except (OSError, ValueError) as e:
            # why stays here: the reasons (no such process, not its file, another file) would
            # tell a tenant about the node's processes
            logger.debug("PTStore: a get's shm segment is unavailable: %s", e)
            raise ProtocolError("shm segment unavailable") from None
        offsets, sizes = shm["offsets"], shm["sizes"]
        low = 0 if pool else DATA_OFFSET  # a staging segment's nonce lives below DATA_OFFSET
        if any(o < low or o + n > len(mm) for o, n in zip(offsets, sizes, strict=True)):
            raise ProtocolError("shm offsets outside the segment")
        until = float(shm["until"]) if pool else float("inf")
        got = self.engine.get_tensors_checked(tids)
        jobs = [(i, g[0], base + off, g[1]) for i, (g, off, n) in enumerate(zip(
            got, offsets, sizes, strict=True))
            if g is not None and len(g[0]) == n]  # absent or another shape: a miss
        step = -(-len(jobs) // self.copy_threads) or 1
        found = [False] * len(tids)
        for part in self.copiers.map(_copy_pages, [(jobs[k:k + step], until, pool)
                                                   for k in range(0, len(jobs), step)]):
            for i in part:
                found[i] = True
        if pool:  # verified where they landed, by the copy threads: the reader hashes nothing
            self.pool_pages += sum(found)
            return encode({"ok": True, "found": found, "verified": True})
        return encode({"ok": True, "found": found,
                       "sums": [_checksum_of(*got[i]) for i in range(len(tids)) if found[i]]})

    def reply_room(self, tenant: str) -> int:
        """The bytes a get of ``tenant`` answered over the socket may carry now: what is left of
        the reply budget, and of the tenant's half of it, by the replies zmq still holds (each
        until its tracker says zmq let its frames go: sent, or dropped with its connection)."""
        if self._replies:
            self._replies = deque(r for r in self._replies if not r[0].done)
            self.reply_bytes = sum(n for _, n, _ in self._replies)
        mine = sum(n for _, n, t in self._replies if t == tenant)
        return max(0, min(self.reply_budget - self.reply_bytes, self.reply_budget // 2 - mine,
                          self.limits.max_message_bytes))

    def status(self) -> dict:
        eng = self.engine
        return {**eng.stats, "requests": self.requests, "rejected": self.rejected,
                "owned_bytes": eng.owned.used, "replica_bytes": eng.replica.used,
                "owned_tensors": len(eng.owned.entries),
                "replica_tensors": len(eng.replica.entries),
                "ssd_bytes": eng.ssd_used, "ssd_tensors": len(eng.ssd) if eng.ssd else 0,
                "evictions": eng.owned.evictions + eng.replica.evictions,
                "pool_pages": self.pool_pages,
                "reply_bytes_held": self.reply_bytes,
                "objects": len(eng.objects),
                **({f"data_{k}": v for k, v in self.data.stats.items()}
                   if self.data is not None else {})}

    def metrics_text(self) -> str:
        """The counters in Prometheus text format (``ptstore_<name>``)."""
        lines = []
        for k, v in self.status().items():
            lines += [f"# TYPE ptstore_{k} gauge", f"ptstore_{k} {v}"]
        return "\n".join(lines) + "\n"
