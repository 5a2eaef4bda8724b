"""The client's side of the same-node data path (``shm``): which servers share the reader's node,
its staging segments, and its host pool as a destination servers write into.

Why a class of its own: the client (``client.StoreClient``) plans each load over three ways a
page can travel (the CURVE socket, the TCP data plane, shared memory); what shared memory needs
to be known first (which servers map the reader's segments or its pool, proved once per server
by a ``probe``) and the segments it lends out are state of their own, kept here.

* Staging segments (``ClientSegment``, ``segment_bytes`` each) are pooled: a load holds one, so
  concurrent loads never share one. Where ``/dev/shm`` has no room the plane turns itself off
  and every page goes over a socket.
* ``use_pool`` names SGLang's host pool (a memfd: ``"allocator": "shm"``); the servers that
  prove they can open it (``pool_ok``) write pages straight into their destinations.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from .channels import ServerChannels
from .shm import ClientSegment, pool_spec


class SameNodePlane:
    def __init__(self, channels: ServerChannels, servers: list[str], enabled: bool,
                 segment_bytes: int) -> None:
        self.channels = channels
        self.servers = servers
        self.enabled = enabled  # False: no page moves through shared memory
        self.segment_bytes = segment_bytes
        self.shm_ok: dict[str, bool] = {}  # server -> maps our segments (probed once)
        self.pool: tuple[dict, int, int] | None = None  # (pool_spec, address, size)
        self.pool_ok: dict[str, bool] = {}  # server -> maps our pool (probed once)
        self.segments: list[ClientSegment] = []
        self._free: list[ClientSegment] = []
        self._lock = threading.Lock()

    def acquire(self) -> ClientSegment | None:
        """A staging segment for one load (None where shared memory is off or unavailable)."""
        if not self.enabled:
            return None
        with self._lock:
            if self._free:
                return self._free.pop()
        seg = ClientSegment.create(self.segment_bytes)
        if seg is None:
            self.enabled = False  # no /dev/shm room on this node: sockets only
            return None
        with self._lock:
            self.segments.append(seg)
        return seg

    def release(self, seg: ClientSegment | None) -> None:
        if seg is not None:
            with self._lock:
                self._free.append(seg)

    def prepare(self) -> None:
        """Create a segment and probe every server now, so the first load does not pay for it
        (reserving the segment's memory takes ~0.1 s per 256 MB)."""
        seg = self.acquire()
        if seg is not None:
            try:
                self.near(self.servers, seg)
            finally:
                self.release(seg)

    def near(self, servers: Iterable[str], seg: ClientSegment) -> set[str]:
        """The servers among ``servers`` that map our segments (each probed once; a server that
        does not answer is asked again next time)."""
        return self._probe(list(servers), {"name": seg.name, "nonce": seg.nonce.hex()},
                           self.shm_ok)

    def _probe(self, servers: list[str], shm: dict, known: dict[str, bool]) -> set[str]:
        unknown = [s for s in servers if s not in known]
        if unknown:
            replies = self.channels.round_trips({s: ({"op": "probe", "shm": shm}, None)
                                                 for s in unknown}, 0)
            for s in unknown:
                if replies.get(s) is not None:
                    known[s] = bool(replies[s][0].get("ok") and replies[s][0].get("shm"))
        return {s for s in servers if known.get(s)}

    def use_pool(self, fd: int, address: int, size: int) -> None:
        """Destinations in ``[address, address + size)`` are the shared-memory file ``fd`` of
        this process: servers on this node write pages there directly. Probes every server now,
        off the first load's path."""
        spec = pool_spec(fd)
        self.pool_ok.clear()
        self._probe(self.servers, {"pool": spec}, self.pool_ok)
        self.pool = (spec, address, size)  # only once the probe went through

    def in_pool(self, groups: dict[str, list[int]], addrs: list[int] | None,
                sizes: list[int] | None) -> dict[str, list[int]]:
        """Per same-node server of ``groups`` (server -> positions), the positions whose
        destinations (``addrs``, ``sizes``) lie in our pool: the server writes them there."""
        if self.pool is None or addrs is None or sizes is None:
            return {}
        spec, base, size = self.pool
        out = {}
        for s in self._probe(list(groups), {"pool": spec}, self.pool_ok):
            idx = [i for i in groups[s] if base <= addrs[i] and addrs[i] + sizes[i] <= base + size]
            if idx:
                out[s] = idx
        return out

    def close(self) -> None:
        with self._lock:
            for seg in self.segments:
                seg.close()
            self.segments.clear()
            self._free.clear()
