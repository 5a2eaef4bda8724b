"""``--ptstore-trace``'s line when the scheduler takes a finished prefetch
(``store/prefetch_trace.py``), read back by the TTFT benchmark."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from sglang_pic.store import prefetch_trace

BENCH = Path(__file__).resolve().parent.parent / "benchmark"


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
    for p in (str(BENCH), str(BENCH / "store")):
        if p not in sys.path:
            sys.path.insert(0, p)
    bench = importlib.import_module("bench_store_ttft")
    assert [tokens for _, tokens in bench.TRACE_DONE.findall(err)] == ["8192"]
    assert err.count("[ptstore-trace]") == 1
