"""``kernels/bench_segmented_decode.py --smoke``: the ways of one decode step agree (the
benchmark refuses to time variants whose outputs differ) and the report names each."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from benchmark.kernels import bench_segmented_decode


def test_smoke_checks_every_variant_against_vanilla_and_reports_them(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_segmented_decode", "--smoke", "--out",
                                      str(tmp_path)])
    bench_segmented_decode.main()
    report = json.loads((tmp_path / "segmented_decode_cpu_smoke.json").read_text())
    assert list(report["results"]) == ["vanilla", "per-run", "grouped", "graph"]
    assert all(len(r["attend_ms_all"]) == 3 for r in report["results"].values())
    assert report["config"]["distinct_keys"] < report["config"]["keys_read"]
    assert (tmp_path / "segmented_decode_cpu_smoke.png").exists()


def test_a_wrong_turn_is_refused(tmp_path, monkeypatch):
    """Runs read without their turn give another output than vanilla's: the run stops."""
    from sglang_pic.position_free.run_kernels import TorchRunKernels

    monkeypatch.setattr(TorchRunKernels, "turn",
                        staticmethod(lambda q, rows, *args: q.index_select(0, rows)))
    monkeypatch.setattr(bench_segmented_decode, "VARIANTS", ("vanilla", "grouped"))
    monkeypatch.setattr(sys, "argv", ["bench_segmented_decode", "--smoke", "--out",
                                      str(tmp_path)])
    with pytest.raises(SystemExit, match="differs from vanilla"):
        bench_segmented_decode.main()


def test_a_grid_cell_gives_its_tenants_and_document_lengths(tmp_path, monkeypatch):
    """``--cell``: the grid cell's documents (its count, per request, length law) and one system
    prompt per tenant; the outputs still agree with vanilla's and the file names the cell."""
    from benchmark import bench_rag_grid

    monkeypatch.setitem(bench_rag_grid.CELLS, "tiny", ("lognormal", 3, 5, 1.0, 3))
    monkeypatch.setattr(bench_rag_grid, "PARAMS", dict(
        bench_rag_grid.PARAMS, doc_min=8, doc_max=64, doc_median=24, system_min=4,
        system_max=12))
    monkeypatch.setattr(sys, "argv", ["bench_segmented_decode", "--smoke", "--cell", "tiny",
                                      "--out", str(tmp_path)])
    bench_segmented_decode.main()
    report = json.loads((tmp_path / "segmented_decode_cpu_smoke_tiny.json").read_text())
    assert report["config"] | {"cell": "tiny", "docs": 5, "per_request": 3, "zipf": 1.0} \
        == report["config"]
    args = types.SimpleNamespace(**report["config"])
    doc_len, system_len = bench_segmented_decode._lengths(args, np.random.default_rng(0))
    assert len(doc_len) == 5 and len(set(doc_len)) > 1 and min(doc_len) >= 8
    assert len(system_len) == 3 and all(4 <= n <= 12 for n in system_len)
