"""``--ptstore-trace``'s line when the scheduler takes a finished prefetch
(``store/prefetch_trace.py``), read back by the TTFT benchmark."""

from __future__ import annotations

import importlib

from sglang_pic.store import prefetch_trace


class _Cache:
    def __init__(self) -> None:
        self.ongoing_prefetch = {"a": object(), "b": object()}
        self.prefetch_loaded_tokens_by_reqid: dict[str, int] = {}

    def check_prefetch_progress(self, req_id: str) -> bool:
        """Like HiRadixCache: True with nothing in flight; "a" is done, "b" still loading."""
        if req_id not in self.ongoing_prefetch:
            return True
        if req_id == "b":
            return False
        del self.ongoing_prefetch[req_id]
        self.prefetch_loaded_tokens_by_reqid[req_id] = 8192
        return True


def test_one_line_when_the_scheduler_takes_a_prefetch(capsys):
    cache = _Cache()
    check = prefetch_trace.around_check_prefetch_progress
    orig = _Cache.check_prefetch_progress
    assert check(orig, cache, "b") is False  # still loading: no line
    assert check(orig, cache, "a") is True  # taken now: one line
    assert check(orig, cache, "a") is True  # nothing in flight any more: no second line
    assert check(orig, cache, "never") is True  # no prefetch at all: no line
    err = capsys.readouterr().err
    bench = importlib.import_module("benchmark.store.bench_store_ttft")
    assert [tokens for _, tokens in bench.TRACE_DONE.findall(err)] == ["8192"]
    assert err.count("[ptstore-trace]") == 1


class _Batch:
    def __init__(self, tokens: int, reqs: int) -> None:
        self.extend_num_tokens = tokens
        self.reqs = [object()] * reqs


class _Plan:
    """Like SGLang's NextBatchPlan: what get_new_batch_prefill returns."""

    def __init__(self, batch: _Batch | None) -> None:
        self.batch_to_run = batch


def test_prefill_batches_traced_and_a_cold_miss_split(capsys):
    """A line per non-empty prefill batch, parsed back; a cold miss's phases come from the
    lookup and prefill lines inside its window."""
    after = prefetch_trace.after_new_prefill_batch
    first, none, empty = _Plan(_Batch(8192, 1)), _Plan(None), _Plan(_Batch(0, 0))
    assert after(first, object()) is first
    assert after(none, object()) is none and after(empty, object()) is empty  # no line
    after(_Plan(_Batch(64, 1)), object())
    err = capsys.readouterr().err
    bench = importlib.import_module("benchmark.store.bench_store_ttft")
    got = [(int(k), int(n)) for _, k, n in bench.TRACE_PREFILL.findall(err)]
    assert got == [(8192, 1), (64, 1)]
    # request at 100.000 s, lookup 100.002-100.010, chunks formed at 100.012 and 100.250,
    # first token at 100.300; a line outside the window is not counted
    lookups = [(100.002, 128, 0, 8.0), (99.0, 128, 128, 1.0)]
    prefills = [(100.012, 8192), (100.250, 64), (101.0, 8192)]
    ph = bench.cold_phases_in(lookups, prefills, 100.0, 0.3)
    assert ph == {"ttft_ms": 300.0, "prefill_batches": 2, "lookup_start_ms": 2.0,
                  "lookup_end_ms": 10.0, "first_prefill_ms": 12.0, "last_prefill_ms": 250.0}


class _UnifiedCache:
    """Like SGLang 0.5.23's UnifiedRadixCache: a finished prefetch goes into the tree in
    ``_handle_prefetch_result``, which records what it loaded by request handle."""

    def __init__(self) -> None:
        self.prefetch_loaded_tokens_by_reqid: dict[object, int] = {}

    def _handle_prefetch_result(self, operation) -> None:
        self.prefetch_loaded_tokens_by_reqid[operation.handle] = 384


def test_one_line_when_a_finished_prefetch_goes_into_the_tree(capsys):
    from types import SimpleNamespace

    cache = _UnifiedCache()
    operation = SimpleNamespace(handle=("rid", 0))
    assert prefetch_trace.around_handle_prefetch_result(
        _UnifiedCache._handle_prefetch_result, cache, operation) is None
    err = capsys.readouterr().err
    bench = importlib.import_module("benchmark.store.bench_store_ttft")
    assert [tokens for _, tokens in bench.TRACE_DONE.findall(err)] == ["384"]
