"""Same-node data path: pages move through a shared-memory segment instead of the socket.

Over loopback TCP a page crosses the kernel twice and zmq's I/O thread once; measured end to end
that caps a load at ~1 GB/s. When a store server runs on the reader's node (its own share of the
owned pages, and every replica of a hot prefix), the reader instead names a segment in
``/dev/shm`` it created and the offsets it wants each page at; the server copies the pages
there (one ``memcpy`` each, the servers in parallel) and replies with checksums only. The reader
verifies each page and copies it into SGLang's host pool.

* ``ClientSegment`` - the reader's staging buffer (one per client thread), with a 16-byte nonce
  in its first bytes so a server can prove it maps the same memory (``probe``): a server in
  another container or on another host never passes, and is then used over the socket.
* ``SegmentCache`` - the server's mappings of clients' segments, opened by name on demand.

Only names ``ptstore-<...>`` under ``/dev/shm`` are ever opened; a segment is created with
mode 0600, so only processes of the same user can map it. Memory is reserved up front
(``posix_fallocate``): a full ``/dev/shm`` fails the creation, never a later write with SIGBUS.

Lifetime. A segment is unlinked by ``close``, at interpreter exit, or - when its process was
killed (SGLang's schedulers are) - by the next segment created on the node: names carry the
creator's pid, and segments of pids that no longer exist are removed first. (tmpfs pages are
memory: leaked segments once left a test machine without room for SGLang's host cache.)
"""

from __future__ import annotations

import mmap
import os
import re
import uuid
import weakref
from collections import OrderedDict
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "ptstore-"
NAME_RE = re.compile(r"^ptstore-[A-Za-z0-9_-]{1,96}$")
DATA_OFFSET = 64  # the nonce lives below; page data starts here


class ClientSegment:
    """A staging buffer of ``nbytes`` in ``/dev/shm``, unlinked on :meth:`close`."""

    def __init__(self, nbytes: int) -> None:
        reap_stale()
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        self.path = SHM_DIR / self.name
        self.nonce = os.urandom(16)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, DATA_OFFSET + nbytes)
            self.mm = mmap.mmap(fd, DATA_OFFSET + nbytes)
        except BaseException:
            _unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.mm[:16] = self.nonce
        self.capacity = nbytes
        self._unlink_at_exit = weakref.finalize(self, _unlink, self.path)

    @classmethod
    def create(cls, nbytes: int) -> ClientSegment | None:
        """A segment, or None where ``/dev/shm`` is missing or has not twice ``nbytes`` free."""
        try:
            st = os.statvfs(SHM_DIR)
            if st.f_bavail * st.f_frsize < 2 * nbytes:
                return None
            return cls(nbytes)
        except OSError:
            return None

    def view(self, offset: int, size: int) -> memoryview:
        """Bytes ``[offset, offset + size)`` of the data area (offsets as sent to servers are
        absolute: ``DATA_OFFSET + offset``)."""
        return memoryview(self.mm)[DATA_OFFSET + offset:DATA_OFFSET + offset + size]

    def close(self) -> None:
        _close_quietly(self.mm)
        self._unlink_at_exit()


def _close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view is still alive; the mapping goes with its last view or the process


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def reap_stale() -> int:
    """Unlink segments whose creating process no longer exists; returns how many."""
    removed = 0
    try:
        names = [p.name for p in SHM_DIR.glob(f"{PREFIX}*")]
    except OSError:
        return 0
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(SHM_DIR / name)
                removed += 1
            except OSError:
                pass  # another user's, or already gone
    return removed


class SegmentCache:
    """A server's mappings of client segments (least recently used closed beyond ``max_open``)."""

    def __init__(self, max_open: int = 16) -> None:
        self.max_open = max_open
        self.maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def get(self, name: str) -> mmap.mmap:
        """The mapping of segment ``name``; raises ValueError for a name that is not one of
        ours, OSError when it cannot be opened."""
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError("bad segment name")
        mm = self.maps.get(name)
        if mm is not None:
            self.maps.move_to_end(name)
            return mm
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.maps[name] = mm
        while len(self.maps) > self.max_open:
            _close_quietly(self.maps.popitem(last=False)[1])
        return mm

    def close(self) -> None:
        for mm in self.maps.values():
            _close_quietly(mm)
        self.maps.clear()
