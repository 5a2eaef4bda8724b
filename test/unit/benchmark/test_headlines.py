"""The README quotes only rows of benchmark/results/headlines.json (its results table rendered from
them), that file is current, and benchmark/results/ holds only files something cites."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

HEADLINES = REPO / "benchmark" / "results" / "headlines.json"


def test_headlines_json_matches_the_raw_results():
    out = subprocess.run([sys.executable, "-m", "benchmark.headlines", "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_readme_names_only_existing_claims():
    claims = {r["claim"] for r in json.loads(HEADLINES.read_text())["rows"]}
    cited = re.findall(r"\[`([a-z_]+\.[a-z0-9_.*]+)`", (REPO / "README.md").read_text())
    assert cited, "the README cites no headline row"
    for name in cited:  # "a.*" cites every row a.<something>
        pattern = re.compile(re.escape(name).replace(r"\*", ".+") + "$")
        assert any(pattern.match(c) for c in claims), f"README cites unknown row {name}"


def test_a_points_target_is_met_within_that_many_points_and_a_missing_file_is_listed(
        tmp_path, monkeypatch):
    """``sparse.quality.*``: sparse within 1 point of dense (a score of 0-100 from per-case
    0/100 samples, their mean), not a ratio; without its raw file the row says so."""
    from benchmark import headlines

    monkeypatch.setattr(headlines, "RESULTS", tmp_path)
    claim = next(c for c in headlines.CLAIMS if c.claim == "sparse.quality.8k")
    row = headlines._row(claim)
    assert row["ours"] is None and "missing" in row["note"] and row["target_kind"] == "points"

    def write(dense: list[float], sparse: list[float]) -> dict:
        results = {"vanilla": {"score_8k_all": dense, "attention_backend": "flashinfer"},
                   "sglang-pic-sparse": {"score_8k_all": sparse}}
        (tmp_path / claim.raw_file).write_text(json.dumps({"results": results}))
        return headlines._row(claim)

    row = write([100.0] * 99 + [0.0], [100.0] * 98 + [0.0] * 2)  # 99 vs 98 points
    assert (row["baseline"], row["ours"], row["samples"]) == (99.0, 98.0, 100)
    assert row["meets_target"] and row["baseline_backend"] == "flashinfer"
    # a run that predates a fix of what it measures is quoted, flagged until re-measured
    assert headlines.problems(row) == []
    assert headlines.problems({**row, "superseded": True}) == ["measured before a fix"]
    row = write([100.0] * 50 + [0.0] * 50, [100.0] * 48 + [0.0] * 52)  # 2 points below
    assert not row["meets_target"]  # a ratio of 0.96 would pass a 0.95 ratio target
    assert write([0.0] * 100, [100.0] + [0.0] * 99)["meets_target"]  # better is met


def test_end_to_end_eviction_rows_take_the_better_vanilla_policy_and_the_mean_of_runs(
        tmp_path, monkeypatch):
    from benchmark import headlines

    monkeypatch.setattr(headlines, "RESULTS", tmp_path)
    claim = next(c for c in headlines.CLAIMS if c.claim == "eviction.e2e_hit_rate")
    results = {
        "vanilla": {"policy": "lru", "token_hit_rate_all": [0.20, 0.24, 0.22],
                    "attention_backend": "flashinfer"},
        "vanilla-fifo": {"policy": "fifo", "token_hit_rate_all": [0.25, 0.27, 0.26],
                         "attention_backend": "flashinfer"},
        "sglang-pic": {"policy": "sae", "token_hit_rate_all": [0.30, 0.28, 0.29]},
    }
    (tmp_path / claim.raw_file).write_text(json.dumps({"results": results, "rounds": 3}))
    row = headlines._row(claim)
    assert row["baseline_variant"] == "vanilla-fifo" and row["baseline_backend"] == "flashinfer"
    assert abs(row["baseline"] - 0.26) < 1e-9 and abs(row["ours"] - 0.29) < 1e-9
    assert row["samples"] == 3 and row["spread"]["baseline"] == [0.25, 0.27]
    assert "fifo" in row["note"] and "3 alternating" in row["note"]


def test_a_void_row_quotes_no_number_even_with_its_raw_file_present(tmp_path, monkeypatch):
    """Rows measured with a defect (``Claim.void``) keep their raw file as a record but give no
    baseline, ours or ratio, and say why; README must not cite them as numbers."""
    import dataclasses

    from benchmark import headlines

    monkeypatch.setattr(headlines, "RESULTS", tmp_path)
    (tmp_path / "raw.json").write_text(json.dumps({"results": {
        "vanilla": {"ttft_ms_all": [10.0, 11.0, 12.0], "attention_backend": "flashinfer"},
        "sglang-pic": {"ttft_ms_all": [1.0, 1.1, 1.2]}}}))
    claim = headlines.Claim("x.ttft", "raw.json", "ttft_ms", target=2.0)
    measured = headlines._row(claim)
    assert measured["ratio"] == pytest.approx(10.0) and measured["meets_target"] is True
    row = headlines._row(dataclasses.replace(claim, void="timed a wrong computation"))
    assert (row["baseline"], row["ours"], row["ratio"], row["meets_target"]) == (None,) * 4
    assert row["note"].startswith("void: timed a wrong computation")
    assert headlines.problems(row) == ["void"]


def test_a_rerun_file_holding_both_sides_of_a_row_is_preferred(tmp_path, monkeypatch):
    """``bench_nonspan_overhead.py --name nonspan_overhead_rerun_h200`` re-measures a subset:
    a row takes the rerun when it holds both variants' samples, else the full run."""
    from benchmark import headlines

    monkeypatch.setattr(headlines, "RESULTS", tmp_path)
    claim = next(c for c in headlines.CLAIMS if c.claim == "spans.nonspan.tpot_b32_8k")
    other = next(c for c in headlines.CLAIMS if c.claim == "spans.nonspan.tpot_b1_1k")

    def write(name: str, metric: str, base: list[float], ours: list[float]) -> None:
        results = {"vanilla": {f"{metric}_all": base, "attention_backend": "flashinfer"},
                   "sglang-pic-spans": {f"{metric}_all": ours}}
        (tmp_path / name).write_text(json.dumps({"results": results}))

    write(headlines.NONSPAN, claim.metric, [14.0] * 3, [16.0] * 3)
    write(headlines.NONSPAN_RERUN, claim.metric, [14.0] * 6, [14.1] * 6)
    row = headlines._row(claim)
    assert row["raw_file"] == headlines.NONSPAN_RERUN and row["samples"] == 6
    assert row["ours"] == 14.1
    # a row the rerun did not measure comes from the full run
    write(headlines.NONSPAN, other.metric, [6.0] * 3, [5.9] * 3)
    assert headlines._row(other)["raw_file"] == headlines.NONSPAN


def test_each_end_to_end_eviction_row_takes_the_vanilla_policy_better_by_its_own_metric(
        tmp_path, monkeypatch):
    """A vanilla policy with the best hit rate but a slow run (a fresh machine's compiles in
    its replay) is the hit-rate row's baseline, not the TTFT row's."""
    from benchmark import headlines

    monkeypatch.setattr(headlines, "RESULTS", tmp_path)
    results = {
        "vanilla": {"policy": "lru", "token_hit_rate_all": [0.27], "ttft_p50_ms_all": [6000.0],
                    "attention_backend": "flashinfer"},
        "vanilla-slru": {"policy": "slru", "token_hit_rate_all": [0.26],
                         "ttft_p50_ms_all": [700.0], "attention_backend": "flashinfer"},
        "sglang-pic": {"policy": "sae", "token_hit_rate_all": [0.28], "ttft_p50_ms_all": [600.0]},
    }
    rows = {}
    for name in ("eviction.e2e_hit_rate", "eviction.e2e_ttft_p50"):
        claim = next(c for c in headlines.CLAIMS if c.claim == name)
        (tmp_path / claim.raw_file).write_text(json.dumps({"results": results, "rounds": 1}))
        rows[name] = headlines._row(claim)
    assert rows["eviction.e2e_hit_rate"]["baseline_variant"] == "vanilla"
    assert rows["eviction.e2e_ttft_p50"]["baseline_variant"] == "vanilla-slru"
    assert abs(rows["eviction.e2e_ttft_p50"]["ratio"] - 700 / 600) < 1e-9


def test_the_mean_ttft_row_is_each_runs_mean_over_its_requests(tmp_path, monkeypatch):
    """``eviction.e2e_ttft_mean``: a run's mean TTFT comes from its requests' TTFTs
    (``request_ttft_ms_all``), then the row takes the mean over runs of the better vanilla."""
    from benchmark import headlines

    monkeypatch.setattr(headlines, "RESULTS", tmp_path)
    results = {
        "vanilla": {"policy": "lru", "request_ttft_ms_all": [[100.0, 300.0], [200.0, 400.0]],
                    "attention_backend": "flashinfer"},
        "vanilla-slru": {"policy": "slru", "request_ttft_ms_all": [[500.0, 700.0], [10.0, 30.0]],
                         "attention_backend": "flashinfer"},
        "sglang-pic": {"policy": "sae", "request_ttft_ms_all": [[90.0, 110.0], [300.0, 500.0]]},
    }
    claim = next(c for c in headlines.CLAIMS if c.claim == "eviction.e2e_ttft_mean")
    (tmp_path / claim.raw_file).write_text(json.dumps({"results": results, "rounds": 2}))
    row = headlines._row(claim)
    assert row["baseline_variant"] == "vanilla"  # mean 250 ms against slru's 310
    assert row["spread"]["baseline"] == [200.0, 300.0] and row["spread"]["ours"] == [100.0, 400.0]
    assert abs(row["ratio"] - 250.0 / 250.0) < 1e-9 and row["samples"] == 2


def test_the_readme_results_table_is_rendered_from_headlines_json():
    """README.md's results table is ``headlines.readme_table`` of headlines.json's rows, between
    its ``results:start`` / ``results:end`` lines (``benchmark/headlines.py`` writes it), and
    every row it shows is a current headline row."""
    from benchmark import headlines

    rows = json.loads(HEADLINES.read_text())["rows"]
    readme = (REPO / "README.md").read_text()
    assert readme.count(headlines.README_START) == 1 and readme.count(headlines.README_END) == 1
    shown = readme.split(headlines.README_START)[1].split(headlines.README_END)[0]
    assert shown == "\n" + headlines.readme_table(rows), (
        "README.md's results table is stale: run python -m benchmark.headlines")
    current = {r["claim"] for r in rows if not r["problems"] and r["ratio"] is not None}
    assert {row.claim for row in headlines.README_ROWS} <= current


def test_the_readme_table_refuses_a_row_that_is_not_current():
    from benchmark import headlines

    rows = json.loads(HEADLINES.read_text())["rows"]
    first = headlines.README_ROWS[0].claim
    stale = [{**r, "problems": ["measured before a fix"]} if r["claim"] == first else r
             for r in rows]
    with pytest.raises(ValueError, match=re.escape(first)):
        headlines.readme_table(stale)
    with pytest.raises(ValueError, match="absent"):
        headlines.readme_table([r for r in rows if r["claim"] != first])


RESULTS = REPO / "benchmark" / "results"
RESULTS_README = RESULTS / "README.md"


def _results_files() -> list[str]:
    """Every file of benchmark/results/ but its README, as a path relative to it."""
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*")
                  if p.is_file() and p != RESULTS_README)


def _results_readme_entries() -> list[str]:
    """The names and patterns (``*``) in the first column of benchmark/results/README.md's
    table."""
    entries = []
    for line in RESULTS_README.read_text().splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            entries += re.findall(r"`([^`]+)`", cells[1])
    return entries


def test_every_results_file_is_cited():
    """benchmark/results/ holds what headlines.json cites, what README.md or a doc names or
    shows, and what its own README names exactly (the inputs of a plotting script, figures a doc
    refers to as "the .png beside it"): a file nothing cites is history, and leaves the tree."""
    citing = [HEADLINES.read_text(), (REPO / "README.md").read_text(),
              *(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))]
    exact = set(_results_readme_entries())
    uncited = [f for f in _results_files()
               if f not in exact and not any(Path(f).name in text for text in citing)]
    assert not uncited, (
        f"files in benchmark/results/ cited by nothing (not headlines.json, README.md, docs/ "
        f"nor by name in benchmark/results/README.md): {uncited}; git rm them")


def test_the_results_readme_names_every_file_and_no_missing_one():
    import fnmatch

    files = _results_files()
    entries = _results_readme_entries()
    assert entries, "benchmark/results/README.md lists no file"
    unnamed = [f for f in files if not any(fnmatch.fnmatchcase(f, e) for e in entries)]
    assert not unnamed, f"benchmark/results/README.md does not say what these are: {unnamed}"
    stale = [e for e in entries if not any(fnmatch.fnmatchcase(f, e) for f in files)]
    assert not stale, f"benchmark/results/README.md names files that are gone: {stale}"
