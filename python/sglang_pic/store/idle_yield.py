"""The scheduler lets go of the GIL while HiCache storage I/O is in flight and nothing else runs.

SGLang's scheduler loop never blocks: with no batch to run it polls its sockets again at once,
in Python, and holds the GIL but for the interpreter's switch interval (5 ms). A request whose
prefix is being loaded from the storage tier (HiCache prefetch, ``wait_complete``) leaves the
scheduler exactly there, and the threads doing the load - HiCache's prefetch threads and, with
PTStore over TCP, one data-plane stream per connection - need the GIL after every receive and
every page checksum, so each of those hand-offs can wait for the switch interval. With
``--hicache-storage-idle-yield-us`` (default 100) the scheduler sleeps that long at the end of
each idle pass while a prefetch or a storage write-back is in flight: the storage threads take
the GIL at once, and the scheduler notices a finished load or a new request at most that much
later. Nothing changes while a batch runs, or while no storage I/O is in flight.

The nap is short (100 us by default) because it bounds how late an idle scheduler notices a
new request or a finished load; it only has to let a storage thread that waits for the GIL take
it, which beside a loop that never sleeps happens only at switch-interval boundaries.
``benchmark/store/bench_store_ttft.py``'s copy-rate reference measures a TCP load beside a
spinning and a napping loop (``ptstore_tcp_<k>_spinning`` and ``_spinning_yield``).

A storage *lookup* (``HiCacheController._storage_hit_query``: the pages' hash keys, then one
``batch_exists`` per 128 pages, which a ``wait_complete`` prefetch holds its request for, hit or
miss) gets more: while one runs in this process the idle pass waits for its end, up to
``LOOKUP_WAIT_S``, instead of napping, and the interpreter switches threads every
``LOOKUP_SWITCH_S``. A lookup is a handful of short GIL sections (building the request, one send
and one receive per store server, parsing the replies), and beside a scheduler pass that holds
the GIL between naps each section would wait for the next nap
(``benchmark/store/bench_lookup_beside_scheduler.py`` compares the two).

Seams: AROUND hooks on ``Scheduler.on_idle`` and ``HiCacheController._storage_hit_query``
(rows of ``sglang_pic.compat``), both only while the flag is not 0.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_nap_s = 0.0

LOOKUP_WAIT_S = 0.002
"""The longest one idle pass waits for a lookup in flight: the most a request arriving meanwhile
waits to be noticed (the scheduler is idle, so nothing else waits on it)."""


LOOKUP_SWITCH_S = 0.0002
"""The interpreter's switch interval while a lookup is in flight (5 ms by default; a lower one
set by the user stays): a scheduler pass that the lookup's thread interrupts hands the GIL back
within this instead of running on to its end."""


class LookupWatch:
    """Storage lookups in flight in this process, and an event set when the last one ends; while
    any is, the switch interval is ``LOOKUP_SWITCH_S``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._idle = threading.Event()
        self._idle.set()
        self._saved_switch_s = sys.getswitchinterval()
        self._set_switch_s: float | None = None  # what the first lookup set, if it changed it

    @contextmanager
    def running(self) -> Iterator[None]:
        """Counts the lookup of the ``with`` block as in flight."""
        with self._lock:
            self._running += 1
            if self._running == 1:
                self._saved_switch_s = sys.getswitchinterval()
                self._set_switch_s = None
                if LOOKUP_SWITCH_S < self._saved_switch_s:
                    sys.setswitchinterval(LOOKUP_SWITCH_S)
                    self._set_switch_s = sys.getswitchinterval()
            self._idle.clear()
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    # unless someone else changed it meanwhile: theirs stays
                    if self._set_switch_s is not None \
                            and sys.getswitchinterval() == self._set_switch_s:
                        sys.setswitchinterval(self._saved_switch_s)
                    self._idle.set()

    def wait(self, timeout_s: float) -> bool:
        """Block (without the GIL) until no lookup is in flight or ``timeout_s`` passed; False at
        once when none is."""
        if self._idle.is_set():
            return False
        self._idle.wait(timeout_s)
        return True


LOOKUPS = LookupWatch()
"""The storage lookups of this process's HiCache controller (``around_hit_query``)."""


def storage_io_in_flight(tree_cache: Any) -> bool:
    """Whether HiCache has a prefetch from, or a write-back to, its storage tier in flight
    (``HiRadixCache``'s ``ongoing_prefetch`` / ``ongoing_backup``; other caches have neither)."""
    return bool(getattr(tree_cache, "ongoing_prefetch", None)
                or getattr(tree_cache, "ongoing_backup", None))


def around_on_idle(original, self, *args, **kwargs):
    """SGLang's idle pass, then, while storage I/O is in flight, a wait for the lookup in
    flight (at most ``LOOKUP_WAIT_S``) or else a nap of ``--hicache-storage-idle-yield-us``
    (both without the GIL)."""
    out = original(self, *args, **kwargs)
    if _nap_s and storage_io_in_flight(getattr(self, "tree_cache", None)) \
            and not LOOKUPS.wait(LOOKUP_WAIT_S):
        time.sleep(_nap_s)
    return out


def around_hit_query(original, self, *args, **kwargs):
    """SGLang's storage hit query (page keys, then ``batch_exists`` per 128 pages), counted as a
    lookup in flight from start to end."""
    with LOOKUPS.running():
        return original(self, *args, **kwargs)


def register() -> None:
    """The ``hicache-storage`` feature's set-up: this process's nap, from
    ``--hicache-storage-idle-yield-us`` (the plugin hooks ``Scheduler.on_idle`` and the storage
    hit query unless it is 0)."""
    global _nap_s
    from sglang_pic.launcher.server_flags import setting

    _nap_s = setting("--hicache-storage-idle-yield-us") / 1e6
