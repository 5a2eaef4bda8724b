"""The decode benchmark's profile summary (``bench_e2e_decode.kernel_summary``) on a written
chrome trace: per-step kernel time by name, and the GPU-idle time between overlapping and
separate kernels."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from benchmark.sparse import bench_e2e_decode


def _trace(tmp_path: Path, events: list[dict]) -> Path:
    path = tmp_path / "x-DECODE.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_kernel_summary_splits_kernel_time_and_idle_time(tmp_path):
    kernels = [  # us: [0, 10) a, [5, 12) b overlapping, gap, [20, 30) a, [30, 31) c
        {"cat": "kernel", "name": "a", "ts": 0, "dur": 10},
        {"cat": "kernel", "name": "b", "ts": 5, "dur": 7},
        {"cat": "kernel", "name": "a", "ts": 20, "dur": 10},
        {"cat": "kernel", "name": "c", "ts": 30, "dur": 1},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # not a kernel
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 6},
        {"cat": "cuda_driver", "name": "cudaGraphLaunch", "ts": 20, "dur": 4},
    ]
    s = bench_e2e_decode.kernel_summary(_trace(tmp_path, kernels), steps=2)
    assert s["kernels"] == 4
    assert s["us_per_step_by_kernel"] == {"a": 10.0, "b": 3.5, "c": 0.5}
    assert s["kernel_us_per_step"] == 14.0
    assert s["busy_us_per_step"] == 11.5  # [0, 12) and [20, 31)
    assert s["span_us_per_step"] == 15.5
    assert s["gpu_idle_us_per_step"] == 4.0  # the gap [12, 20)
    assert s["cuda_runtime_us_per_step"] == {"cudaGraphLaunch": 5.0}
    assert s["cpu_op_us_per_step"] == {"aten::mm": 50.0}


def test_kernel_summary_of_a_trace_without_kernels_says_so(tmp_path):
    s = bench_e2e_decode.kernel_summary(_trace(tmp_path, [{"cat": "cpu_op", "ts": 0,
                                                           "dur": 1, "name": "x"}]), steps=3)
    assert "error" in s


def test_kernel_summary_splits_off_the_first_decode_step(tmp_path):
    """The first step (the sparse activation's encode) is reported apart; ``steady`` holds
    only the later steps' kernels and host calls."""
    step = "gpu_user_annotation"
    events = [
        {"cat": step, "name": "step[DECODE bs=1]", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "encode", "ts": 0, "dur": 90},
        {"cat": "kernel", "name": "a", "ts": 95, "dur": 5},
        {"cat": step, "name": "step[DECODE bs=1]", "ts": 100, "dur": 10},
        {"cat": "kernel", "name": "a", "ts": 100, "dur": 5},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 101, "dur": 2},
        {"cat": step, "name": "copy_result_to_cpu", "ts": 106, "dur": 1},  # not a step
        {"cat": step, "name": "step[DECODE bs=1]", "ts": 110, "dur": 10},
        {"cat": "kernel", "name": "a", "ts": 112, "dur": 6},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 50, "dur": 4},  # first step
    ]
    s = bench_e2e_decode.kernel_summary(_trace(tmp_path, events), steps=3)
    assert s["kernel_us_per_step"] == 106 / 3  # the totals keep every step
    assert s["first_step_us"] == 100
    steady = s["steady"]
    assert steady["steps"] == 2 and steady["kernels"] == 2
    assert steady["us_per_step_by_kernel"] == {"a": 5.5}
    assert steady["gpu_idle_us_per_step"] == 3.5  # the gap [105, 112) over 2 steps
    assert steady["cuda_runtime_us_per_step"] == {"cudaGraphLaunch": 1.0}


def test_kernel_summary_without_step_marks_has_no_steady_part(tmp_path):
    s = bench_e2e_decode.kernel_summary(
        _trace(tmp_path, [{"cat": "kernel", "name": "a", "ts": 0, "dur": 3}]), steps=1)
    assert "steady" not in s and "first_step_us" not in s


def test_a_report_of_another_call_merges_unless_its_cases_or_settings_differ(tmp_path):
    """``_merge_earlier``: a variant run in an earlier device call joins the report when the
    cases and settings agree (the per-call temporary profile folder may differ); otherwise the
    earlier report is left out."""

    def report(variant: str, tpot: float, **params) -> dict:
        p = {"cases": ["1x4096"], "repeats": 3, "profile_dir": f"/tmp/{variant}", **params}
        return {"params": p, "engine_kwargs": {"context_length": 4300},
                "results": {variant: {"tpot_ms_1x4096": tpot, "tokens_per_s_1x4096": 1e3 / tpot}},
                "ratios": []}

    prev = tmp_path / "sparse_e2e_decode.json.prev"
    prev.write_text(json.dumps(report("vanilla", 8.0)))
    merged = bench_e2e_decode._merge_earlier(report("sglang-pic", 4.0), prev)
    assert set(merged["results"]) == {"vanilla", "sglang-pic"} and not prev.exists()
    assert json.loads((tmp_path / "sparse_e2e_decode.json").read_text())["results"].keys() == {
        "vanilla", "sglang-pic"}
    prev.write_text(json.dumps(report("vanilla", 8.0, cases=["1x8192"])))
    alone = bench_e2e_decode._merge_earlier(report("sglang-pic", 4.0), prev)
    assert set(alone["results"]) == {"sglang-pic"}
