"""A PTStore server: a zmq ROUTER socket in front of a :class:`StoreEngine`.

One request = one multipart message (``protocol``); a batched get or put for many pages is one
round trip. Bad input (malformed, unauthenticated, oversized, wrong checksum) is answered with an
error and counted; the server keeps serving. ``status`` returns counters; ``metrics_text()``
renders them in the Prometheus exposition format.
"""

from __future__ import annotations

import logging
import threading

import zmq

from .engine import OWNED, REPLICA, StoreEngine
from .protocol import Limits, ProtocolError, checksum, decode_request, encode
from .shm import DATA_OFFSET, SegmentCache

logger = logging.getLogger(__name__)


def _checksum_of(data: bytes, known: int | None) -> int:
    """The checksum remembered since the put, or (a page read back from SSD) computed now."""
    return checksum(data) if known is None else known


class StoreServer:
    def __init__(self, engine: StoreEngine, endpoint: str, token: str | None = None,
                 limits: Limits | None = None) -> None:
        limits = limits or Limits()
        self.engine = engine
        self.endpoint = endpoint
        self.token = token
        self.limits = limits
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes + limits.max_header_bytes)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.segments = SegmentCache()  # readers' shared-memory segments on this node
        self.requests = 0
        self.rejected = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StoreServer:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sock.close(0)
        self.segments.close()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self.sock.recv_multipart(copy=False)
            ident, body = frames[0], [f.buffer for f in frames[1:]]
            self.sock.send_multipart([ident, *self.handle(body)], copy=False)

    def handle(self, body: list) -> list[bytes]:
        self.requests += 1
        try:
            header, payloads = decode_request(body, self.limits, self.token)
            return self._dispatch(header, payloads)
        except ProtocolError as e:
            self.rejected += 1
            return encode({"ok": False, "error": str(e)})
        except Exception as e:  # never let one request take the server down
            logger.exception("store request failed")
            self.rejected += 1
            return encode({"ok": False, "error": f"internal error: {type(e).__name__}"})

    def _dispatch(self, header: dict, payloads: list) -> list[bytes]:
        op, tids = header["op"], header.get("tids", [])
        eng = self.engine
        if op == "put":
            kind = REPLICA if header.get("kind") == REPLICA else OWNED
            # the checksums were verified on arrival (decode_request): kept with the bytes, so a
            # get does not hash them again
            added = eng.put_tensors([(t, bytes(p)) for t, p in zip(tids, payloads, strict=True)],
                                    kind, header["sums"])
            return encode({"ok": True, "added_bytes": added})
        if op == "probe":
            try:
                seen = self.segments.get(header["shm"]["name"])[:16]
                same = seen == bytes.fromhex(header["shm"]["nonce"])
            except (OSError, ValueError):
                same = False
            return encode({"ok": True, "shm": same})
        if op == "get" and "shm" in header:
            return self._get_into_segment(tids, header["shm"])
        if op == "get":
            got = eng.get_tensors_checked(tids)
            present = [g for g in got if g is not None]
            return encode({"ok": True, "found": [g is not None for g in got],
                           "sums": [_checksum_of(d, s) for d, s in present]},
                          [d for d, _ in present])
        if op == "exists":
            return encode({"ok": True, "found": [eng.has(t) for t in tids]})
        if op == "put_object":
            eng.put_object(str(header.get("key")), tids)
            return encode({"ok": True})
        if op == "get_object":
            return encode({"ok": True, "tids": eng.get_object(str(header.get("key")))})
        return encode({"ok": True, "status": self.status()})

    def _get_into_segment(self, tids: list[str], shm: dict) -> list[bytes]:
        """Copy each found page of the expected size to its offset in the reader's segment; the
        reply names which were found, with their checksums."""
        try:
            mm = self.segments.get(shm["name"])
        except (OSError, ValueError) as e:
            raise ProtocolError(f"shm segment unavailable: {e}") from None
        offsets, sizes = shm["offsets"], shm["sizes"]
        if any(o < DATA_OFFSET or o + n > len(mm) for o, n in zip(offsets, sizes, strict=True)):
            raise ProtocolError("shm offsets outside the segment")
        found, sums = [], []
        for got, off, n in zip(self.engine.get_tensors_checked(tids), offsets, sizes,
                               strict=True):
            if got is None or len(got[0]) != n:  # absent, or a page of another shape: a miss
                found.append(False)
                continue
            data, s = got
            mm[off:off + n] = data
            found.append(True)
            sums.append(_checksum_of(data, s))
        return encode({"ok": True, "found": found, "sums": sums})

    def status(self) -> dict:
        eng = self.engine
        return {**eng.stats, "requests": self.requests, "rejected": self.rejected,
                "owned_bytes": eng.owned.used, "replica_bytes": eng.replica.used,
                "owned_tensors": len(eng.owned.entries),
                "replica_tensors": len(eng.replica.entries),
                "evictions": eng.owned.evictions + eng.replica.evictions,
                "objects": len(eng.objects)}

    def metrics_text(self) -> str:
        """The counters in Prometheus text format (``ptstore_<name>``)."""
        lines = []
        for k, v in self.status().items():
            lines += [f"# TYPE ptstore_{k} gauge", f"ptstore_{k} {v}"]
        return "\n".join(lines) + "\n"
