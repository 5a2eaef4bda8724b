"""``bench_rag_grid.py --combine``: the calls of one device run as one report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark import bench_rag_grid


def _cell(rate: float, ttft: float) -> dict:
    return {"ideal": [3.0], "requests_per_s": [rate], "ttft_p50_ms": [ttft],
            "ttft_p99_ms": [ttft], "peak_running": [8], "peak_used_tokens": [100],
            "prompt_tokens": [1000], "stream_ttft_ms_all": [ttft], "stream_ttft_p50_ms": ttft,
            "stream_ttft_p99_ms": ttft, "requests_per_s_median": rate,
            "ttft_p50_ms_median": ttft, "ttft_p99_ms_median": ttft, "ideal_median": 3.0}


def _report(tmp: Path, name: str, cells: list[str], variants: list[str], **params) -> str:
    rates = {"vanilla": 2.0, "sglang-pic": 5.0}
    doc = {"params": {"seed": 1, "burst": 64, "cells": cells, **params},
           "results": {v: {"variant": v, "cells": {c: _cell(rates[v], 100.0 / rates[v])
                                                  for c in cells}} for v in variants}}
    path = tmp / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_combine_merges_each_variants_cells_across_calls(tmp_path):
    """Vanilla's aligned cell from one call and its corner from another both reach the report,
    with a summary row per cell; the run counts as one when the calls shared a machine."""
    a = _report(tmp_path, "a.json", ["aligned"], ["vanilla"], bursts={"aligned": 128})
    b = _report(tmp_path, "b.json", ["aligned"], ["sglang-pic"], bursts={"aligned": 128})
    c = _report(tmp_path, "c.json", ["corner"], ["vanilla", "sglang-pic"])
    out = tmp_path / "grid.json"
    merged = bench_rag_grid.combine([a, b, c], str(out), one_machine=True)
    assert sorted(merged["results"]["vanilla"]["cells"]) == ["aligned", "corner"]
    assert sorted(merged["results"]["sglang-pic"]["cells"]) == ["aligned", "corner"]
    rows = {r["cell"]: r for r in merged["summary"]}
    assert rows["aligned"]["throughput_ratio"] == pytest.approx(2.5)
    assert rows["corner"]["stream_ttft_p50_ratio"] == pytest.approx(2.5)
    assert merged["merged_from_earlier_call"] and merged["one_machine"]
    assert json.loads(out.read_text())["calls"][2]["cells"] == ["corner"]


def test_combine_keeps_a_cell_whose_sides_share_a_call_as_one_run(tmp_path):
    """Calls that each ran both sides of their cells merge without the earlier-call flag, and
    the report names each cell's call."""
    a = _report(tmp_path, "a.json", ["aligned"], ["vanilla", "sglang-pic"])
    b = _report(tmp_path, "b.json", ["corner"], ["vanilla", "sglang-pic"])
    merged = bench_rag_grid.combine([a, b], str(tmp_path / "grid.json"))
    assert not merged["merged_from_earlier_call"]
    assert merged["cell_calls"]["corner"] == {"vanilla": "b.json", "sglang-pic": "b.json"}


def test_combine_refuses_calls_run_with_other_settings(tmp_path):
    a = _report(tmp_path, "a.json", ["aligned"], ["vanilla"])
    b = _report(tmp_path, "b.json", ["corner"], ["sglang-pic"], seed=2)
    with pytest.raises(SystemExit, match="different params"):
        bench_rag_grid.combine([a, b], str(tmp_path / "grid.json"))


def test_most_at_once_counts_intervals_open_together():
    assert bench_rag_grid.most_at_once([]) == 0
    assert bench_rag_grid.most_at_once([(0, 2), (1, 3), (2, 4)]) == 2  # an end before a start
    assert bench_rag_grid.most_at_once([(0, 10), (1, 2), (3, 4), (5, 9), (6, 7)]) == 3


def test_a_stream_requests_ttft_splits_into_wait_prefill_and_the_rest():
    meta = {"request_received_ts": 100.0, "forward_entry_time": 100.030,
            "prefill_finished_time": 100.050}
    parts = bench_rag_grid.ttft_parts(0.065, meta)
    assert parts == pytest.approx({"wait": 30.0, "prefill": 20.0, "rest": 15.0})
    assert bench_rag_grid.ttft_parts(0.065, {"request_received_ts": 100.0}) is None
    assert bench_rag_grid.ttft_parts(0.065, dict(meta, forward_entry_time=0.0)) is None
