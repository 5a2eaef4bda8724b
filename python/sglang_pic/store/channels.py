"""Request/reply channels from a PTStore client to its servers, over ZMQ.

The control plane of ``client.StoreClient``: every request is one multipart message (a JSON
header and payload frames, ``protocol.encode``) on a DEALER socket, answered by one reply, and
several requests to one server are answered in order. Why each piece is as it is:

* **Threads.** SGLang's cache controller calls one backend from three threads, zmq sockets are
  not thread-safe, and a reply taken by the wrong thread would be a wrong answer: every thread has
  its own socket per server (``socks``).
* **Deadlines, never hangs.** A send waits at most ``timeout_ms`` for a peer (a server that is
  down, or whose CURVE handshake refuses our key); replies are collected against one deadline of
  ``timeout_ms`` plus the bytes in flight at ``min_gbps``. A server that misses it loses this
  thread's socket, so a late reply can never be taken for the answer to a later request.
* **Encryption.** With a token every socket is a CurveZMQ client (``auth.secure_client``); ZMQ
  encrypts on its context's I/O threads, so the channels own a context with one I/O thread per
  server up to ``ZMQ_IO_THREADS_MAX`` (on the process-wide one, one thread encrypted every put
  to every server).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import weakref

import zmq

from .auth import secure_client
from .protocol import Buffer, encode

ZMQ_IO_THREADS_MAX = 4  # CURVE runs on these: one per server, so puts to each encrypt apart


class _Sockets:
    """The context and every socket of one ``ServerChannels``, closed together by ``release``.

    Why apart from the channels: channels dropped without ``close`` must not leave their context
    to the garbage collector. Collected in a reference cycle, a context's ``__del__`` finds its
    socket set empty (weak references into the cycle are cleared first) and its ``term`` waits
    for sockets that are never closed: the collecting thread hangs. The channels' finalizer
    holds this object, so the sockets are closed, then the context terminated, before either
    can be collected."""

    def __init__(self) -> None:
        self.ctx: zmq.Context | None = None
        self.socks: list[zmq.Socket] = []
        self.lock = threading.Lock()

    def release(self) -> None:
        """Close every socket (linger 0: at once) and terminate the context."""
        with self.lock:
            for s in self.socks:
                s.close(0)
            self.socks.clear()
            ctx, self.ctx = self.ctx, None
        if ctx is not None:
            ctx.term()


class ServerChannels:
    """One DEALER socket per (thread, server) to ``servers``, with ``token`` / ``server_key``
    for CURVE (``auth.secure_client``); ``timeout_ms`` and ``min_gbps`` set every deadline.
    ``rpcs`` counts the requests sent."""

    def __init__(self, servers: list[str], token: str | None = None,
                 server_key: str | None = None, timeout_ms: int = 2000,
                 min_gbps: float = 0.5) -> None:
        self.servers = list(servers)
        self._credentials = (token, server_key)
        self.timeout_ms = timeout_ms
        self.min_gbps = min_gbps
        self._local = threading.local()  # .socks: this thread's {server: socket}
        self._owned = _Sockets()  # our context (``ctx``) and every thread's sockets
        # not at exit: a daemon thread may still be polling one of the sockets then
        weakref.finalize(self, self._owned.release).atexit = False
        self.rpcs = 0

    @property
    def socks(self) -> dict[str, zmq.Socket]:
        """This thread's sockets, one per server."""
        socks = getattr(self._local, "socks", None)
        if socks is None:
            socks = self._local.socks = {}
        return socks

    @property
    def ctx(self) -> zmq.Context:
        """This client's ZMQ context, with one I/O thread per server up to
        ``ZMQ_IO_THREADS_MAX``. ZMQ encrypts and decrypts (CURVE) a socket's messages on its
        context's I/O thread: on the process-wide context, one thread encrypted every put to
        every server. Made on first use, and again after ``close``."""
        owned = self._owned
        with owned.lock:
            if owned.ctx is None:
                owned.ctx = zmq.Context(io_threads=min(len(self.servers), ZMQ_IO_THREADS_MAX))
            return owned.ctx

    def sock(self, server: str) -> zmq.Socket:
        s = self.socks.get(server)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            # a DEALER blocks a send while it has no peer: a server that is down, or one whose
            # CURVE handshake refuses our key, would otherwise hold the caller forever
            s.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout_ms)))
            s.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
            secure_client(s, *self._credentials)
            s.connect(server)
            self.socks[server] = s
            with self._owned.lock:
                self._owned.socks.append(s)
        return s

    def send(self, server: str, header: dict, payloads: list[Buffer] | None = None) -> None:
        self.rpcs += 1
        self.sock(server).send_multipart(encode(header, payloads), copy=False)

    def drop(self, server: str) -> None:
        """Close this thread's socket to ``server``: a reply still in flight can then never be
        taken for the answer to a later request."""
        sock = self.socks.pop(server, None)
        if sock is not None:
            sock.close(0)
            with self._owned.lock:
                self._owned.socks.remove(sock)

    def recv(self, server: str, deadline: float):
        """The reply of ``server`` as ``(header, payloads)``, or None past ``deadline`` or when
        it is not a reply at all."""
        sock = self.socks.get(server)
        if sock is None or not sock.poll(max(0, int(1000 * (deadline - time.monotonic())))):
            self.drop(server)
            return None
        frames = sock.recv_multipart(copy=False)
        try:
            header = json.loads(bytes(frames[0]))
        except ValueError:
            header = None
        if not isinstance(header, dict):
            self.drop(server)
            return None
        return header, [f.buffer for f in frames[1:]]

    def round_trips(self, requests: dict[str, tuple[dict, list[Buffer] | None]],
                     nbytes: int, deadline: float | None = None
                     ) -> dict[str, tuple[dict, list] | None]:
        """One request per server: ``pipelined`` keyed by server."""
        servers = list(requests)
        replies = self.pipelined([(s, *requests[s]) for s in servers], nbytes, deadline)
        return dict(zip(servers, replies, strict=True))

    def pipelined(self, requests: list[tuple[str, dict, list[Buffer] | None]], nbytes: int,
                   deadline: float | None = None) -> list[tuple[dict, list] | None]:
        """Send every request (a server may get several: it answers them in order), then collect
        every reply against one deadline (``nbytes``: the bytes the replies and requests carry;
        or ``deadline``, monotonic). A server whose request could not be sent within the
        time-out, or one of whose replies was not collected - time out, or an error while
        collecting - loses its socket, and its requests from there on get None."""
        replies: list[tuple[dict, list] | None] = [None] * len(requests)
        failed: set[str] = set()
        collected = 0
        try:
            for server, header, payloads in requests:
                if server in failed:
                    continue
                try:
                    self.send(server, header, payloads)
                except zmq.Again:  # no peer took it in time (SNDTIMEO): a miss, never a hang
                    self.drop(server)
                    failed.add(server)
            if deadline is None:
                deadline = self.deadline(nbytes)
            for i, (server, _, _) in enumerate(requests):
                if server not in failed:
                    replies[i] = self.recv(server, deadline)
                    if replies[i] is None:  # _recv dropped the socket: later replies are lost
                        failed.add(server)
                collected = i + 1
        finally:
            for server, _, _ in requests[collected:]:
                if server not in failed:
                    self.drop(server)
        return replies

    def deadline(self, nbytes: int) -> float:
        return time.monotonic() + self.timeout_ms / 1000 + nbytes / (self.min_gbps * 1e9)

    def call(self, server: str, header: dict, payloads: list[Buffer] | None = None):
        """One round trip; None on timeout."""
        return self.round_trips({server: (header, payloads)},
                                 sum(len(p) for p in payloads or ()))[server]

    def close(self) -> None:
        """Close every thread's sockets and the context (linger 0: returns at once); the
        channels reopen on the next request."""
        self._owned.release()
        self._local = threading.local()
