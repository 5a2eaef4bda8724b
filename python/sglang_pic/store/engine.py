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
start and rewritten with only the live objects once it holds twice as many records, or more
than twice their bytes plus ``JOURNAL_SLACK_BYTES``).

The journal counts against the SSD budget: its bytes are taken from the pages' room (the SSD
tier evicts pages for them), and it may take at most ``JOURNAL_FRACTION`` of the budget, so
objects never crowd out every page. Live objects whose records would take more than half that share
(``JOURNAL_LIVE_SHARE``: a rewrite then leaves room to append) lose their oldest (the heaviest
tenant's first, as for the other object bounds), and an object whose record alone is larger than
that half is refused (``ObjectRefused``); the file never grows past the share. A damaged journal
line (bad UTF-8, JSON Python cannot parse, a record of the wrong shape, a line longer than the
share) is skipped at start, counted in one warning, and the journal is rewritten without it.

Ids are opaque: the engine never interprets one (the server prefixes each with its tenant's
name, ``tenant \0 id``, so tenants never see each other's pages).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .gdsf import Entry, GDSFCache
from .protocol import ProtocolError, checksum
from .ssd import SSDTier

__all__ = ["OWNED", "REPLICA", "GDSFCache", "ObjectRefused", "StoreEngine"]

logger = logging.getLogger(__name__)

OWNED = "owned"
REPLICA = "replica"
DEFAULT_SSD_BYTES = 64 << 30
MAX_OBJECTS = 1 << 20
MAX_OBJECT_BYTES = 1 << 30
# what an object costs besides its key's and ids' characters: the dict slot, the list, and a
# str header and list slot per id (CPython 3.12)
OBJECT_BYTES, OBJECT_ID_BYTES = 200, 64
JOURNAL = "objects.jsonl"
JOURNAL_FRACTION = 0.25
"""The share of the SSD budget the object journal may take; the pages keep the rest."""
JOURNAL_LIVE_SHARE = 0.5
"""The part of the journal's share the live objects' records may take: a rewrite leaves the rest
free for appends, so it comes at most once per that many bytes appended (with the live records
up against the share itself, every put would rewrite the whole journal)."""
JOURNAL_SLACK_BYTES = 1 << 20
"""Bytes of dead records the journal may hold beyond its live ones' before it is rewritten: with
few live objects, "twice the live bytes" alone would rewrite the file on almost every put."""


class ObjectRefused(ProtocolError):
    """A ``put_object`` the store cannot keep (its journal record alone is larger than the
    journal's share of the SSD budget): refused, nothing changed. A ``ProtocolError``, so the
    server answers it as a refused request."""


def _object_size(key: str, tids: list[str]) -> int:
    return OBJECT_BYTES + len(key) + sum(len(t) + OBJECT_ID_BYTES for t in tids)


def _record(key: str, tids: list[str]) -> bytes:
    """An object's journal line. ``json.dumps`` escapes every non-ASCII character (lone
    surrogates too), so the line is ASCII and its length is its size on disk."""
    return (json.dumps({"object": key, "tids": tids}) + "\n").encode("ascii")


def _parse_record(line: bytes) -> tuple[str, list[str]] | None:
    """``(key, tids)`` of a journal line; None for a damaged one. Bad UTF-8 and integers past
    Python's digit limit raise ``ValueError``, nesting past the parser's stack
    ``RecursionError``: any of them would otherwise stop the store from starting."""
    try:
        rec = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(rec, dict):
        return None
    key, tids = rec.get("object"), rec.get("tids")
    if not isinstance(key, str) or not isinstance(tids, list) \
            or not all(isinstance(t, str) for t in tids):
        return None
    return key, tids


def _journal_lines(f: BinaryIO, max_bytes: int) -> Iterator[bytes | None]:
    """The lines of ``f``; None for a line longer than ``max_bytes``, which is read past in
    chunks, never held whole (a damaged file may be one line of gigabytes)."""
    while line := f.readline(max_bytes + 1):
        if len(line) <= max_bytes:
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(1 << 20)
        yield None


def _tenant_of_key(key: str) -> str:
    """The tenant of a stored object key (the server prefixes each with ``tenant + NUL``)."""
    return key.split("\0", 1)[0] if "\0" in key else ""


class StoreEngine:
    """One server's tensors and object metadata; thread-safe.

    ``ssd_bytes``: the SSD tier's budget (capped by the filesystem's free space, ``ssd``; 0:
    only that cap), pages and object journal together. ``max_objects`` and
    ``max_object_bytes``: the objects kept and the memory they may take; beyond either (or
    beyond the journal's share of the SSD budget), the tenant holding the most bytes of
    objects loses its oldest one, so a tenant writing many objects drops its own before
    anyone else's."""

    def __init__(self, memory_bytes: int, replica_fraction: float = 0.3,
                 ssd_dir: str | os.PathLike | None = None,
                 ssd_bytes: int = DEFAULT_SSD_BYTES, max_objects: int = MAX_OBJECTS,
                 max_object_bytes: int = MAX_OBJECT_BYTES) -> None:
        if not 0.0 <= replica_fraction < 1.0:
            raise ValueError("replica_fraction must be in [0, 1)")
        self.lock = threading.RLock()
        self.memory_bytes = memory_bytes
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
        # the journal: its lines, its bytes, the bytes of the live objects' lines (what a
        # rewrite leaves) and the most it may take; each live object's line length
        self._journal_records = 0
        self.journal_bytes = 0
        self.journal_live_bytes = 0
        self.journal_limit = 0
        self._record_bytes: dict[str, int] = {}
        self.ssd: SSDTier | None = None
        if self.root is not None:
            try:  # already on disk: counted with the pages when the budget meets free space
                held = (self.root / JOURNAL).stat().st_size
            except FileNotFoundError:
                held = 0
            self.ssd = SSDTier(self.root, ssd_bytes, self.stats, held_beside=held)
            self.journal_limit = int(JOURNAL_FRACTION * self.ssd.budget)
            self._recover_objects()

    @property
    def journal_live_limit(self) -> int:
        """The most bytes the live objects' journal records may take (``JOURNAL_LIVE_SHARE``)."""
        return int(JOURNAL_LIVE_SHARE * self.journal_limit)

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

    def get_tensors_checked(self, tids: list[str], max_bytes: int | None = None
                            ) -> list[tuple[bytes, int | None] | None]:
        """``(bytes, checksum of exactly those bytes or None)`` per id; None when absent. A page
        from memory stored without a checksum has None (the caller computes it); a page from
        SSD has the one kept in its file, verified against its bytes. ``max_bytes``: the most
        the found pages may hold together; from the first page past it, every page is None
        (and no more is read from SSD): a reply the server can hold, whatever was asked."""
        out: list[tuple[bytes, int | None] | None] = []
        total = 0
        with self.lock:
            for tid in tids:
                if max_bytes is not None and total > max_bytes:
                    self.stats["misses"] += 1
                    out.append(None)
                    continue
                e = self.owned.get_entry(tid) or self.replica.get_entry(tid)
                found = (e.data, e.checksum) if e is not None else None
                if found is None and self.ssd is not None:
                    found = self.ssd.read(tid)
                if found is not None and max_bytes is not None:
                    total += len(found[0])
                    if total > max_bytes:
                        found = None
                self.stats["hits" if found is not None else "misses"] += 1
                self.stats["bytes_out"] += len(found[0]) if found else 0
                out.append(found)
        return out

    # ---- objects (flat metadata) --------------------------------------------------------
    def put_object(self, key: str, tids: list[str]) -> None:
        """Keep object ``key`` (journaled when there is an SSD tier). Raises ``ObjectRefused``,
        changing nothing, when its journal line alone exceeds the journal's share of the SSD
        budget."""
        tids = list(tids)
        with self.lock:
            if self.root is None:
                self._set_object(key, tids)
                return
            line = _record(key, tids)
            if len(line) > self.journal_live_limit:
                raise ObjectRefused(
                    f"object too large for the object journal ({len(line)} bytes of record; "
                    f"live records may take {self.journal_live_limit} bytes of the SSD "
                    "budget)")
            self._set_object(key, tids, len(line))
            if key in self.objects:
                self._journal(line)

    def get_object(self, key: str) -> list[str] | None:
        with self.lock:
            return self.objects.get(key)

    def _set_object(self, key: str, tids: list[str], record_bytes: int = 0) -> None:
        """Keep ``key`` (whose journal line is ``record_bytes`` long), then drop objects until
        every bound holds again: the heaviest tenant's oldest first, ``key`` itself last (the
        object just written survives whenever it fits the bounds alone)."""
        self._drop_object(key)  # re-inserted last: the oldest written is dropped first
        tenant, size = _tenant_of_key(key), _object_size(key, tids)
        self.objects[key] = tids
        self._tenant_objects.setdefault(tenant, OrderedDict())[key] = size
        self._tenant_object_bytes[tenant] = self._tenant_object_bytes.get(tenant, 0) + size
        self.object_bytes += size
        if self.root is not None:
            self._record_bytes[key] = record_bytes
            self.journal_live_bytes += record_bytes
        while self.objects and (len(self.objects) > self.max_objects
                                or self.object_bytes > self.max_object_bytes
                                or (self.root is not None
                                    and self.journal_live_bytes > self.journal_live_limit)):
            self._drop_object(self._victim(key))

    def _victim(self, keep: str) -> str:
        """The object to drop for room: the oldest of the tenant holding the most bytes of
        objects, among tenants with an object other than ``keep`` (``keep`` is its tenant's
        newest, so a tenant whose oldest is ``keep`` has no other); ``keep`` when none has."""
        firsts = {t: next(iter(own)) for t, own in self._tenant_objects.items()}
        others = [t for t, first in firsts.items() if first != keep]
        if not others:
            return keep
        return firsts[max(others, key=self._tenant_object_bytes.get)]

    def _drop_object(self, key: str) -> None:
        if self.objects.pop(key, None) is None:
            return
        self.journal_live_bytes -= self._record_bytes.pop(key, 0)
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

    def _journal(self, line: bytes) -> None:
        """Append ``line`` (the record of an object just kept), or rewrite the journal instead
        when the line would take it past twice as many records as live objects, past twice the
        live records' bytes plus ``JOURNAL_SLACK_BYTES``, or past its share of the SSD budget
        (the rewrite holds the live objects, this one among them: at most that share)."""
        grown = self.journal_bytes + len(line)
        try:
            if (self._journal_records + 1 > max(64, 2 * len(self.objects))
                    or grown > 2 * self.journal_live_bytes + JOURNAL_SLACK_BYTES
                    or grown > self.journal_limit):
                self._compact_journal()
                return
            self.ssd.reserve(grown)  # pages leave the SSD for the line first
            with open(self.root / JOURNAL, "ab") as f:
                f.write(line)
            self.journal_bytes = grown
            self._journal_records += 1
        except OSError as e:  # the object stays in memory; a restart may not recover it
            logger.warning("PTStore: writing the object journal failed: %s", e)
            self._measure_journal()

    def _measure_journal(self) -> None:
        """Take the journal's size from the file (after a failed write: a part may be there)."""
        try:
            self.journal_bytes = (self.root / JOURNAL).stat().st_size
        except OSError:
            self.journal_bytes = 0
        self.ssd.reserve(self.journal_bytes)

    def _compact_journal(self) -> None:
        """Rewrite the journal with one record per live object (atomically: a crash leaves the
        old or the new file; while it is written, the new file lies beside the old)."""
        journal = self.root / JOURNAL
        tmp = journal.with_name(".objects.jsonl.tmp")
        written = 0
        try:
            with open(tmp, "wb") as f:
                for key, tids in self.objects.items():
                    written += f.write(_record(key, tids))
            os.replace(tmp, journal)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self.journal_bytes = written
        self._journal_records = len(self.objects)
        self.ssd.reserve(written)

    def _recover_objects(self) -> None:
        """Replay the journal, skipping damaged lines (counted in one warning); rewrite it when
        it held any, ends in a torn line (the next record appended would join it) or is over a
        bound, then take its bytes from the pages' room."""
        journal = self.root / JOURNAL
        skipped, torn, lines = 0, False, 0
        try:
            with open(journal, "rb") as f:
                for line in _journal_lines(f, self.journal_limit):
                    lines += 1
                    rec = None if line is None else _parse_record(line)
                    if rec is None:
                        skipped += 1
                        continue
                    torn = not line.endswith(b"\n")
                    key, tids = rec
                    size = len(_record(key, tids))
                    if size <= self.journal_live_limit:
                        self._set_object(key, tids, size)
                self.journal_bytes = f.tell()
        except FileNotFoundError:
            return
        self._journal_records = lines
        if skipped:
            logger.warning("PTStore: skipped %d damaged line(s) of the object journal %s",
                           skipped, journal)
        try:
            if (skipped or torn or lines > max(64, 2 * len(self.objects))
                    or self.journal_bytes > min(self.journal_limit,
                                                2 * self.journal_live_bytes
                                                + JOURNAL_SLACK_BYTES)):
                self._compact_journal()
        except OSError as e:
            logger.warning("PTStore: rewriting the object journal failed: %s", e)
        self.ssd.reserve(self.journal_bytes)

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
