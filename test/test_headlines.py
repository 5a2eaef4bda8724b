"""The README quotes only rows of benchmark/results/headlines.json, and that file is current."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEADLINES = REPO / "benchmark" / "results" / "headlines.json"


def test_headlines_json_matches_the_raw_results():
    out = subprocess.run([sys.executable, "benchmark/headlines.py", "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_readme_names_only_existing_claims():
    claims = {r["claim"] for r in json.loads(HEADLINES.read_text())["rows"]}
    cited = re.findall(r"\[`([a-z_]+\.[a-z0-9_.*]+)`", (REPO / "README.md").read_text())
    assert cited, "the README cites no headline row"
    for name in cited:  # "a.*" cites every row a.<something>
        pattern = re.compile(re.escape(name).replace(r"\*", ".+") + "$")
        assert any(pattern.match(c) for c in claims), f"README cites unknown row {name}"
