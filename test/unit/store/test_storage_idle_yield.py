"""The idle scheduler's nap while HiCache storage I/O is in flight (``store/idle_yield.py``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from sglang_pic.store import idle_yield


class _Scheduler:
    def __init__(self, prefetch=None, backup=None) -> None:
        self.tree_cache = SimpleNamespace(ongoing_prefetch=prefetch or {},
                                          ongoing_backup=backup or {})
        self.passes = 0

    def on_idle(self) -> None:
        self.passes += 1


@pytest.fixture
def nap(monkeypatch):
    monkeypatch.setattr(idle_yield, "_nap_s", 0.002)


def _passes_in(sched: _Scheduler, seconds: float) -> int:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        idle_yield.around_on_idle(_Scheduler.on_idle, sched)
    return sched.passes


def test_naps_only_while_storage_io_is_in_flight(nap):
    # 0.2 s of idle passes: thousands without I/O in flight, at most ~100 with a 2 ms nap each
    assert _passes_in(_Scheduler(), 0.2) > 1000
    assert _passes_in(_Scheduler(prefetch={"r": object()}), 0.2) <= 110
    assert _passes_in(_Scheduler(backup={1: object()}), 0.2) <= 110
    assert not idle_yield.storage_io_in_flight(None)  # caches without HiCache storage
    assert not idle_yield.storage_io_in_flight(SimpleNamespace())


def test_the_nap_hands_the_gil_to_a_storage_thread(nap):
    """A thread that needs the GIL between blocking calls (a data-plane stream) gets it while
    the idle scheduler naps: its count of GIL round trips in 0.3 s rises with the nap."""
    def worker_rounds(sched: _Scheduler) -> int:
        stop, rounds = threading.Event(), [0]

        def worker() -> None:
            while not stop.is_set():
                time.sleep(0)  # a blocking call: lets go of the GIL, then needs it back
                rounds[0] += 1

        t = threading.Thread(target=worker)
        t.start()
        _passes_in(sched, 0.3)
        stop.set()
        t.join()
        return rounds[0]

    spinning = worker_rounds(_Scheduler())
    napping = worker_rounds(_Scheduler(prefetch={"r": object()}))
    assert napping > 3 * spinning, (spinning, napping)


def test_an_idle_pass_waits_for_a_lookup_in_flight(nap):
    """While a lookup runs (``LOOKUPS.running()``, as ``hicache_backend.batch_exists`` runs it)
    an idle pass blocks until it ends, at most ``LOOKUP_WAIT_S``; with none it naps as before."""
    watch = idle_yield.LOOKUPS
    assert not watch.wait(1.0)  # none in flight: at once
    sched = _Scheduler(prefetch={"r": object()})
    started, release = threading.Event(), threading.Event()

    def lookup() -> None:
        with watch.running():
            started.set()
            release.wait(5)

    t = threading.Thread(target=lookup)
    t.start()
    started.wait(5)
    t0 = time.perf_counter()
    idle_yield.around_on_idle(_Scheduler.on_idle, sched)  # the lookup outlasts the bound
    waited = time.perf_counter() - t0
    assert waited >= idle_yield.LOOKUP_WAIT_S * 0.9
    threading.Timer(0.05, release.set).start()
    t0 = time.perf_counter()
    while t.is_alive() and time.perf_counter() - t0 < 5:
        idle_yield.around_on_idle(_Scheduler.on_idle, sched)
    t.join()
    # passes during the 50 ms lookup: each waited ~LOOKUP_WAIT_S (2 ms), not the 2 ms nap plus
    # a spin; then none is in flight again
    assert sched.passes <= 1 + 0.06 / idle_yield.LOOKUP_WAIT_S
    assert not watch.wait(1.0)


def test_nested_and_concurrent_lookups_end_the_wait_only_when_the_last_ends():
    import sys

    watch = idle_yield.LookupWatch()
    before = sys.getswitchinterval()
    with watch.running():
        with watch.running():
            assert sys.getswitchinterval() == pytest.approx(idle_yield.LOOKUP_SWITCH_S)
        assert sys.getswitchinterval() == pytest.approx(idle_yield.LOOKUP_SWITCH_S)
        t0 = time.perf_counter()
        assert watch.wait(0.02)  # one still in flight: waited out the timeout
        assert time.perf_counter() - t0 >= 0.015
    assert not watch.wait(1.0)
    assert sys.getswitchinterval() == before  # restored when the last one ended
    with pytest.raises(RuntimeError), watch.running():
        raise RuntimeError("a failed lookup")
    assert not watch.wait(1.0)  # counted out even when it raised
    assert sys.getswitchinterval() == before


def test_the_hit_query_is_a_lookup_in_flight_from_start_to_end():
    """``around_hit_query`` wraps SGLang's whole storage hit query (page keys, then one
    ``batch_exists`` per 128 pages): in flight from its first to its last step."""
    seen = []

    def hit_query(controller, operation):
        seen.append(idle_yield.LOOKUPS.wait(0))  # True: one in flight (waited 0 s)
        return ["k"], 64

    assert idle_yield.around_hit_query(hit_query, object(), "op") == (["k"], 64)
    assert seen == [True] and not idle_yield.LOOKUPS.wait(1.0)


def test_the_switch_interval_is_lowered_only_while_a_lookup_runs_and_never_raised():
    import sys

    watch, saved = idle_yield.LookupWatch(), sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.0001)  # the user's, lower than ours: kept
        with watch.running():
            assert sys.getswitchinterval() == pytest.approx(0.0001)
        assert sys.getswitchinterval() == pytest.approx(0.0001)
        sys.setswitchinterval(0.005)
        with watch.running():
            sys.setswitchinterval(0.001)  # someone else's change meanwhile: kept at the end
        assert sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        sys.setswitchinterval(saved)
