"""Bounds on connections: a header deadline, a connection cap and a write deadline.

uvicorn (SGLang's HTTP server) times out idle keep-alive connections, but not a connection that
has not sent a whole request head: about 20,000 connections that never finished their headers
filled the process's file descriptors, and real clients got empty replies. ``guarded(base)``
subclasses uvicorn's HTTP protocol (h11 or httptools, whichever uvicorn picked):

* a connection must deliver a complete request head within ``header_timeout_s`` of opening, and
  of each response's end (the idle time of keep-alive counts too), else it is closed; while a
  request runs (a long generation, a stream) no deadline applies. A head still incomplete after
  ``MAX_HEAD_BYTES`` is closed at once, whichever parser uvicorn runs (h11 stops at 16 KB;
  httptools, which uvicorn prefers when it is installed, has no bound);
* past ``max_connections`` open connections, the connection that has waited longest for a
  request head is closed to make room (an idle flood gives way to new clients, whose heads
  arrive at once); when every connection is running a request, the new one is closed instead;
* a request head holds at most ``MAX_HEAD_LINES`` lines (431), and a chunked body comes in at
  most ``MAX_BODY_CHUNKS`` chunks (413): uvicorn's h11 parser handles each header and each
  chunk in Python, so tiny ones cost the event loop far more than their bytes (1-byte chunks
  ~200 times the CPU of the same body with a Content-Length; no key is needed to send one).
  Both are counted on the raw bytes before the parser sees them;
* a response whose client stops reading (its socket's and the transport's buffers full, uvicorn
  waiting to write) for ``write_timeout_s`` has its connection aborted, which aborts its
  request: without it a client pipelining requests and never reading held its connection (and
  its slot under the cap) for good, and 1024 such clients, no key needed, shut everyone out.

An AROUND hook on ``uvicorn.config.Config.load`` swaps the protocol class in, for every way SGLang
starts uvicorn (``uvicorn.run`` and ``Config``/``Server``); the limits come from our flags.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
from typing import Any

from . import access_log

MAX_HEAD_BYTES = 64 << 10
"""Most bytes a connection may send before its request head is complete."""
MAX_HEAD_LINES = 256
"""Line ends a request head must stay under, its request line and final blank line included
(12,000 headers of 5 bytes took 23 ms of the event loop, one 60 KB header 1.5 ms)."""
MAX_BODY_CHUNKS = 4096
"""Most chunks a chunked request body may come in: the body limit (16 MiB) in that many is
4 KiB a chunk, where HTTP clients send 8-64 KiB; 1-byte chunks cost ~5 us each to parse (a
2 MB body took the event loop 11.9 s, against 0.03 s with a Content-Length)."""
_PHRASES = {413: b"Content Too Large", 431: b"Request Header Fields Too Large"}


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    max_connections: int
    write_timeout_s: float = 60.0


@cache
def guarded(base: type, limits: ConnectionLimits) -> type:
    """``base`` (a uvicorn HTTP protocol class) with ``limits``."""

    waiting: OrderedDict[int, Any] = OrderedDict()
    """Connections waiting for a request head, oldest first."""

    class Guarded(base):  # type: ignore[misc, valid-type]
        _pic_deadline: asyncio.TimerHandle | None = None
        _pic_cycle: Any = None
        _pic_stall: asyncio.TimerHandle | None = None
        _pic_head_bytes = 0
        _pic_head_lines = 0  # lines of the head awaited
        _pic_tail = b""  # its last bytes read (its end may straddle two reads)
        _pic_chunked = False  # the running request's body is chunked
        _pic_body_lines = 0  # line ends in that body: two per chunk

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                if not waiting:
                    transport.close()
                    return
                _, oldest = waiting.popitem(last=False)
                oldest._pic_disarm()
                oldest.transport.close()
            self._pic_arm()

        def data_received(self, data: bytes) -> None:
            if self._pic_deadline is not None:  # a head is awaited: ``data`` starts or goes on
                joined = self._pic_tail + data
                end = joined.find(b"\r\n\r\n")
                cut = len(data) if end < 0 else end + 4 - len(self._pic_tail)
                self._pic_head_lines += data.count(b"\n", 0, cut)
                if self._pic_head_lines >= MAX_HEAD_LINES:
                    self._pic_refuse(431, "a request head holds at most "
                                          f"{MAX_HEAD_LINES - 3} header lines")
                    return
                if end < 0:
                    self._pic_tail = joined[-3:]  # a head's end may straddle two reads
                    self._pic_parse(data)
                    return
                # the head alone first: its headers tell whether the body is chunked, and the
                # body's chunks are counted before the parser goes through them
                self._pic_tail = b""
                self._pic_parse(data[:cut])
                self._pic_chunked = self._pic_deadline is None and any(
                    k == b"transfer-encoding" and b"chunked" in v.lower()
                    for k, v in (getattr(self, "scope", None) or {}).get("headers", ()))
                data = data[cut:]
                if not data:
                    return
            if self._pic_chunked:
                self._pic_body_lines += data.count(b"\r\n")
                if self._pic_body_lines > 2 * MAX_BODY_CHUNKS + 2:
                    self._pic_refuse(413, f"a chunked body comes in at most {MAX_BODY_CHUNKS} "
                                          "chunks")
                    return
            self._pic_parse(data)

        def _pic_parse(self, data: bytes) -> None:
            super().data_received(data)
            if self._pic_deadline is not None and self.cycle is not self._pic_cycle:
                self._pic_disarm()  # a request head arrived: it runs without a deadline
            elif self._pic_deadline is not None:
                self._pic_head_bytes += len(data)
                if self._pic_head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                    self._pic_disarm()
                    self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # a pipelined request may have started inside super(): it runs without a deadline
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self._pic_arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._pic_disarm()
            self._pic_unstall()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._pic_stall is None:
                self._pic_stall = self.loop.call_later(limits.write_timeout_s, self._pic_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._pic_unstall()

        def _pic_unstall(self) -> None:
            if self._pic_stall is not None:
                self._pic_stall.cancel()
                self._pic_stall = None

        def _pic_stalled(self) -> None:
            self._pic_stall = None
            if not self.transport.is_closing() or self.transport.get_write_buffer_size():
                self.transport.abort()  # not close(): that would wait for the buffer to drain

        def _pic_refuse(self, status: int, message: str) -> None:
            """Answer ``status`` (unless a response has begun) and close the connection."""
            self._pic_disarm()
            self._pic_chunked = False
            if not self.transport.is_closing():
                if self.cycle is None or not self.cycle.response_started:
                    body = json.dumps({"error": {"message": message, "code": status}}).encode()
                    self.transport.write(
                        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                        % (status, _PHRASES[status], len(body), body))
                self.transport.close()

        def _pic_arm(self) -> None:
            self._pic_disarm()
            self._pic_cycle = self.cycle
            self._pic_head_bytes = 0
            self._pic_head_lines = 0
            self._pic_tail = b""
            self._pic_chunked = False
            self._pic_body_lines = 0
            self._pic_deadline = self.loop.call_later(limits.header_timeout_s, self._pic_expire)
            waiting[id(self)] = self

        def _pic_disarm(self) -> None:
            waiting.pop(id(self), None)
            if self._pic_deadline is not None:
                self._pic_deadline.cancel()
                self._pic_deadline = None

        def _pic_expire(self) -> None:
            self._pic_deadline = None
            waiting.pop(id(self), None)
            if self.cycle is self._pic_cycle and not self.transport.is_closing():
                self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def connection_limits() -> ConnectionLimits:
    """The limits of ``--http-header-timeout-s``, ``--max-connections`` and
    ``--http-write-timeout-s``."""
    from sglang_pic.launcher.server_flags import setting

    return ConnectionLimits(header_timeout_s=float(setting("--http-header-timeout-s")),
                            max_connections=int(setting("--max-connections")),
                            write_timeout_s=float(setting("--http-write-timeout-s")))


def around_config_load(original: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
    """Load uvicorn's config, then guard the HTTP protocol class it chose."""
    result = original(config, *args, **kwargs)
    access_log.install()
    base = config.http_protocol_class
    if not getattr(base, "_pic_guarded", False):
        protocol = guarded(base, connection_limits())
        protocol._pic_guarded = True
        config.http_protocol_class = protocol
    return result

