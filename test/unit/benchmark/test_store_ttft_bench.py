"""The store TTFT benchmark's waits and checks (``benchmark/store/bench_store_ttft.py``).

Its H200 run lost half of the 128K prefix: the writer took "the stored bytes did not change for
three samples" (about 4 s) for "everything is stored", while HiCache was still writing 1 GiB
operations through to the store one after the other, and shut its engine down. Its reader then
gave up flushing after a fixed 10 s while its own write-back of the recomputed half (8 GiB) was
in flight. Both now wait on SGLang's own bookkeeping (a flush is refused, or deferred, until no
HiCache operation is in flight) within a bounded, reported budget, and the writer checks the
bytes it stored against the pages its prompts make. Engines here are stand-ins: no model runs.
"""

from __future__ import annotations

import asyncio
import importlib
import time
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmark.store.bench_store_ttft")


class _Manager:
    """SGLang's tokenizer manager as the benchmark uses it: ``flush_cache(timeout_s)``, which
    the scheduler defers until it is idle (``SchedulerFlushWrapper``) or the time-out passes."""

    def __init__(self, busy_s: float) -> None:
        self.idle_at = time.monotonic() + busy_s
        self.asked: list[float | None] = []

    async def flush_cache(self, timeout_s: float | None = None):
        self.asked.append(timeout_s)
        if timeout_s:
            await asyncio.sleep(max(0.0, min(timeout_s, self.idle_at - time.monotonic())))
        idle = time.monotonic() >= self.idle_at
        return SimpleNamespace(success=idle,
                               message="" if idle else "Timed out waiting for idle state.")


class _Engine:
    """``sgl.Engine``'s part the benchmark touches: its event loop and tokenizer manager."""

    def __init__(self, busy_s: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = _Manager(busy_s)

    def flush_cache(self):  # Engine.flush_cache: no time-out, refused while busy
        raise AssertionError("the benchmark must ask SGLang to defer the flush")


def test_a_flush_waits_for_hicache_operations_in_flight_past_ten_seconds_worth(bench, capsys):
    # the scheduler stays busy for 7 slices (on the H200 the reader's write-back of 8 GiB took
    # longer than the old fixed 100 x 0.1 s): the flush still happens, with progress lines
    engine = _Engine(busy_s=0.7)
    t0 = time.monotonic()
    waited = bench.flush_when_idle(engine, budget_s=30, label="before 131072-token sample 1",
                                   progress=lambda: "12.3 GB stored in all", slice_s=0.1)
    assert 0.65 <= waited <= time.monotonic() - t0 < 5
    asked = engine.tokenizer_manager.asked
    assert len(asked) >= 7 and all(0 < a <= 0.1 for a in asked)  # deferred, in slices
    out = capsys.readouterr().out
    assert "before 131072-token sample 1: waiting for HiCache operations in flight" in out
    assert "12.3 GB stored in all" in out


def test_a_flush_that_never_comes_ends_at_its_budget_with_the_reason(bench):
    engine = _Engine(busy_s=1e9)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not flush its cache within 0.4 s.*HiCache"):
        bench.flush_when_idle(engine, budget_s=0.4, label="writer", slice_s=0.1)
    assert 0.35 <= time.monotonic() - t0 < 3  # the whole budget, not less, and not forever


def test_without_a_deferred_flush_it_polls_until_sglang_flushes(bench):
    calls = []

    class Old:  # an engine whose flush cannot be deferred: asked again until it succeeds
        def flush_cache(self):
            calls.append(time.monotonic())
            return SimpleNamespace(success=len(calls) >= 4)

    assert bench.flush_when_idle(Old(), budget_s=30, label="x", slice_s=0.1) >= 0.5
    assert len(calls) == 4


def test_the_writer_expects_every_whole_page_of_its_prompts(bench):
    params = {**bench.PARAMS, "lengths": [8192, 32768, 131072]}
    prompts = [bench.prefix_tokens(n, params) + params["question_tokens"]
               for n in params["lengths"]]
    assert prompts == [8256, 32832, 131008]
    pages = bench.expected_pages(prompts, params["page_size"])
    assert pages == 129 + 513 + 2047
    page = bench.page_bytes(str(bench.REPO / "benchmark/models/llama3-8b"), 64)
    # the H200 run's writer: 13975420928 bytes in the stores, 1 GiB of them the copy-rate
    # reference's pages: 1538 pages, 1151 short (nine 128-page write-backs and a 127-page tail)
    stored = 13975420928 - (1 << 30)
    assert stored // page == 1538 and pages - stored // page == 1151
    assert bench.expected_pages([20, 31, 32], 16) == 1 + 1 + 2  # partial last pages: never


def test_the_writers_trace_counts_failed_and_slow_stores(bench):
    text = (
        "[ptstore-trace] batch_exists at 5.000: 128 pages, 0 hits, 1.0 ms\n"
        "[ptstore-trace] batch_set_v1 at 10.000: 128 pages, 128 hits, 1900.0 ms\n"
        "[ptstore-trace] batch_get_v1 at 11.000: 128 pages, 128 hits, 200.0 ms\n"
        "[ptstore-trace] batch_set_v1 at 12.000: 128 pages, 0 hits, 4150.5 ms\n"
        "[ptstore-trace] batch_set_v1 at 17.000: 1 pages, 1 hits, 100.0 ms\n"
    )
    puts = bench.parse_trace(text, bench.TRACE_PUT)
    assert [p[1:3] for p in puts] == [(128, 128), (128, 0), (1, 1)]
    assert len(bench.parse_trace(text)) == 1  # loads only, by default
    s = bench.put_summary(puts, 8 << 20)
    assert s["trace_puts"] == 3 and s["put_pages"] == 257 and s["put_failed_pages"] == 128
    assert s["put_ms_max"] == 4150.5
    assert s["put_gbps"] == pytest.approx(129 * (8 << 20) / 6.1505 / 1e9)
    assert bench.put_summary([], 8 << 20) == {"trace_puts": 0, "put_pages": 0,
                                              "put_failed_pages": 0, "put_ms_max": 0.0}


def test_lookup_bench_pools_samples_and_takes_each_samples_p99():
    """``bench_lookup_beside_writes.summarize``: percentiles over the pooled lookups, one p99
    per sample (what the headline row takes the median of), the median put rate."""
    mod = importlib.import_module("benchmark.store.bench_lookup_beside_writes")
    a = {"lookup_ms": [1.0] * 99 + [100.0], "put_gbps": 0.5}
    b = {"lookup_ms": [2.0] * 100, "put_gbps": 0.7}
    r = mod.summarize([a, b])
    assert r["lookup_p50_ms"] == 2.0 and r["lookup_max_ms"] == 100.0  # 99 x 1, 100 x 2, 100
    assert r["lookup_p99_ms_all"] == [1.0, 2.0]  # 99th of 100 sorted: index 98
    assert r["put_gbps"] == pytest.approx(0.6) and r["put_gbps_all"] == [0.5, 0.7]
