"""``kernels/bench_segmented_decode.py --smoke``: the three ways of one decode step agree (the
benchmark refuses to time variants whose outputs differ) and the report names each."""

from __future__ import annotations

import json
import sys

import pytest

from benchmark.kernels import bench_segmented_decode


def test_smoke_checks_every_variant_against_vanilla_and_reports_them(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_segmented_decode", "--smoke", "--out",
                                      str(tmp_path)])
    bench_segmented_decode.main()
    report = json.loads((tmp_path / "segmented_decode_cpu_smoke.json").read_text())
    assert list(report["results"]) == ["vanilla", "per-run", "grouped"]
    assert all(len(r["attend_ms_all"]) == 3 for r in report["results"].values())
    assert report["config"]["distinct_keys"] < report["config"]["keys_read"]
    assert (tmp_path / "segmented_decode_cpu_smoke.png").exists()


def test_a_wrong_turn_is_refused(tmp_path, monkeypatch):
    """Runs read without their turn give another output than vanilla's: the run stops."""
    from sglang_pic.position_free import segmented_backend

    monkeypatch.setattr(segmented_backend, "turn", lambda q, rows, table: q.index_select(0, rows))
    monkeypatch.setattr(bench_segmented_decode, "VARIANTS", ("vanilla", "grouped"))
    monkeypatch.setattr(sys, "argv", ["bench_segmented_decode", "--smoke", "--out",
                                      str(tmp_path)])
    with pytest.raises(SystemExit, match="differs from vanilla"):
        bench_segmented_decode.main()
