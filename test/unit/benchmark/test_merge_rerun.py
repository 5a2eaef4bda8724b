"""``merge_rerun``: a re-run of some policies replaces exactly their rows in a results file,
adds a policy the file lacked, drops what it is told to, and refuses a re-run of other cells."""

from __future__ import annotations

import pytest

from benchmark.eviction.merge_rerun import merge


def _rows(policy: str, hit: float, seeds=(0, 1)) -> list[dict]:
    return [{"policy": policy, "workload": "chat", "seed": s, "fraction": f,
             "token_hit_rate": hit} for s in seeds for f in (0.05, 0.4)]


def _report(*rows: list[dict], policies: list[str]) -> dict:
    return {"environment": {"time_utc": "t0"}, "policies": policies,
            "rows": [r for rs in rows for r in rs]}


def test_rerun_rows_replace_the_old_ones_and_others_stay():
    old = _report(_rows("lru", 0.1), _rows("sae", 0.2), _rows("gdsf", 0.3),
                  policies=["lru", "sae", "gdsf"])
    new = {"environment": {"time_utc": "t1"}, "rows": _rows("sae", 0.25) + _rows("auto", 0.4)}
    merged = merge(old, new, {"git_commit": "abc", "command": "c", "why": "w"}, drop=("gdsf",))
    by_policy = {}
    for r in merged["rows"]:
        by_policy.setdefault(r["policy"], set()).add(r["token_hit_rate"])
    assert by_policy == {"lru": {0.1}, "sae": {0.25}, "auto": {0.4}}
    assert len(merged["rows"]) == 12
    assert merged["policies"] == ["lru", "sae", "auto"]
    assert merged["reruns"] == [{"policies": ["auto", "sae"], "time_utc": "t1", "git_commit": "abc",
                                 "command": "c", "why": "w", "dropped": ["gdsf"]}]
    assert len(old["rows"]) == 12 and old["policies"] == ["lru", "sae", "gdsf"]  # not mutated


@pytest.mark.parametrize("rows, match", [
    (_rows("sae", 0.2, seeds=(0, 1, 2)), "cells the results file lacks"),
    (_rows("sae", 0.2, seeds=(0,)), "covers 2 of the file's 4 cells"),
])
def test_a_rerun_of_other_cells_is_refused(rows, match):
    old = _report(_rows("lru", 0.1), _rows("sae", 0.2), policies=["lru", "sae"])
    with pytest.raises(ValueError, match=match):
        merge(old, {"rows": rows}, {"git_commit": "abc", "command": "c", "why": "w"})


def test_a_trace_replay_merges_by_size():
    old = {"config": {"policies": ["lru", "auto"]}, "rows": [
        {"policy": p, "size": s, "token_hit_rate": 0.1} for p in ("lru", "auto")
        for s in ("5pct", "40pct")]}
    new = {"rows": [{"policy": "auto", "size": s, "token_hit_rate": 0.5}
                    for s in ("5pct", "40pct")]}
    merged = merge(old, new, {"git_commit": "abc", "command": "c", "why": "w"})
    assert sorted((r["policy"], r["token_hit_rate"]) for r in merged["rows"]) == [
        ("auto", 0.5), ("auto", 0.5), ("lru", 0.1), ("lru", 0.1)]
    assert merged["config"]["policies"] == ["lru", "auto"]
