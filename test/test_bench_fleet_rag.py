"""``bench_fleet_rag.py``'s pieces that need no fleet: flags, the router's metrics, the summary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmark"))
import bench_fleet_rag  # noqa: E402

# lines of sglang-router 0.3.2's /metrics, as a fleet of two served them
METRICS = """\
# TYPE smg_worker_cb_outcomes_total counter
smg_worker_cb_outcomes_total{worker="http://127.0.0.1:59287",outcome="success"} 12
smg_worker_cb_outcomes_total{worker="http://127.0.0.1:59288",outcome="success"} 3
smg_worker_cb_outcomes_total{worker="http://127.0.0.1:59288",outcome="failure"} 1
smg_worker_cb_state{worker="http://127.0.0.1:59287"} 0
smg_worker_cb_state{worker="http://127.0.0.1:59288"} 1
"""


def test_engine_arguments_become_flags():
    assert bench_fleet_rag.flags({"model_path": "m", "skip_tokenizer_init": True,
                                  "disable_x": False, "page_size": 16, "y": None}) == \
        ["--model-path", "m", "--skip-tokenizer-init", "--page-size", "16"]


def test_the_routers_metrics_give_each_workers_successes_and_closed_circuits(monkeypatch):
    side = object.__new__(bench_fleet_rag.Side)
    monkeypatch.setattr(bench_fleet_rag.Side, "_metrics", lambda self: METRICS)
    assert side.worker_counts() == {"http://127.0.0.1:59287": 12.0,
                                    "http://127.0.0.1:59288": 3.0}
    assert side.healthy_workers() == 1


def test_the_summary_compares_each_side_with_vanilla_per_cell():
    def cell(rate: float, ttft: float) -> dict:
        return {"ideal_median": 3.0, "requests_per_s_median": rate, "ttft_p50_ms_median": ttft,
                "stream_ttft_p50_ms": ttft / 2, "stream_ttft_p99_ms": ttft, "errors": 0}

    report = {"results": {"vanilla": {"cells": {"a": cell(2.0, 400.0)}},
                          "sglang-pic": {"cells": {"a": cell(5.0, 100.0)}},
                          "sglang-pic-rr": {"error": "did not start"}}}
    (row,) = bench_fleet_rag.summarize(report)
    assert row["variant"] == "sglang-pic" and row["throughput_ratio"] == pytest.approx(2.5)
    assert row["ttft_p50_ratio"] == pytest.approx(4.0)
    assert row["stream_ttft_p50_ratio"] == pytest.approx(4.0)
