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

A header is validated whole against its op's schema (``Put`` ... ``Probe``, msgspec structs that
refuse any field they do not declare and any value of another type) before anything reads it; the
checks a schema cannot state (lengths that must agree, the configured limits) follow. A get names
each id once: a repeated id would be read and sent again, one small request for a huge reply.
"""

from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
import xxhash


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


Count = Annotated[int, msgspec.Meta(ge=0)]
"""A length, offset, size, checksum or handle: an integer from 0 to 2**64 - 1 (not a bool)."""
MAX_STREAMS = 64
Streams = Annotated[int, msgspec.Meta(ge=1, le=MAX_STREAMS)]
Nonce = Annotated[str, msgspec.Meta(pattern="^[0-9a-fA-F]{32}$")]
Proof = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]


class _Schema(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A part of a request: exactly these fields, of these types; anything else is refused."""


class PoolSpec(_Schema):
    """A reader's host KV pool on the server's node (``shm.pool_spec``)."""

    pid: Count
    fd: Count
    dev: Count
    ino: Count
    ticket: Count
    proof: Proof


class ShmSpec(_Schema):
    """A get's or probe's shared memory: a staging segment (``name`` and ``nonce``) or a
    reader's pool (``pool``); a get adds ``offsets`` and ``sizes`` (and ``until`` into a
    pool)."""

    name: str | None = None
    nonce: Nonce | None = None
    pool: PoolSpec | None = None
    offsets: list[Count] | None = None
    sizes: list[Count] | None = None
    until: float | None = None


class GetTcp(_Schema):
    streams: Streams
    sizes: list[Count] | None = None
    tls: bool = False


class PutTcp(_Schema):
    streams: Streams
    lengths: list[Count]
    tls: bool = False


class _Request(_Schema, tag_field="op"):
    pass


class Put(_Request, tag="put"):
    sums: list[Count]
    tids: list[str] = []
    kind: Literal["owned", "replica"] | None = None
    tcp: PutTcp | None = None


class Get(_Request, tag="get"):
    tids: list[str] = []
    shm: ShmSpec | None = None
    tcp: GetTcp | None = None


class Exists(_Request, tag="exists"):
    tids: list[str] = []


class PutObject(_Request, tag="put_object"):
    key: str
    tids: list[str] = []


class GetObject(_Request, tag="get_object"):
    key: str


class Status(_Request, tag="status"):
    pass


class Probe(_Request, tag="probe"):
    shm: ShmSpec


_DECODER = msgspec.json.Decoder(Put | Get | Exists | PutObject | GetObject | Status | Probe)


def _bad_id(x: str, limits: Limits) -> bool:
    return len(x) > limits.max_id_chars or "\0" in x


def _refusal(e: msgspec.DecodeError) -> str:
    """msgspec's reason, which names the offending field (as much of it as a reply carries)."""
    why = str(e)
    return why if len(why) <= 300 else why[:300] + "..."


def decode_request(frames: list, limits: Limits) -> tuple[dict, list]:
    """Validate a request as a whole; returns (header, payload frames) or raises
    ProtocolError. The header must be one of the ops' schemas exactly (``_DECODER``: no other
    field, every value of its type); then the checks a schema cannot state (lengths that must
    agree, the configured limits)."""
    if not frames:
        raise ProtocolError("empty message")
    head = frames[0]
    if len(head) > limits.max_header_bytes:
        raise ProtocolError("header too large")
    try:
        request = _DECODER.decode(head)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid request: {_refusal(e)}") from None
    except msgspec.DecodeError as e:  # not JSON (nor UTF-8)
        raise ProtocolError(f"malformed header: {_refusal(e)}") from None
    header = msgspec.to_builtins(request)
    op = header["op"]
    tids = header.get("tids", [])
    if len(tids) > limits.max_tensors:
        raise ProtocolError(f"tids must be a list of at most {limits.max_tensors} ids")
    if any(_bad_id(t, limits) for t in tids):
        raise ProtocolError(f"an id must be a string of at most {limits.max_id_chars} "
                            "characters without NUL")
    if op in ("put_object", "get_object") and _bad_id(header["key"], limits):
        raise ProtocolError(f"an object key must be a string of at most {limits.max_id_chars} "
                            "characters without NUL")
    if op == "get" and len(set(tids)) != len(tids):
        # each repeat would be sent (or read from SSD) again: one small request, a huge reply
        raise ProtocolError("a get names each tensor id once")
    payloads = frames[1:]
    if op == "put":
        _check_put(header, tids, payloads, limits)
    elif payloads:
        raise ProtocolError(f"{op} takes no payload")
    if "shm" in header:
        if "tcp" in header:
            raise ProtocolError("tcp: only a get without shm, or a put, asks for the data plane")
        _check_shm(header, tids)
    if op == "get" and "tcp" in header:
        sizes = header["tcp"].get("sizes")
        if sizes is not None and len(sizes) != len(tids):
            raise ProtocolError("tcp: sizes must be one size per tensor id")
    return header, payloads


def _check_put(header: dict, tids: list, payloads: list, limits: Limits) -> None:
    sums = header["sums"]
    if "tcp" in header:
        if payloads or len(sums) != len(tids):
            raise ProtocolError("a put over the data plane carries one checksum per tensor id "
                                "and no payload")
        lengths = header["tcp"]["lengths"]
        if len(lengths) != len(tids):
            raise ProtocolError("tcp: a put needs one length per tensor id")
        if any(n > limits.max_tensor_bytes for n in lengths):
            raise ProtocolError("tensor too large")
        if sum(lengths) > limits.max_message_bytes:
            raise ProtocolError("message too large")
        return
    if len(payloads) != len(tids) or len(sums) != len(tids):
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


def _check_shm(header: dict, tids: list) -> None:
    shm = header["shm"]
    if ("name" in shm) == ("pool" in shm):
        raise ProtocolError("shm: a segment is named by 'name' or by 'pool', one of them")
    if "name" in shm and "nonce" not in shm:
        # the segment's nonce (its first 16 bytes) proves the requester can read the segment:
        # its name alone is visible to anyone on the node (``ls /dev/shm``)
        raise ProtocolError("a segment's probe and get need its 16-byte hex nonce")
    if header["op"] == "probe":
        return
    if "pool" in shm:
        until = shm.get("until")
        if until is None or not math.isfinite(until):
            raise ProtocolError("a get into a pool needs a finite 'until'")
    offsets, sizes = shm.get("offsets"), shm.get("sizes")
    if offsets is None or sizes is None or not len(offsets) == len(sizes) == len(tids):
        raise ProtocolError("shm get needs one offset and one size per tensor id")
