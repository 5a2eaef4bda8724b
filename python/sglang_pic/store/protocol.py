"""PTStore wire format: one zmq multipart message per request and per reply.

    frame 0: JSON header  {"op": ..., "tids": [...], "sums": [...], ...}
    frame 1..n: tensor payloads (bytes), in the order of ``tids`` (puts and get replies)

A get may instead name a shared-memory segment of the reader on the server's node
(``"shm": {"name", "nonce", "offsets", "sizes"}``, see ``shm``): the server copies each page
there, once the segment's first 16 bytes equal ``nonce``, and the reply carries checksums only.
``probe`` (``"shm": {"name", "nonce"}``) asks whether the server maps that segment at all. A
segment may also be the reader's host KV pool itself (``"shm": {"pool": {"pid", "fd", "dev",
"ino"}, ...}``); a get into a pool carries ``until`` (the monotonic clock, which the node's
processes share), after which the server writes nothing more: the reader stops waiting soon after and may
hand those pool slots to other data.

A get may also ask for the network data plane (``"tcp": {"streams": K, "sizes": [...], "tls":
bool}``, see ``datapath``): the reply then carries no payload frames but the pages' ``lengths``
and ``sums`` and K one-time tickets, and the pages travel over K TCP connections. ``sizes``
(optional) are the sizes the reader expects: a page of another size is a miss and is not sent.
``tls`` asks for TLS streams; a server without a certificate answers it over the socket instead.
A put may ask for it too (``"tcp": {"streams": K, "lengths": [...], "tls": bool}``, one length
and one checksum per tensor id, no payload frames): the reply carries upload tickets
(``"tcp": {...}``), or ``"tcp": null`` when the server cannot take the pages that way (no data
listener, TLS asked of a plain one, too much outstanding), and the writer then puts them over the
socket.

Frames are sent and received zero-copy by zmq. Every tensor carries a 64-bit XXH3 checksum so a
reader never accepts a torn or corrupted page: XXH3 rather than CRC32 because it hashes several
times faster, and an 8K-token Llama-3-8B prefix is 1 GiB of pages. Limits are checked before
anything is stored.

Requests carry no credentials: the connection is authenticated (CurveZMQ, ``auth``). Tensor ids
and object keys are opaque strings of at most ``Limits.max_id_chars`` characters without NUL; they
never name a file (the SSD tier names its files by a digest), so any other string is a valid id.
A request naming an invalid id is refused as a whole.
"""

from __future__ import annotations

import json
import math
import mmap
import re
from dataclasses import dataclass

import xxhash

OPS = ("put", "get", "exists", "put_object", "get_object", "status", "probe")


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int = 16 << 20  # ids of a 128-page batch of a layer-first pool: ~1-2 MB
    max_tensor_bytes: int = 64 << 20
    max_message_bytes: int = 1 << 30
    max_tensors: int = 65536
    max_id_chars: int = 1024  # SGLang's page keys are 64 hex characters plus a short suffix

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame a request may hold (zmq's ``MAXMSGSIZE`` is per frame)."""
        return max(self.max_header_bytes, self.max_tensor_bytes)


class ProtocolError(ValueError):
    """A request the server refuses (answered with ``{"ok": false, "error": ...}``)."""


Buffer = bytes | bytearray | memoryview | mmap.mmap
"""A payload frame or a stored page: bytes, or memory zmq and sockets send without copying (a
view of a host KV page; a large uploaded page is a mapping of its own: ``datapath``)."""


def checksum(data: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(data)


def encode(header: dict, payloads: list[Buffer] | None = None) -> list[Buffer]:
    return [json.dumps(header).encode(), *(payloads or [])]


def _bad_id(x, limits: Limits) -> bool:
    return not isinstance(x, str) or len(x) > limits.max_id_chars or "\0" in x


def decode_request(frames: list, limits: Limits) -> tuple[dict, list]:
    """Validate a request; returns (header, payload frames) or raises ProtocolError."""
    if not frames:
        raise ProtocolError("empty message")
    head = bytes(frames[0])
    if len(head) > limits.max_header_bytes:
        raise ProtocolError("header too large")
    try:
        header = json.loads(head)
    except (ValueError, RecursionError) as e:
        # ValueError: bad UTF-8 or JSON, and integers past Python's 4300-digit limit;
        # RecursionError: nesting deeper than the parser's stack
        raise ProtocolError(f"malformed header: {type(e).__name__}") from None
    if not isinstance(header, dict) or header.get("op") not in OPS:
        raise ProtocolError(f"unknown op {header.get('op') if isinstance(header, dict) else None!r}")
    tids = header.get("tids", [])
    if not isinstance(tids, list) or len(tids) > limits.max_tensors:
        raise ProtocolError("tids must be a list of at most "
                            f"{limits.max_tensors} ids")
    n = limits.max_id_chars
    if not all(type(t) is str and len(t) <= n and "\0" not in t for t in tids):
        raise ProtocolError(f"an id must be a string of at most {limits.max_id_chars} "
                            "characters without NUL")
    if header["op"] in ("put_object", "get_object") and _bad_id(header.get("key"), limits):
        raise ProtocolError(f"an object key must be a string of at most {limits.max_id_chars} "
                            "characters without NUL")
    payloads = frames[1:]
    if header["op"] == "put" and "tcp" in header:
        sums = header.get("sums")
        if payloads or not isinstance(sums, list) or len(sums) != len(tids) \
                or not all(map(_is_count, sums)):
            raise ProtocolError("a put over the data plane carries one checksum per tensor id "
                                "and no payload")
    elif header["op"] == "put":
        sums = header.get("sums")
        if len(payloads) != len(tids) or not isinstance(sums, list) or len(sums) != len(tids):
            raise ProtocolError("put needs one payload frame and one checksum per tensor id")
        total = 0
        for frame, c in zip(payloads, sums, strict=True):
            n = len(frame)
            total += n
            if n > limits.max_tensor_bytes:
                raise ProtocolError("tensor too large")
            if checksum(frame) != c:
                raise ProtocolError("checksum mismatch")
        if total > limits.max_message_bytes:
            raise ProtocolError("message too large")
    elif payloads:
        raise ProtocolError(f"{header['op']} takes no payload")
    if "shm" in header or header["op"] == "probe":
        _check_shm(header, tids)
    if "tcp" in header:
        _check_tcp(header, tids, limits)
    return header, payloads


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


MAX_STREAMS = 64


def _check_tcp(header: dict, tids: list, limits: Limits) -> None:
    tcp = header["tcp"]
    if header["op"] not in ("get", "put") or "shm" in header or not isinstance(tcp, dict):
        raise ProtocolError("tcp: only a get without shm, or a put, asks for the data plane")
    if header["op"] == "put":
        lengths = tcp.get("lengths")
        if not (isinstance(lengths, list) and len(lengths) == len(tids)
                and all(map(_is_count, lengths))):
            raise ProtocolError("tcp: a put needs one length per tensor id")
        if any(n > limits.max_tensor_bytes for n in lengths):
            raise ProtocolError("tensor too large")
        if sum(lengths) > limits.max_message_bytes:
            raise ProtocolError("message too large")
    streams = tcp.get("streams")
    if not _is_count(streams) or not 1 <= streams <= MAX_STREAMS:
        raise ProtocolError(f"tcp: streams must be 1..{MAX_STREAMS}")
    sizes = tcp.get("sizes")
    if sizes is not None and not (isinstance(sizes, list) and len(sizes) == len(tids)
                                  and all(map(_is_count, sizes))):
        raise ProtocolError("tcp: sizes must be one size per tensor id")
    if not isinstance(tcp.get("tls", False), bool):
        raise ProtocolError("tcp: tls must be a boolean")


_HEX_NONCE = re.compile(r"[0-9a-fA-F]{32}")


def _check_shm(header: dict, tids: list) -> None:
    shm = header.get("shm")
    if header["op"] not in ("get", "probe") or not isinstance(shm, dict) \
            or not (isinstance(shm.get("name"), str) or isinstance(shm.get("pool"), dict)):
        raise ProtocolError("shm: only get and probe name a segment")
    if "pool" in shm:
        if not isinstance(shm["pool"], dict):
            raise ProtocolError("shm: a pool is named by a spec object")
        if header["op"] == "probe":
            return
        until = shm.get("until")
        if not isinstance(until, (int, float)) or isinstance(until, bool) \
                or not math.isfinite(until):
            raise ProtocolError("a get into a pool needs a finite 'until'")
    else:
        # the segment's nonce (its first 16 bytes) proves the requester can read the segment:
        # its name alone is visible to anyone on the node (``ls /dev/shm``)
        nonce = shm.get("nonce")
        if not isinstance(nonce, str) or not _HEX_NONCE.fullmatch(nonce):
            raise ProtocolError("a segment's probe and get need its 16-byte hex nonce")
        if header["op"] == "probe":
            return
    offsets, sizes = shm.get("offsets"), shm.get("sizes")
    if not (isinstance(offsets, list) and isinstance(sizes, list)
            and len(offsets) == len(sizes) == len(tids)
            and all(map(_is_count, offsets)) and all(map(_is_count, sizes))):
        raise ProtocolError("shm get needs one offset and one size per tensor id")
