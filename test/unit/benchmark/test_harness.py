"""The side-by-side benchmark harness: variants see (or do not see) our plugin; ratios."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO

from benchmark import harness


def test_ratio_table():
    rows = harness.ratio_table({"vanilla": {"a": 2.0, "b": 4, "flag": True, "lst": [1]},
                                "sglang-pic": {"a": 1.0, "b": 4}}, {"b"})
    by = {r["metric"]: r for r in rows}
    assert set(by) == {"a", "b"}
    assert by["a"]["ratio"] == 0.5 and by["b"]["ratio"] == 1.0 and by["b"]["better"] == "higher"


def test_plugin_site_declares_our_entry_point(tmp_path):
    from importlib.metadata import distributions

    site = harness.plugin_site(tmp_path / "site")
    dists = list(distributions(path=[str(site)]))
    assert [d.metadata["Name"] for d in dists] == ["sglang-pic"]
    eps = {e.name: e.value for e in dists[0].entry_points if e.group == "sglang.srt.plugins"}
    assert eps == {"sglang_pic": "sglang_pic.plugin:register"}


def test_only_pic_variant_gets_our_entry_point(tmp_path, monkeypatch):
    """Both sides can import our modules (the workloads' helpers do); only sglang-pic variants
    get the plugin site whose entry point makes SGLang load our plugin."""
    site = tmp_path / "site"
    monkeypatch.setenv("PYTHONPATH", f"/elsewhere:{REPO / 'python'}")
    van = harness.variant_env("vanilla", site)["PYTHONPATH"].split(":")
    pic = harness.variant_env("sglang-pic", site)["PYTHONPATH"].split(":")
    ours = [str(REPO / "python"), str(REPO / "sgl-kernel" / "python")]
    assert van == [*ours, "/elsewhere"]
    assert pic == [str(site), *ours, "/elsewhere"]


def test_a_variant_can_be_pinned_to_its_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    site = tmp_path / "site"
    assert harness.variant_env("sglang-pic-ptstore-writer", site, "0")["CUDA_VISIBLE_DEVICES"] == "0"
    assert harness.variant_env("sglang-pic-ptstore", site, "1")["CUDA_VISIBLE_DEVICES"] == "1"
    assert harness.variant_env("vanilla", site)["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_rounds_pool_samples_and_keep_each_rounds_median():
    from benchmark.harness import merge_rounds

    a = {"ttft_ms": 2.0, "ttft_ms_all": [1.0, 2.0, 3.0], "engine_start_s": 40.0}
    b = {"ttft_ms": 5.0, "ttft_ms_all": [4.0, 5.0, 6.0], "engine_start_s": 41.0}
    merged = merge_rounds([a, b])
    assert merged["ttft_ms_all"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert merged["ttft_ms"] == 3.5 and merged["ttft_ms_rounds"] == [2.0, 5.0]
    assert merged["rounds"] == 2 and merged["engine_start_s"] == 40.0
    assert merge_rounds([a, {"error": "exit code 1"}]) == {"error": "exit code 1"}
    assert merge_rounds([a]) is a
    # per-sample records that are not numbers (a store reader's phase splits) pool, no median
    a["phases_8192_all"], b["phases_8192_all"] = [{"loading_ms": 70.0}], [{"loading_ms": 80.0}]
    a["phases_8192"] = {"loading_ms": 70.0}
    merged = merge_rounds([a, b])
    assert merged["phases_8192_all"] == [{"loading_ms": 70.0}, {"loading_ms": 80.0}]
    assert merged["phases_8192"] == {"loading_ms": 70.0}  # the first round's
    # a list the first round did not record yet (its report predates it) keeps the later ones'
    b["request_ttft_ms_all"] = [[1.0, 9.0]]
    merged = merge_rounds([a, b])
    assert merged["request_ttft_ms_all"] == [[1.0, 9.0]]


def test_a_run_resumed_in_another_call_continues_the_alternation_and_pools(tmp_path,
                                                                           monkeypatch):
    """``resume_from``: rounds a later device call adds to an earlier call's report (same
    settings) go on alternating which variant runs first, and every sample is pooled."""
    import json

    import pytest

    order: list[str] = []
    rounds: list[int] = []  # the round each process was told (fresh prompts are seeded by it)

    def fake_run(cmd, env, cwd, timeout):  # the variant's process: one sample, its run number
        spec = json.loads(Path(cmd[-1]).read_text())
        order.append(env["SGLANG_PIC_BENCH_VARIANT"])
        rounds.append(int(env[harness.ROUND_ENV]))
        Path(spec["out"]).write_text(json.dumps({"x": len(order), "x_all": [len(order)]}))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(harness.subprocess, "run", fake_run)
    args = ("e2e", "m", "f", {"device": "cpu"}, {"p": 1})
    kw = dict(variants=("vanilla", "sglang-pic"), out_dir=str(tmp_path))
    first = harness.run_side_by_side(*args, rounds=1, **kw)
    assert (first["rounds"], first["calls"]) == (1, 1)
    earlier = tmp_path / "earlier.json"
    (tmp_path / "e2e.json").rename(earlier)
    second = harness.run_side_by_side(*args, rounds=2, resume_from=str(earlier), **kw)
    assert order == ["vanilla", "sglang-pic", "sglang-pic", "vanilla", "vanilla", "sglang-pic"]
    assert rounds == [0, 0, 1, 1, 2, 2]
    assert (second["rounds"], second["calls"]) == (3, 2)
    assert second["results"]["vanilla"]["x_all"] == [1, 4, 5]
    assert second["results"]["sglang-pic"]["x_all"] == [2, 3, 6]
    assert second["results"]["vanilla"]["x_rounds"] == [1, 4, 5]
    assert second["results"]["vanilla"]["rounds"] == 3
    with pytest.raises(SystemExit, match="params differs"):
        harness.run_side_by_side("e2e", "m", "f", {"device": "cpu"}, {"p": 2}, rounds=1,
                                 resume_from=str(earlier), **kw)


def test_variant_settings_reach_only_their_variants_process(tmp_path, monkeypatch):
    """``variant_settings``: a flag's hand-off variable (``--position-free-span-graphs``) is set
    in the process of the variant that asks for it, not in the others', and recorded."""
    import json

    seen: dict[str, str | None] = {}

    def fake_run(cmd, env, cwd, timeout):
        spec = json.loads(Path(cmd[-1]).read_text())
        seen[env["SGLANG_PIC_BENCH_VARIANT"]] = env.get("SGLANG_PIC_SPAN_GRAPHS")
        Path(spec["out"]).write_text(json.dumps({"x": 1.0, "x_all": [1.0]}))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.delenv("SGLANG_PIC_SPAN_GRAPHS", raising=False)
    monkeypatch.setattr(harness.subprocess, "run", fake_run)
    settings = {"sglang-pic-spans-graphs": {"SGLANG_PIC_SPAN_GRAPHS": "1"}}
    report = harness.run_side_by_side(
        "e2e", "m", "f", {"device": "cpu"}, {"p": 1}, out_dir=str(tmp_path),
        variants=("vanilla", "sglang-pic-spans", "sglang-pic-spans-graphs"),
        variant_settings=settings)
    assert seen == {"vanilla": None, "sglang-pic-spans": None, "sglang-pic-spans-graphs": "1"}
    assert report["variant_settings"] == settings


def test_a_reselect_variant_runs_its_sparse_variant_with_the_interval(tmp_path, monkeypatch):
    """``<sparse variant>-r<N>``: the process gets ``--sparse-reselect-interval N``'s variable and
    our paths; other names get neither and are not taken for one."""
    monkeypatch.delenv("SGLANG_PIC_SPARSE_RESELECT_INTERVAL", raising=False)
    monkeypatch.delenv("SGLANG_PIC_SPARSE_VOTE_INTERVAL", raising=False)
    assert harness.reselect_variant("sglang-pic-flashinfer-r4") == (
        "sglang-pic-flashinfer", 4, "reselect_interval")
    assert harness.reselect_variant("sglang-pic-v3") == ("sglang-pic", 3, "vote_interval")
    for name in ("sglang-pic-flashinfer", "vanilla-r4", "sglang-pic-r0", "sglang-pic-r4x",
                 "sglang-pic-x4"):
        assert harness.reselect_variant(name) is None
    site = harness.plugin_site(tmp_path)
    env = harness.variant_env("sglang-pic-r8", site)
    assert env["SGLANG_PIC_SPARSE_RESELECT_INTERVAL"] == "8"
    assert "SGLANG_PIC_SPARSE_VOTE_INTERVAL" not in env
    assert harness.variant_env("sglang-pic-v4", site)["SGLANG_PIC_SPARSE_VOTE_INTERVAL"] == "4"
    assert str(harness.REPO / "python") in env["PYTHONPATH"].split(":")
    assert "SGLANG_PIC_SPARSE_RESELECT_INTERVAL" not in harness.variant_env("sglang-pic", site)


def test_sparse_variant_kwargs_maps_reselect_variants_to_their_base_and_refuses_the_rest():
    sparse = {"sglang-pic": {"attention_backend": "pariskv_triton"}}
    got = harness.sparse_variant_kwargs(("vanilla", "sglang-pic", "sglang-pic-r4"), sparse)
    assert got == {"sglang-pic": sparse["sglang-pic"], "sglang-pic-r4": sparse["sglang-pic"]}
    for bad, message in (("bogus", "unknown variant 'bogus': known vanilla, sglang-pic"),
                         ("sglang-pic-dense-r4", "unknown variant"),
                         ("sglang-pic-r65", "reselect-interval must be <= 64"),
                         ("sglang-pic-v65", "vote-interval must be <= 64")):
        with pytest.raises(ValueError, match=message):
            harness.sparse_variant_kwargs((bad,), sparse)
