"""PTStore's SSD tier: owned pages spilled from memory, one file per page, bounded and verified.

File names are digests, never ids. A page's file is ``pages/<blake2b-128 hex of its id>``, so
no id - an absolute path, ``..``, ``a/./b`` beside ``a/b`` - can name a file outside the
directory or two ids share one. The file starts with a header that holds the id itself and the
checksum computed when the page arrived (``magic "PTS1", id length, checksum, data length``,
then the id, then the page): every read checks that the file is whole, is the page of that id
and hashes to that checksum. Anything else - a flipped bit, a truncated or foreign file, a
digest collision - is a miss, and the file is deleted (``ssd_corrupt``).

Budget. The tier holds at most ``budget`` bytes and evicts by the same GDSF rule as the memory
caches (priority ``L + frequency``; a spilled page keeps the reads it had in memory), so a
later spill always finds room and idle pages leave first. The budget is capped at start by the
filesystem's room: what the tier already holds plus the free space, less a reserve of 5 % of
the filesystem (a write that still fails, e.g. the disk filled by others, is a failed spill,
logged, and the other pages go on). Files the engine keeps beside the pages (the object
journal) count against the same budget: ``reserve`` takes their bytes from the pages' room.

Writes go to a temporary file renamed into place, so a crash never leaves half a page under a
page's name (and a torn file would fail its checksum anyway); leftovers are removed at start.
Recovery reads every file's header (not its page), oldest first, so the newest pages survive a
smaller budget.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import struct
from pathlib import Path

from .gdsf import Entry, GDSFCache
from .protocol import checksum

logger = logging.getLogger(__name__)

MAGIC = b"PTS1"
HEADER = struct.Struct("<4sIQQ")  # magic, id bytes, checksum, page bytes
RESERVE_FRACTION = 0.05
_NAME = re.compile(r"[0-9a-f]{32}")


def _id_bytes(tid: str) -> bytes:
    return tid.encode("utf-8", "surrogatepass")  # ids are any JSON string, lone surrogates too


def file_name(tid: str) -> str:
    return hashlib.blake2b(_id_bytes(tid), digest_size=16).hexdigest()


def capped_budget(root: Path, budget: int, held: int) -> int:
    """``budget``, at most what the filesystem of ``root`` has room for (``held``: bytes this
    tier already occupies) less the reserve; 0 means just that room."""
    usage = shutil.disk_usage(root)
    room = max(0, held + usage.free - int(RESERVE_FRACTION * usage.total))
    return room if budget <= 0 else min(budget, room)


class SSDTier:
    """Pages on disk under ``root/pages``, indexed in memory (id -> size, checksum, GDSF
    priority). ``stats`` (shared with the engine) counts spills, reads, corrupt files, write
    errors and evictions. Not thread-safe: the engine calls it under its lock."""

    def __init__(self, root: str | os.PathLike, budget: int, stats: dict[str, int],
                 held_beside: int = 0) -> None:
        """``held_beside``: bytes of files beside the pages already on disk (the object
        journal), which the budget covers too: counted as room the tier holds when the budget
        is capped by the filesystem's free space. The engine reserves them once it has read
        (and perhaps rewritten) them."""
        self.dir = Path(root) / "pages"
        # pages are prompts' KV, not encrypted at rest: folders this tier creates are private
        Path(root).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.stats = stats
        for k in ("spills", "ssd_hits", "ssd_corrupt", "ssd_errors", "ssd_evictions"):
            stats.setdefault(k, 0)
        self.index = GDSFCache(0, on_evict=self._evicted)
        found = self._scan()
        self.index.capacity = self.budget = capped_budget(
            self.dir, budget, held_beside + sum(n for *_, n in found))
        self.reserved = 0
        for _, tid, csum, n in found:
            self.index.insert(tid, n, None, csum)

    # ---- queries ------------------------------------------------------------------------
    def __contains__(self, tid: str) -> bool:
        return tid in self.index

    def __len__(self) -> int:
        return len(self.index.entries)

    @property
    def used(self) -> int:
        return self.index.used

    def reserve(self, nbytes: int) -> None:
        """Hold ``nbytes`` of the budget for files beside the pages (the object journal): the
        pages' room shrinks to the rest, evicting the lowest GDSF priorities first."""
        self.reserved = nbytes
        self.index.resize(max(0, self.budget - nbytes))

    def _path(self, tid: str) -> Path:
        return self.dir / file_name(tid)

    # ---- write, read, delete ------------------------------------------------------------
    def write(self, tid: str, data: bytes, csum: int, freq: int = 0) -> bool:
        """Store page ``tid`` (whose checksum is ``csum``), evicting lower-priority pages for
        room; False when it is too large or the write failed (logged)."""
        idb = _id_bytes(tid)
        size = HEADER.size + len(idb) + len(data)
        if not self.index.insert(tid, size, None, csum, freq):
            return False
        path = self._path(tid)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, len(idb), csum, len(data)))
                f.write(idb)
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("PTStore: spilling a page to %s failed: %s", path, e)
            self.index.pop(tid)
            self.stats["ssd_errors"] += 1
            tmp.unlink(missing_ok=True)
            return False
        self.stats["spills"] += 1
        return True

    def read(self, tid: str) -> tuple[bytes, int] | None:
        """``(page, checksum)`` of ``tid``, verified; None when absent or not intact (the bad
        file is then deleted)."""
        e = self.index.get_entry(tid)
        if e is None:
            return None
        idb = _id_bytes(tid)
        expect = e.size - HEADER.size - len(idb)
        try:
            with open(self._path(tid), "rb") as f:
                magic, n, csum, size = HEADER.unpack(f.read(HEADER.size))
                ok = (magic == MAGIC and n == len(idb) and size == expect and csum == e.checksum
                      and f.read(n) == idb)
                data = f.read(size) if ok else b""
                ok = ok and len(data) == size and not f.read(1) and checksum(data) == csum
        except (OSError, struct.error):
            ok = False
        if not ok:
            logger.warning("PTStore: a page file in %s is damaged; deleted, served as a miss",
                           self.dir)
            self.stats["ssd_corrupt"] += 1
            self.delete(tid)
            return None
        self.stats["ssd_hits"] += 1
        return data, csum

    def delete(self, tid: str) -> None:
        if self.index.pop(tid) is not None:
            self._unlink(tid)

    def _evicted(self, tid: str, entry: Entry) -> None:
        self.stats["ssd_evictions"] += 1
        self._unlink(tid)

    def _unlink(self, tid: str) -> None:
        try:
            self._path(tid).unlink(missing_ok=True)
        except OSError as e:
            logger.warning("PTStore: deleting a page file failed: %s", e)

    # ---- recovery -----------------------------------------------------------------------
    def _scan(self) -> list[tuple[float, str, int, int]]:
        """``(mtime, id, checksum, file size)`` of every intact-looking page file, oldest
        first; deletes our temporary files and files whose header does not fit their name."""
        found = []
        for p in self.dir.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                p.unlink(missing_ok=True)  # a write interrupted by a crash
                continue
            if not _NAME.fullmatch(p.name):
                continue  # not ours: left alone
            try:
                st = p.stat()
                with open(p, "rb") as f:
                    magic, n, csum, size = HEADER.unpack(f.read(HEADER.size))
                    idb = f.read(n) if magic == MAGIC and n <= st.st_size else b""
                tid = idb.decode("utf-8", "surrogatepass")
                good = (magic == MAGIC and len(idb) == n and st.st_size == HEADER.size + n + size
                        and file_name(tid) == p.name)
            except (OSError, struct.error, UnicodeDecodeError):
                good = False
            if not good:
                self.stats["ssd_corrupt"] += 1
                p.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime, tid, csum, st.st_size))
        found.sort()
        return found
