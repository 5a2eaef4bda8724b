"""Greedy-Dual-Size-Frequency eviction, for PTStore's memory caches and its SSD tier's index.

``cost`` is what a miss costs relative to its size; for KV pages fetched over the network it is
proportional to bytes, so ``cost / size`` is a constant and priority reduces to ``L + frequency``
- the aging LFU GDSF degenerates to, as the seed argues for prefixes (early pages are read by
every prompt that shares them). Each eviction raises the inflation ``L`` to the victim's
priority, so pages that are not read any more age out behind newly stored ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

ENTRY_BYTES = 160
"""What one memory entry costs besides its page and id: the dict slot, the ``Entry``, the
bytes object's header and the heap row (about 150 bytes in CPython 3.12)."""


@dataclass(slots=True)
class Entry:
    data: bytes | None  # None in an index of bytes kept elsewhere (the SSD tier's files)
    size: int
    freq: int
    priority: float
    checksum: int | None = None  # as verified on arrival; None: compute when served


class GDSFCache:
    """Bytes-bounded map ``id -> Entry`` with GDSF eviction; ``on_evict(id, entry)`` is called
    for each victim (the owned cache spills it to SSD, the SSD index deletes its file)."""

    def __init__(self, capacity_bytes: int,
                 on_evict: Callable[[str, Entry], None] | None = None) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self.inflation = 0.0
        self.entries: dict[str, Entry] = {}
        self.on_evict = on_evict
        self.evictions = 0
        # (priority, order, id); entries whose priority changed leave stale rows that the
        # eviction loop skips, so a get is O(log n) and an eviction amortised O(log n)
        self._heap: list[tuple[float, int, str]] = []
        self._order = itertools.count()

    def _push(self, tid: str, e: Entry) -> None:
        heapq.heappush(self._heap, (e.priority, next(self._order), tid))
        if len(self._heap) > 2 * len(self.entries) + 1024:  # mostly stale rows: rebuild
            self._heap = [row for row in self._heap
                          if (x := self.entries.get(row[2])) is not None
                          and x.priority == row[0]]
            heapq.heapify(self._heap)

    def __contains__(self, tid: str) -> bool:
        return tid in self.entries

    def get(self, tid: str) -> bytes | None:
        e = self.get_entry(tid)
        return None if e is None else e.data

    def get_entry(self, tid: str) -> Entry | None:
        """The entry of ``tid`` (None when absent), counted as one more read."""
        e = self.entries.get(tid)
        if e is None:
            return None
        e.freq += 1
        e.priority = self.inflation + e.freq
        self._push(tid, e)
        return e

    def put(self, tid: str, data: bytes, checksum: int | None = None) -> bool:
        """Insert (or refresh) ``data``; False when it alone exceeds the capacity. It counts
        as its bytes, but at least as its id and ``ENTRY_BYTES``: a page's id (up to 1 KiB)
        and the entry holding it are memory too, and with pages of a few bytes they would be
        most of it, uncounted (100,000 empty pages held 150 MB in a 1 MiB cache). So what a
        cache holds stays within twice its budget, and a KV page (kilobytes) counts as its
        bytes alone."""
        return self.insert(tid, max(len(data), len(tid) + ENTRY_BYTES), data, checksum)

    def insert(self, tid: str, size: int, data: bytes | None = None,
               checksum: int | None = None, freq: int = 0) -> bool:
        """Insert (or refresh) an entry of ``size`` bytes that was read ``freq`` times before
        (a page moving between tiers keeps its value); False when it exceeds the capacity."""
        if size > self.capacity:
            return False
        old = self.entries.pop(tid, None)
        if old is not None:
            self.used -= old.size
            freq = max(freq, old.freq)
        freq += 1
        self._make_room(size)
        e = self.entries[tid] = Entry(data, size, freq, self.inflation + freq, checksum)
        self._push(tid, e)
        self.used += size
        return True

    def resize(self, capacity_bytes: int) -> None:
        """Set the capacity, evicting (by priority, through ``on_evict``) what no longer fits."""
        self.capacity = capacity_bytes
        self._make_room(0)

    def pop(self, tid: str) -> Entry | None:
        e = self.entries.pop(tid, None)
        if e is not None:
            self.used -= e.size
        return e

    def _make_room(self, nbytes: int) -> None:
        while self.used + nbytes > self.capacity and self.entries:
            priority, _, tid = heapq.heappop(self._heap)
            e = self.entries.get(tid)
            if e is None or e.priority != priority:
                continue  # a stale row: the entry was refreshed or removed since
            del self.entries[tid]
            self.used -= e.size
            self.inflation = max(self.inflation, e.priority)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(tid, e)
