"""The storage engine of one PTStore server: owned + replica tensor caches, GDSF eviction, an SSD
tier for owned tensors, and flat per-object metadata (the PTStore design).

Units. A *tensor* is one KV page (bytes) named by its page hash - the chained hash SGLang's
HiCache uses as a storage key (``h_i = H(h_{i-1}, page_i)``), so equal ids mean equal prefixes and
a prefix shared by many prompts is stored once ("incremental prefix tensors"). An *object* is a
prompt's prefix: its metadata is the flat list of its tensor ids, so a load is one lookup and one
batched fetch per owner, never a distributed trie walk.

Caches. Tensors this server *owns* (by consistent hashing, decided by the caller) live in the
owned cache; copies of hot tensors owned elsewhere live in the replica cache. Both are bounded in
bytes (a configurable split of one memory budget) and evicted by GDSF (``gdsf``) - priority
``L + frequency * cost / size`` with the inflation ``L`` raised to each victim's priority - so
small, frequently read pages do not push out large, expensive ones and idle pages age out.
Replicas are dropped (they can be fetched again); owned tensors are spilled to the SSD tier
(``ssd``: bounded, GDSF too, files named by digests and verified on every read) instead of being
lost, and the SSD tier survives a restart, as does the object metadata (a journal replayed at
start and rewritten with only the live objects once it holds twice as many records).

Ids are opaque: the engine never interprets one (the server prefixes each with its tenant's
name, ``tenant \0 id``, so tenants never see each other's pages).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from .gdsf import Entry, GDSFCache
from .protocol import checksum
from .ssd import SSDTier

__all__ = ["OWNED", "REPLICA", "GDSFCache", "StoreEngine"]

logger = logging.getLogger(__name__)

OWNED = "owned"
REPLICA = "replica"
DEFAULT_SSD_BYTES = 64 << 30
MAX_OBJECTS = 1 << 20
MAX_OBJECT_BYTES = 1 << 30
# what an object costs besides its key's and ids' characters: the dict slot, the list, and a
# str header and list slot per id (CPython 3.12)
OBJECT_BYTES, OBJECT_ID_BYTES = 200, 64


def _object_size(key: str, tids: list[str]) -> int:
    return OBJECT_BYTES + len(key) + sum(len(t) + OBJECT_ID_BYTES for t in tids)


def _tenant_of_key(key: str) -> str:
    """The tenant of a stored object key (the server prefixes each with ``tenant + NUL``)."""
    return key.split("\0", 1)[0] if "\0" in key else ""


class StoreEngine:
    """One server's tensors and object metadata; thread-safe.

    ``ssd_bytes``: the SSD tier's budget (capped by the filesystem's free space, ``ssd``; 0:
    only that cap). ``max_objects`` and ``max_object_bytes``: the objects kept and the memory
    they may take; beyond either, the tenant holding the most bytes of objects loses its
    oldest one, so a tenant writing many objects drops its own before anyone else's."""

    def __init__(self, memory_bytes: int, replica_fraction: float = 0.3,
                 ssd_dir: str | os.PathLike | None = None,
                 ssd_bytes: int = DEFAULT_SSD_BYTES, max_objects: int = MAX_OBJECTS,
                 max_object_bytes: int = MAX_OBJECT_BYTES) -> None:
        if not 0.0 <= replica_fraction < 1.0:
            raise ValueError("replica_fraction must be in [0, 1)")
        self.lock = threading.RLock()
        replica_bytes = int(memory_bytes * replica_fraction)
        self.owned = GDSFCache(memory_bytes - replica_bytes, on_evict=self._spill)
        self.replica = GDSFCache(replica_bytes)
        self.objects: dict[str, list[str]] = {}
        self.max_objects = max_objects
        self.max_object_bytes = max_object_bytes
        # per tenant: its objects' sizes, oldest written first, and their sum
        self._tenant_objects: dict[str, OrderedDict[str, int]] = {}
        self._tenant_object_bytes: dict[str, int] = {}
        self.object_bytes = 0
        self.stats = {"hits": 0, "misses": 0, "bytes_in": 0, "bytes_out": 0, "spills": 0,
                      "ssd_hits": 0, "dedup_bytes": 0}
        self.root = Path(ssd_dir) if ssd_dir else None
        self.ssd = SSDTier(self.root, ssd_bytes, self.stats) if self.root else None
        self._journal_records = 0
        if self.root is not None:
            self._recover_objects()

    @property
    def ssd_used(self) -> int:
        return self.ssd.used if self.ssd is not None else 0

    # ---- tensors ----------------------------------------------------------------------
    def has(self, tid: str) -> bool:
        with self.lock:
            return (tid in self.owned or tid in self.replica
                    or (self.ssd is not None and tid in self.ssd))

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
        from memory stored without a checksum has None (the caller computes it); a page from
        SSD has the one kept in its file, verified against its bytes."""
        out: list[tuple[bytes, int | None] | None] = []
        with self.lock:
            for tid in tids:
                e = self.owned.get_entry(tid) or self.replica.get_entry(tid)
                found = (e.data, e.checksum) if e is not None else None
                if found is None and self.ssd is not None:
                    found = self.ssd.read(tid)
                self.stats["hits" if found is not None else "misses"] += 1
                self.stats["bytes_out"] += len(found[0]) if found else 0
                out.append(found)
        return out

    # ---- objects (flat metadata) --------------------------------------------------------
    def put_object(self, key: str, tids: list[str]) -> None:
        with self.lock:
            self._set_object(key, list(tids))
            self._journal({"object": key, "tids": tids})

    def get_object(self, key: str) -> list[str] | None:
        with self.lock:
            return self.objects.get(key)

    def _set_object(self, key: str, tids: list[str]) -> None:
        self._drop_object(key)  # re-inserted last: the oldest written is dropped first
        tenant, size = _tenant_of_key(key), _object_size(key, tids)
        self.objects[key] = tids
        self._tenant_objects.setdefault(tenant, OrderedDict())[key] = size
        self._tenant_object_bytes[tenant] = self._tenant_object_bytes.get(tenant, 0) + size
        self.object_bytes += size
        while self.objects and (len(self.objects) > self.max_objects
                                or self.object_bytes > self.max_object_bytes):
            heaviest = max(self._tenant_object_bytes, key=self._tenant_object_bytes.get)
            self._drop_object(next(iter(self._tenant_objects[heaviest])))

    def _drop_object(self, key: str) -> None:
        if self.objects.pop(key, None) is None:
            return
        tenant = _tenant_of_key(key)
        own = self._tenant_objects[tenant]
        size = own.pop(key)
        self.object_bytes -= size
        self._tenant_object_bytes[tenant] -= size
        if not own:
            del self._tenant_objects[tenant], self._tenant_object_bytes[tenant]

    # ---- SSD tier -----------------------------------------------------------------------
    def _spill(self, tid: str, e: Entry) -> None:
        """Owned tensors leave memory for the SSD tier, never into nothing (unless it cannot
        take them: the page is then lost, and the failure logged by the tier)."""
        if self.ssd is None or tid in self.ssd:
            return  # already on SSD: that copy serves the id (served with its own checksum)
        csum = e.checksum if e.checksum is not None else checksum(e.data)
        self.ssd.write(tid, e.data, csum, e.freq)

    def _journal(self, record: dict) -> None:
        if self.root is None:
            return
        try:
            with open(self.root / "objects.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            self._journal_records += 1
            if self._journal_records > max(64, 2 * len(self.objects)):
                self._compact_journal()
        except OSError as e:  # the object stays in memory; a restart may not recover it
            logger.warning("PTStore: writing the object journal failed: %s", e)

    def _compact_journal(self) -> None:
        """Rewrite the journal with one record per live object (atomically: a crash leaves the
        old or the new file)."""
        journal = self.root / "objects.jsonl"
        tmp = journal.with_name(".objects.jsonl.tmp")
        with open(tmp, "w") as f:
            for key, tids in self.objects.items():
                f.write(json.dumps({"object": key, "tids": tids}) + "\n")
        os.replace(tmp, journal)
        self._journal_records = len(self.objects)

    def _recover_objects(self) -> None:
        journal = self.root / "objects.jsonl"
        if not journal.exists():
            return
        for line in journal.read_text().splitlines():
            self._journal_records += 1
            try:
                rec = json.loads(line)
                key, tids = rec["object"], rec["tids"]
            except (json.JSONDecodeError, TypeError, KeyError):
                continue  # a torn last line after a crash
            if isinstance(key, str) and isinstance(tids, list):
                self._set_object(key, tids)

    def flush_to_ssd(self) -> int:
        """Write every owned tensor to the SSD tier (graceful shutdown); a page that fails is
        logged and skipped. Returns the pages written."""
        if self.ssd is None:
            return 0
        with self.lock:
            before = self.stats["spills"]
            for tid, e in list(self.owned.entries.items()):
                try:
                    self._spill(tid, e)
                except Exception:  # one page must never cost the others their place on disk
                    logger.exception("PTStore: flushing a page to SSD failed")
                    self.stats["ssd_errors"] += 1
            return self.stats["spills"] - before
