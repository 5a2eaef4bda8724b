"""``benchmark/kernels/bench_topk.py --smoke``: the device call's script runs end to end on a CPU
(interpreter), checks every search setting against ``torch.topk`` and writes its JSON, so the
call that times it on the H200 is not spent on a broken script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_topk_smoke_checks_every_setting_and_writes_its_report(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.kernels.bench_topk", "--smoke",
         "--thresholds", "1", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "select the top 16 of 256 (torch.topk agrees)" in proc.stdout
    report = json.loads((tmp_path / "pariskv_topk_cpu.json").read_text())
    assert [(r["thresholds"], r["warps"], r["correct"]) for r in report["results"]] == [
        (1, 4, True), (4, 4, True)]
    assert report["config"]["candidates"] == 256 and report["environment"]


def test_bench_topk_refuses_settings_it_cannot_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.kernels.bench_topk", "--smoke",
         "--thresholds", "5", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "--thresholds in 1..4" in proc.stderr
