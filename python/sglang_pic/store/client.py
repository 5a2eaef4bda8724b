"""PTStore client: consistent-hash ownership over the servers, one batched RPC per owner.

A tensor id (page hash) is owned by the first server clockwise from its hash on a ring with
``vnodes`` virtual nodes per server. ``batch_get`` / ``batch_set`` / ``batch_exists`` group ids by
owner and send one message to each. A server that does not answer within ``timeout_ms`` (down,
overloaded) yields misses for its ids - never an exception, never a wrong page: payloads whose
CRC does not match are dropped as misses too.

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
import json
import uuid
from collections import OrderedDict, defaultdict

import zmq

from .protocol import crc, encode


def _point(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, servers: list[str], vnodes: int = 64) -> None:
        self.ring = sorted((_point(f"{s}#{i}"), s) for s in servers for i in range(vnodes))
        self.keys = [k for k, _ in self.ring]

    def owner(self, tid: str) -> str:
        i = bisect.bisect(self.keys, _point(tid)) % len(self.ring)
        return self.ring[i][1]


class StoreClient:
    TRACKED_PAGES = 1 << 20
    """Bound on the pages whose remote reads (or local replicas) the client remembers."""

    def __init__(self, servers: list[str], token: str | None = None, timeout_ms: int = 2000,
                 local: str | None = None, replicate_after: int = 2):
        if not servers:
            raise ValueError("PTStore client needs at least one server endpoint")
        if replicate_after < 1:
            raise ValueError("replicate_after must be >= 1")
        self.servers = list(servers)
        self.ring = HashRing(self.servers)
        self.token = token
        self.timeout_ms = timeout_ms
        self.local = local
        self.replicate_after = replicate_after
        self.ctx = zmq.Context.instance()
        self.socks: dict[str, zmq.Socket] = {}
        self.rpcs = 0
        self.remote_reads: OrderedDict[str, int] = OrderedDict()
        self.replicated: OrderedDict[str, None] = OrderedDict()
        self.stats = {"replicated_pages": 0, "replica_hits": 0}

    def _sock(self, server: str) -> zmq.Socket:
        s = self.socks.get(server)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
            s.connect(server)
            self.socks[server] = s
        return s

    def _call(self, server: str, header: dict, payloads: list[bytes] | None = None):
        """One round trip; None on timeout (the socket is replaced: no stale reply later)."""
        sock = self._sock(server)
        self.rpcs += 1
        sock.send_multipart(encode({**header, "token": self.token}, payloads), copy=False)
        if not sock.poll(self.timeout_ms):
            sock.close(0)
            self.socks.pop(server, None)
            return None
        frames = sock.recv_multipart(copy=False)
        return json.loads(bytes(frames[0])), [f.buffer for f in frames[1:]]

    def _by_owner(self, tids: list[str], owners: list[str] | None = None,
                  positions: list[int] | None = None) -> dict[str, list[int]]:
        """Positions of ``tids`` (all, or ``positions``) grouped by owner (``owners[i]``, or the
        ring's answer)."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i in range(len(tids)) if positions is None else positions:
            groups[owners[i] if owners is not None else self.ring.owner(tids[i])].append(i)
        return groups

    def batch_set(self, items: list[tuple[str, bytes]]) -> int:
        """Store pages on their owners; returns bytes the servers actually added (pages they
        already held add nothing). Ids whose owner failed are in ``self.last_failed``."""
        added = 0
        tids = [t for t, _ in items]
        self.last_failed: list[str] = []
        for server, idx in self._by_owner(tids).items():
            payloads = [items[i][1] for i in idx]
            reply = self._call(server, {"op": "put", "tids": [tids[i] for i in idx],
                                        "crc": [crc(p) for p in payloads]}, payloads)
            if reply is not None and reply[0].get("ok"):
                added += reply[0]["added_bytes"]
            else:
                self.last_failed += [tids[i] for i in idx]
        return added

    def _get_from(self, server: str, tids: list[str], idx: list[int],
                  out: list[bytes | None]) -> None:
        reply = self._call(server, {"op": "get", "tids": [tids[i] for i in idx]})
        if reply is None or not reply[0].get("ok"):
            return
        header, payloads = reply
        it = iter(zip(payloads, header["crc"], strict=True))
        for i, found in zip(idx, header["found"], strict=True):
            if found:
                data, c = next(it)
                if crc(data) == c:
                    out[i] = bytes(data)

    def batch_get(self, tids: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(tids)
        if self.local is not None:
            near = [i for i, t in enumerate(tids) if t in self.replicated]
            if near:
                self._get_from(self.local, tids, near, out)
                for i in near:
                    if out[i] is None:  # the replica was evicted: ask the owner again
                        self.replicated.pop(tids[i], None)
                    else:
                        self.stats["replica_hits"] += 1
        owners = [self.ring.owner(t) for t in tids]
        missing = [i for i in range(len(tids)) if out[i] is None]
        for server, idx in self._by_owner(tids, owners, missing).items():
            self._get_from(server, tids, idx, out)
        if self.local is not None:
            self._replicate_hot(tids, owners, out)
        return out

    def _replicate_hot(self, tids: list[str], owners: list[str],
                       data: list[bytes | None]) -> None:
        """Copy pages read often enough from remote owners into the local replica cache."""
        hot: list[tuple[str, bytes]] = []
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
        reply = self._call(self.local, {"op": "put", "kind": "replica",
                                        "tids": [t for t, _ in hot],
                                        "crc": [crc(d) for _, d in hot]}, [d for _, d in hot])
        if reply is not None and reply[0].get("ok"):
            for t, _ in hot:
                self.replicated[t] = None
                if len(self.replicated) > self.TRACKED_PAGES:
                    self.replicated.popitem(last=False)
            self.stats["replicated_pages"] += len(hot)

    def batch_exists(self, tids: list[str]) -> list[bool]:
        out = [False] * len(tids)
        for server, idx in self._by_owner(tids).items():
            reply = self._call(server, {"op": "exists", "tids": [tids[i] for i in idx]})
            if reply is not None and reply[0].get("ok"):
                for i, f in zip(idx, reply[0]["found"], strict=True):
                    out[i] = bool(f)
        return out

    def status(self, server: str) -> dict | None:
        reply = self._call(server, {"op": "status"})
        return reply[0].get("status") if reply else None

    def close(self) -> None:
        for s in self.socks.values():
            s.close(0)
        self.socks.clear()
