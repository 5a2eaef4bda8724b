"""The front door's bounds on HTTP framing, on a real uvicorn server (h11, as SGLang runs it)
with a small ASGI app and no SGLang: header lines per head, chunks per chunked body, the access
log's request targets, and CORS headers on the routes that need no key."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
from conftest import free_port
from sglang_pic.frontdoor.access_log import MAX_LOGGED_TARGET, ShortTargets
from sglang_pic.frontdoor.connections import (
    MAX_BODY_CHUNKS,
    MAX_HEAD_LINES,
    ConnectionLimits,
    guarded,
)


class Echo:
    """Answers 200 with the request body's length and how many body messages carried it."""

    def __init__(self) -> None:
        self.parts: list[int] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        size = parts = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                self.parts.append(-1)
                return
            size += len(message.get("body", b""))
            parts += 1
            if not message.get("more_body"):
                break
        self.parts.append(parts)
        body = f"{size} {parts}".encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server():
    import uvicorn

    app = Echo()
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http="h11", log_level="warning",
                            lifespan="off")
    config.load()
    config.http_protocol_class = guarded(config.http_protocol_class,
                                         ConnectionLimits(header_timeout_s=10,
                                                          max_connections=64))
    srv = uvicorn.Server(config)
    srv.config.load = lambda: None  # keep the guarded class
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    yield port, app
    srv.should_exit = True
    thread.join(10)


def _exchange(port: int, raw: bytes | list[bytes], pause: float = 0.0) -> bytes:
    """Send ``raw`` (pieces, ``pause`` apart) on a fresh connection; everything answered."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(20)
        try:
            for piece in [raw] if isinstance(raw, bytes) else raw:
                s.sendall(piece)
                time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        try:
            while chunk := s.recv(1 << 16):
                out += chunk
                if b"\r\n\r\n" in out and out.split(b"\r\n\r\n", 1)[1]:
                    break
        except ConnectionResetError:
            pass
        return out


def _head(extra: bytes = b"", chunked: bool = False, length: int | None = None) -> bytes:
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else (
        b"Content-Length: %d\r\n" % length if length is not None else b"")
    return b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + framing + extra + b"\r\n"


def _chunks(n: int, size: int) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (size, b"a" * size) for _ in range(n)) + b"0\r\n\r\n"


def test_a_body_in_tiny_chunks_is_refused_before_it_is_parsed(server):
    """40,000 one-byte chunks (no key needed to send them) cost the parser ~200 times the CPU
    of the same bytes with a Content-Length: refused with a 413 once past MAX_BODY_CHUNKS,
    before the parser goes through them, whether they come with the head or after it."""
    port, app = server
    for pieces in ([_head(chunked=True) + _chunks(40_000, 1)],
                   [_head(chunked=True), _chunks(40_000, 1)]):
        before = len(app.parts)
        answer = _exchange(port, pieces, pause=0.2)
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert b"%d chunks" % MAX_BODY_CHUNKS in answer
        assert all(p <= MAX_BODY_CHUNKS + 1 for p in app.parts[before:]), app.parts[before:]


def test_chunked_bodies_clients_send_pass_whole(server):
    port, _ = server
    for n, size in ((1, 10), (100, 1024), (MAX_BODY_CHUNKS, 16)):
        answer = _exchange(port, _head(chunked=True) + _chunks(n, size))
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert int(answer.split(b"\r\n\r\n")[1].split()[0]) == n * size


def test_a_head_of_too_many_lines_is_a_431(server):
    port, _ = server
    def head(headers: int) -> bytes:  # ``headers`` header lines, Host and Content-Length too
        return _head(b"".join(b"a%d: b\r\n" % i for i in range(headers - 2)), length=2)

    most = MAX_HEAD_LINES - 3  # besides the request line and the blank line
    for pieces in ([head(most + 1)], [head(most + 1)[:100], head(most + 1)[100:]],
                   [head(5000) + b"{}"]):
        answer = _exchange(port, pieces, pause=0.1)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert b"at most %d header lines" % most in answer
    assert _exchange(port, head(most) + b"{}").startswith(b"HTTP/1.1 200 ")


def test_a_head_trickled_byte_by_byte_is_served(server):
    """The end of a head found across reads (each byte its own read)."""
    port, _ = server
    raw = _head(b"X-A: 1\r\n", length=2) + b"{}"
    answer = _exchange(port, [raw[i:i + 1] for i in range(len(raw))], pause=0.002)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.split(b"\r\n\r\n")[1].startswith(b"2 ")


def test_the_access_log_cuts_long_targets():
    """uvicorn logs a request's target whole; /health needs no key, so 60 KB query strings
    grew the log by 33 MB a second."""
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                               '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/health?" + "q" * 60_000, "1.1", 200), None)
    assert ShortTargets().filter(record)
    line = record.getMessage()
    assert len(line) < MAX_LOGGED_TARGET + 100 and "(60008 chars)" in line
    short = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                              '%s - "%s %s HTTP/%s" %d',
                              ("127.0.0.1:5", "GET", "/health", "1.1", 200), None)
    assert ShortTargets().filter(short) and short.getMessage().endswith('"GET /health HTTP/1.1" 200')


def test_keyless_routes_lose_cors_headers_and_keyed_ones_keep_them():
    """SGLang's CORS middleware echoes any Origin with credentials allowed: a web page could
    read /metrics (model path, counters). The routes that need no key lose those headers."""
    from sglang_pic.frontdoor.middleware import FrontDoor, FrontDoorConfig

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"access-control-allow-origin", b"https://evil.example"),
            (b"Access-Control-Allow-Credentials", b"true"), (b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    door = FrontDoor(app, FrontDoorConfig(1 << 20, 5.0, None, (), False, False, lambda: 1000))

    async def get(path: str) -> list:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await door({"type": "http", "method": "GET", "path": path, "headers": []}, receive, send)
        return [k.lower() for k, _ in sent[0]["headers"]]

    for path in ("/metrics", "/health"):
        assert asyncio.run(get(path)) == [b"content-type"], path
    assert b"access-control-allow-origin" in asyncio.run(get("/v1/models"))
