"""Same-node data path: pages move through a shared-memory segment instead of the socket.

Over loopback TCP a page crosses the kernel twice and zmq's I/O thread once, which caps the rate
of a load. When a store server runs on the reader's node (its own share of the
owned pages, and every replica of a hot prefix), the reader instead names a segment in
``/dev/shm`` it created and the offsets it wants each page at; the server copies the pages
there (one ``memcpy`` each, the servers in parallel) and replies with checksums only. The reader
verifies each page and copies it into SGLang's host pool.

* ``ClientSegment`` - the reader's staging buffer (one per client thread), with a 16-byte nonce
  in its first bytes so a server can prove it maps the same memory (``probe``): a server in
  another container or on another host never passes, and is then used over the socket.
* ``SegmentCache`` - the server's mappings of clients' segments, opened by name on demand.
* ``pool_spec`` - better still, no staging at all: SGLang can allocate its host KV pool in a
  memfd (``"allocator": "shm"`` in the storage extra config, which ``--ptstore`` sets). A server
  on the node then opens the pool itself through ``/proc/<pid>/fd/<fd>`` (checked against the
  file's device and inode, which name one file on one kernel) and writes each page straight into
  its host-pool slot: one copy per page in all, done by the servers, none by the reader, whose
  process (SGLang's scheduler) is the one short of GIL time. A pool spec also names a *ticket*:
  a small memfd of the reader holding a random secret, which every request must present
  (``proof``): the pid, fd and inode of a pool can be guessed, the secret cannot, so a client of
  another tenant cannot have a server write its pages into this reader's pool.

Only names ``ptstore-<...>`` under ``/dev/shm`` are ever opened; a segment is created with
mode 0600, so only processes of the same user can map it. Memory is reserved up front
(``posix_fallocate``): a full ``/dev/shm`` fails the creation, never a later write with SIGBUS.

Lifetime. A segment is unlinked by ``close``, at interpreter exit, or - when its process was
killed (SGLang's schedulers are) - by the next segment created on the node: names carry the
creator's pid, and segments of pids that no longer exist are removed first. (tmpfs pages are
memory: leaked segments once left a test machine without room for SGLang's host cache.)
"""

from __future__ import annotations

import ctypes
import hmac
import mmap
import os
import re
import stat
import threading
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


POOL_KEYS = ("pid", "fd", "dev", "ino")
POOL_TARGETS = ("/memfd:", "/dev/shm/")  # what a pool's /proc/<pid>/fd link may point to
TICKET_NAME = "ptstore-ticket"
TICKET_LINK = f"/memfd:{TICKET_NAME} (deleted)"  # how /proc/<pid>/fd shows a ticket
_TICKETS: dict[tuple[int, int], tuple[int, str]] = {}  # (dev, ino) -> (ticket fd, secret hex)
_TICKETS_LOCK = threading.Lock()


def _ticket(dev: int, ino: int) -> tuple[int, str]:
    """This process's ticket for the pool file ``(dev, ino)``: a memfd holding 16 random bytes,
    kept open for the life of the process (one per pool)."""
    with _TICKETS_LOCK:
        ticket = _TICKETS.get((dev, ino))
        if ticket is None:
            secret = os.urandom(16)
            fd = os.memfd_create(TICKET_NAME)
            os.write(fd, secret)
            ticket = _TICKETS[(dev, ino)] = (fd, secret.hex())
        return ticket


def pool_spec(fd: int) -> dict[str, int | str]:
    """How a server on this node finds this process's shared-memory file ``fd`` (SGLang's host
    pool allocated with ``"allocator": "shm"``): its ``/proc`` path, the file's identity, and
    the ticket that proves a request comes from this process (``proof``: the ticket's secret;
    the spec is sent only over authenticated, encrypted connections)."""
    st = os.fstat(fd)
    ticket, proof = _ticket(st.st_dev, st.st_ino)
    return {"pid": os.getpid(), "fd": fd, "dev": st.st_dev, "ino": st.st_ino, "ticket": ticket,
            "proof": proof}


def address_of(mm: mmap.mmap) -> int:
    """The address ``mm`` is mapped at (valid while it stays open)."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # releases the export, so the mapping can still be closed


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def pool_key(spec) -> tuple[int, int, int, int]:
    """The validated ``(pid, fd, dev, ino)`` of a pool spec (which must also name a ticket and
    a proof); ValueError otherwise."""
    if not isinstance(spec, dict) or not all(_is_int(spec.get(k)) and spec[k] >= 0
                                             for k in (*POOL_KEYS, "ticket")):
        raise ValueError("bad pool spec")
    proof = spec.get("proof")
    if not isinstance(proof, str) or not re.fullmatch(r"[0-9a-f]{32}", proof):
        raise ValueError("bad pool spec: no proof")
    return tuple(spec[k] for k in POOL_KEYS)


def _read_ticket(proc: int, fd_no: int) -> bytes:
    """The secret of the reader's ticket ``fd_no`` (``proc``: its open /proc directory); only a
    ticket memfd is read, so no other file's predictable first bytes can stand in for it."""
    if os.readlink(f"fd/{fd_no}", dir_fd=proc) != TICKET_LINK:
        raise ValueError("not the reader's ticket")
    fd = os.open(f"fd/{fd_no}", os.O_RDONLY, dir_fd=proc)
    try:
        secret = os.pread(fd, 17, 0)
    finally:
        os.close(fd)
    if len(secret) != 16:
        raise ValueError("not the reader's ticket")
    return secret


def _open_pool(key: tuple[int, int, int, int], ticket: int,
               proof: bytes) -> tuple[mmap.mmap, bytes]:
    """Map a reader's pool file once its ticket equals ``proof``: only a shared-memory file
    (memfd or ``/dev/shm``) of a process of this server's user, only the very file the reader
    named (device and inode match), and nothing mapped for a request without the proof. The
    process directory is opened once and both fds looked up relative to it, so a pid reused in
    between cannot swap the process checked for the one opened."""
    pid, fd_no, dev, ino = key
    proc = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
    try:
        if os.fstat(proc).st_uid != os.getuid():
            # a server running as another user (root, say) must not become a way to write into
            # that user's processes: only pools of processes of the server's own user
            raise ValueError("the pool's process belongs to another user")
        if not os.readlink(f"fd/{fd_no}", dir_fd=proc).startswith(POOL_TARGETS):
            raise ValueError("the pool is not a shared-memory file")
        fd = os.open(f"fd/{fd_no}", os.O_RDWR, dir_fd=proc)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino):
                raise ValueError("not the reader's pool")
            secret = _read_ticket(proc, ticket)
            if not hmac.compare_digest(secret, proof):
                raise ValueError("not the reader's pool (wrong proof)")
            return mmap.mmap(fd, st.st_size), secret
        finally:
            os.close(fd)
    finally:
        os.close(proc)


MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (what SGLang's own shm allocator asks for)


def _prefault(address: int, length: int) -> threading.Thread:
    """Build this process's page tables for a freshly mapped pool, in the background.

    The reader's pages are resident, but a new mapping of them has no page-table entries: the
    first copy into each 4 KiB page faults, so a load into slots never written before runs at
    a fraction of the rate of one into slots written once. ``madvise`` (through ctypes, so
    without the GIL) takes that cost at mapping time instead of in loads. Best effort: an older kernel just keeps the first-touch cost.
    The mapping must stay open until the thread ends (``_Pool.close`` joins it)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def run() -> None:
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE)

    t = threading.Thread(target=run, name="ptstore-prefault", daemon=True)
    t.start()
    return t


def _pool_alive(key: tuple[int, ...]) -> bool:
    """Whether the process still holds the pool file (its memory is freed only once no server
    maps it any more: a killed scheduler's pool must not stay pinned by a server's cache)."""
    pid, fd, dev, ino = key
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class _Pool:
    """A reader's pool as mapped by a server, with the thread building its page tables."""

    def __init__(self, key: tuple[int, int, int, int], ticket: int, proof: bytes) -> None:
        self.mm, self.secret = _open_pool(key, ticket, proof)
        self.address = address_of(self.mm)
        self.prefault = _prefault(self.address, len(self.mm))

    def close(self) -> None:
        self.prefault.join()  # madvise must not run over a range that is unmapped (or reused)
        _close_quietly(self.mm)


class SegmentCache:
    """A server's mappings of readers' memory: staging segments by name (least recently used
    closed beyond ``max_open``), host pools by ``pool_spec`` (kept until their process is gone:
    ``reap``; remapping a pool costs its page tables again)."""

    def __init__(self, max_open: int = 16) -> None:
        self.max_open = max_open
        self.maps: OrderedDict[str, tuple[mmap.mmap, int]] = OrderedDict()
        self.pools: dict[tuple[int, int, int, int], _Pool] = {}

    def mapping(self, name: str | dict, nonce: bytes | None = None) -> tuple[mmap.mmap, int]:
        """``(mapping, address)`` of segment ``name`` (or of a pool, given its spec); raises
        ValueError for a name or spec that is not acceptable, OSError when it cannot be
        opened. A pool is proven by its spec's proof, a segment by ``nonce``: its first 16
        bytes, which only processes that can read it know (its name is visible to everyone
        on the node); compared in constant time."""
        if isinstance(name, dict):
            key = pool_key(name)
            proof = bytes.fromhex(name["proof"])
            pool = self.pools.get(key)
            if pool is None:  # the proof is checked before the pool is mapped (``_open_pool``)
                pool = self.pools[key] = _Pool(key, name["ticket"], proof)
            elif not hmac.compare_digest(pool.secret, proof):
                raise ValueError("not the reader's pool (wrong proof)")
            return pool.mm, pool.address
        mm, address = self._segment(name)
        if nonce is None or not hmac.compare_digest(mm[:16], nonce):
            raise ValueError("not the reader's segment (wrong nonce)")
        return mm, address

    def _segment(self, name: str) -> tuple[mmap.mmap, int]:
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError("bad segment name")
        hit = self.maps.get(name)
        if hit is not None:
            self.maps.move_to_end(name)
            return hit
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            # only a segment of a process of this server's user, as for pools (``_open_pool``):
            # another user's file, or a second name of one, is not a reader's segment
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
                raise ValueError("not a segment of this server's user")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        hit = self.maps[name] = (mm, address_of(mm))
        while len(self.maps) > self.max_open:
            _close_quietly(self.maps.popitem(last=False)[1][0])
        return hit

    def reap(self) -> int:
        """Close the pools of processes that are gone; returns how many."""
        dead = [k for k in self.pools if not _pool_alive(k)]
        for k in dead:
            self.pools.pop(k).close()
        return len(dead)

    def close(self) -> None:
        for mm, _ in self.maps.values():
            _close_quietly(mm)
        self.maps.clear()
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
