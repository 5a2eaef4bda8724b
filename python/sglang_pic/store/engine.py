"""The storage engine of one PTStore server: owned + replica tensor caches, GDSF eviction, an SSD
tier for owned tensors, and flat per-object metadata (seed 004).

Units. A *tensor* is one KV page (bytes) named by its page hash - the chained hash SGLang's
HiCache uses as a storage key (``h_i = H(h_{i-1}, page_i)``), so equal ids mean equal prefixes and
a prefix shared by many prompts is stored once ("incremental prefix tensors"). An *object* is a
prompt's prefix: its metadata is the flat list of its tensor ids, so a load is one lookup and one
batched fetch per owner, never a distributed trie walk.

Caches. Tensors this server *owns* (by consistent hashing, decided by the caller) live in the
owned cache; copies of hot tensors owned elsewhere live in the replica cache. Both are bounded in
bytes (a configurable split of one memory budget) and evicted by GDSF - priority
``L + frequency * cost / size`` with the inflation ``L`` raised to each victim's priority - so
small, frequently read pages do not push out large, expensive ones and idle pages age out.
Replicas are dropped (they can be fetched again); owned tensors are spilled to the SSD directory
instead of being lost, and the SSD tier survives a restart (file names are the tensor ids, the
metadata journal is replayed at start).
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

OWNED = "owned"
REPLICA = "replica"


@dataclass
class _Entry:
    data: bytes
    freq: int
    priority: float
    checksum: int | None = None  # as verified on arrival; None: compute when served


class GDSFCache:
    """Bytes-bounded map ``tensor id -> bytes`` with Greedy-Dual-Size-Frequency eviction.

    ``cost`` is what a miss costs relative to its size; for KV pages fetched over the network it
    is proportional to bytes, so ``cost / size`` is a constant and priority reduces to
    ``L + frequency`` - the aging LFU GDSF degenerates to, as the seed argues for prefixes (early
    pages are read by every prompt that shares them).
    """

    def __init__(self, capacity_bytes: int, on_evict=None) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self.inflation = 0.0
        self.entries: dict[str, _Entry] = {}
        self.on_evict = on_evict
        self.evictions = 0
        # (priority, order, id); entries whose priority changed leave stale rows that the
        # eviction loop skips, so a get is O(log n) and an eviction amortised O(log n)
        self._heap: list[tuple[float, int, str]] = []
        self._order = itertools.count()

    def _push(self, tid: str, e: _Entry) -> None:
        heapq.heappush(self._heap, (e.priority, next(self._order), tid))

    def __contains__(self, tid: str) -> bool:
        return tid in self.entries

    def get(self, tid: str) -> bytes | None:
        e = self.get_entry(tid)
        return None if e is None else e.data

    def get_entry(self, tid: str) -> _Entry | None:
        e = self.entries.get(tid)
        if e is None:
            return None
        e.freq += 1
        e.priority = self.inflation + e.freq
        self._push(tid, e)
        return e

    def put(self, tid: str, data: bytes, checksum: int | None = None) -> bool:
        """Insert (or refresh); False when ``data`` alone exceeds the capacity."""
        if len(data) > self.capacity:
            return False
        old = self.entries.pop(tid, None)
        if old is not None:
            self.used -= len(old.data)
        freq = old.freq + 1 if old else 1
        self._make_room(len(data))
        e = self.entries[tid] = _Entry(data, freq, self.inflation + freq, checksum)
        self._push(tid, e)
        self.used += len(data)
        return True

    def pop(self, tid: str) -> bytes | None:
        e = self.entries.pop(tid, None)
        if e is None:
            return None
        self.used -= len(e.data)
        return e.data

    def _make_room(self, nbytes: int) -> None:
        while self.used + nbytes > self.capacity and self.entries:
            priority, _, tid = heapq.heappop(self._heap)
            e = self.entries.get(tid)
            if e is None or e.priority != priority:
                continue  # a stale row: the entry was refreshed or removed since
            del self.entries[tid]
            self.used -= len(e.data)
            self.inflation = max(self.inflation, e.priority)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(tid, e.data)


class StoreEngine:
    """One server's tensors and object metadata; thread-safe."""

    def __init__(self, memory_bytes: int, replica_fraction: float = 0.3,
                 ssd_dir: str | os.PathLike | None = None, ssd_bytes: int = 0) -> None:
        if not 0.0 <= replica_fraction < 1.0:
            raise ValueError("replica_fraction must be in [0, 1)")
        self.lock = threading.RLock()
        replica_bytes = int(memory_bytes * replica_fraction)
        self.owned = GDSFCache(memory_bytes - replica_bytes, on_evict=self._spill)
        self.replica = GDSFCache(replica_bytes)
        self.objects: dict[str, list[str]] = {}
        self.ssd = Path(ssd_dir) if ssd_dir else None
        self.ssd_bytes = ssd_bytes
        self.ssd_used = 0
        self.stats = {"hits": 0, "misses": 0, "bytes_in": 0, "bytes_out": 0, "spills": 0,
                      "ssd_hits": 0, "dedup_bytes": 0}
        if self.ssd is not None:
            (self.ssd / "tensors").mkdir(parents=True, exist_ok=True)
            self._recover()

    # ---- tensors ----------------------------------------------------------------------
    def has(self, tid: str) -> bool:
        with self.lock:
            return tid in self.owned or tid in self.replica or self._ssd_path(tid) is not None

    def put_tensors(self, items: list[tuple[str, bytes]], kind: str = OWNED,
                    checksums: list[int] | None = None) -> int:
        """Store pages not already present (with their verified ``checksums``, kept with the
        bytes); returns the bytes actually added."""
        added = 0
        with self.lock:
            for i, (tid, data) in enumerate(items):
                if tid in self.owned or (kind == REPLICA and tid in self.replica):
                    self.stats["dedup_bytes"] += len(data)
                    continue
                cache = self.owned if kind == OWNED else self.replica
                if cache.put(tid, data, checksums[i] if checksums else None):
                    added += len(data)
            self.stats["bytes_in"] += added
        return added

    def get_tensors(self, tids: list[str]) -> list[bytes | None]:
        return [None if t is None else t[0] for t in self.get_tensors_checked(tids)]

    def get_tensors_checked(self, tids: list[str]) -> list[tuple[bytes, int | None] | None]:
        """``(bytes, checksum of exactly those bytes or None)`` per id; None when absent. A page
        read back from SSD has no remembered checksum (the caller computes it)."""
        out: list[tuple[bytes, int | None] | None] = []
        with self.lock:
            for tid in tids:
                e = self.owned.get_entry(tid) or self.replica.get_entry(tid)
                found = (e.data, e.checksum) if e is not None else None
                if found is None:
                    data = self._ssd_read(tid)
                    found = None if data is None else (data, None)
                self.stats["hits" if found is not None else "misses"] += 1
                self.stats["bytes_out"] += len(found[0]) if found else 0
                out.append(found)
        return out

    # ---- objects (flat metadata) --------------------------------------------------------
    def put_object(self, key: str, tids: list[str]) -> None:
        with self.lock:
            self.objects[key] = list(tids)
            self._journal({"object": key, "tids": tids})

    def get_object(self, key: str) -> list[str] | None:
        with self.lock:
            return self.objects.get(key)

    # ---- SSD tier -----------------------------------------------------------------------
    def _ssd_path(self, tid: str) -> Path | None:
        if self.ssd is None:
            return None
        p = self.ssd / "tensors" / tid
        return p if p.exists() else None

    def _spill(self, tid: str, data: bytes) -> None:
        """Owned tensors leave memory for the SSD directory, never into nothing."""
        if self.ssd is None or self._ssd_path(tid) is not None:
            return  # already on SSD: that copy serves the id (served with its own checksum)
        if self.ssd_bytes and self.ssd_used + len(data) > self.ssd_bytes:
            return
        tmp = self.ssd / "tensors" / f".{tid}.tmp"
        tmp.write_bytes(data)
        tmp.replace(self.ssd / "tensors" / tid)  # atomic: a crash never leaves half a page
        self.ssd_used += len(data)
        self.stats["spills"] += 1

    def _ssd_read(self, tid: str) -> bytes | None:
        p = self._ssd_path(tid)
        if p is None:
            return None
        self.stats["ssd_hits"] += 1
        return p.read_bytes()

    def _journal(self, record: dict) -> None:
        if self.ssd is None:
            return
        with open(self.ssd / "objects.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def _recover(self) -> None:
        self.ssd_used = sum(f.stat().st_size for f in (self.ssd / "tensors").glob("[!.]*"))
        journal = self.ssd / "objects.jsonl"
        if not journal.exists():
            return
        for line in journal.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line after a crash
            self.objects[rec["object"]] = rec["tids"]

    def flush_to_ssd(self) -> None:
        """Write every owned tensor to the SSD tier (graceful shutdown)."""
        with self.lock:
            for tid, e in list(self.owned.entries.items()):
                self._spill(tid, e.data)
