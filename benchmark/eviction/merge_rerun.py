"""Merge a re-run of some policies into a committed eviction results file.

Why: a change to one policy invalidates that policy's rows only; replaying every policy again
costs hours of CPU. A re-run (``bench_eviction.py --policies P --out /tmp/x.json`` or
``replay_trace.py --policies P --out ...`` with the same workloads, seeds, sizes and trace)
replaces the rows of the policies it holds, adds them where the file had none, and is recorded
in the file's ``reruns`` list (policies, time, commit, command, why), so ``headlines.py`` and a
reader see which rows are newer than the file's ``environment``.

    python3 -m benchmark.eviction.merge_rerun RESULTS RERUN --command "..." --why "..."
        [--drop POLICY ...]

``--drop``: policies whose rows are removed (changed code, not re-run). The merge refuses a
re-run of other workloads, seeds or sizes than the file's (``key`` below).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

from benchmark import description


def key(row: dict) -> tuple:
    """What identifies a cell apart from its policy: a generated workload's (workload, seed,
    fraction) or a trace replay's size."""
    if "workload" in row:
        return row["workload"], row.get("seed"), row.get("fraction")
    return (row.get("size"),)


def _policies(report: dict) -> list[str] | None:
    """The report's list of policies, where it keeps one (generated: top level; trace: config)."""
    if isinstance(report.get("policies"), list):
        return report["policies"]
    return report.get("config", {}).get("policies")


def merge(old: dict, new: dict, record: dict, drop: tuple[str, ...] = ()) -> dict:
    """``old`` with ``new``'s policies' rows in place of its own and ``drop``'s removed; the
    re-run is appended to ``reruns`` (``record``: command, why, commit)."""
    rerun = sorted({r["policy"] for r in new["rows"]})
    cells = {key(r) for r in old["rows"]}
    stray = sorted({key(r) for r in new["rows"]} - cells, key=str)
    if stray:
        raise ValueError(f"the re-run has cells the results file lacks: {stray[:3]}")
    for policy in rerun:
        have = {key(r) for r in new["rows"] if r["policy"] == policy}
        if have != cells:
            raise ValueError(f"the re-run of {policy} covers {len(have)} of the file's "
                             f"{len(cells)} cells")
    rows = [r for r in old["rows"] if r["policy"] not in rerun and r["policy"] not in drop]
    merged = {**copy.deepcopy(old), "rows": rows + new["rows"]}
    listed = _policies(merged)
    if listed is not None:
        listed[:] = [p for p in listed if p not in drop] + [p for p in rerun if p not in listed]
    merged["reruns"] = [*old.get("reruns", []), {
        "policies": rerun, "time_utc": new.get("environment", {}).get("time_utc"),
        **record, **({"dropped": sorted(drop)} if drop else {})}]
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("results", type=Path, help="the committed results file (rewritten)")
    ap.add_argument("rerun", type=Path, help="the re-run's results file")
    ap.add_argument("--command", required=True, help="the command that wrote the re-run")
    ap.add_argument("--why", required=True, help="what changed in the re-run policies")
    ap.add_argument("--drop", nargs="*", default=[], help="policies whose rows are removed")
    args = ap.parse_args()
    commit = subprocess.run(["git", "log", "-1", "--format=%h"], capture_output=True,
                            text=True).stdout.strip()
    try:
        merged = merge(json.loads(args.results.read_text()), json.loads(args.rerun.read_text()),
                       {"git_commit": commit, "command": args.command, "why": args.why},
                       tuple(args.drop))
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"merge_rerun: {e}")
    args.results.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"{args.results}: {', '.join(merged['reruns'][-1]['policies'])} merged, "
          f"{len(merged['rows'])} rows")


if __name__ == "__main__":
    main()
