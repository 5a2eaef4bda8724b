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
* a response whose client stops reading (its socket's and the transport's buffers full, uvicorn
  waiting to write) for ``write_timeout_s`` has its connection aborted, which aborts its
  request: without it a client pipelining requests and never reading held its connection (and
  its slot under the cap) for good, and 1024 such clients, no key needed, shut everyone out.

An AROUND hook on ``uvicorn.config.Config.load`` swaps the protocol class in, for every way SGLang
starts uvicorn (``uvicorn.run`` and ``Config``/``Server``); the limits come from our flags.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
from typing import Any

MAX_HEAD_BYTES = 64 << 10
"""Most bytes a connection may send before its request head is complete."""


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

        def _pic_arm(self) -> None:
            self._pic_disarm()
            self._pic_cycle = self.cycle
            self._pic_head_bytes = 0
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
    base = config.http_protocol_class
    if not getattr(base, "_pic_guarded", False):
        protocol = guarded(base, connection_limits())
        protocol._pic_guarded = True
        config.http_protocol_class = protocol
    return result

