"""Every benchmark's ``--help`` opens with a whole sentence: its docstring's first paragraph."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from benchmark import description

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmark"
COMMANDS = sorted(p for p in BENCHMARK.rglob("*.py") if "ArgumentParser(" in p.read_text())


def test_description_joins_the_first_paragraph():
    doc = "A benchmark that wraps\nits first sentence.\n\nDetails that stay out."
    assert description(doc) == "A benchmark that wraps its first sentence."
    assert description(None) == ""


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: str(p.relative_to(BENCHMARK)))
def test_help_description_is_a_whole_sentence(path: Path):
    source = path.read_text()
    assert "ArgumentParser(description=description(" in source, "builds its own description"
    doc = ast.get_docstring(ast.parse(source), clean=False)
    assert description(doc).endswith((".", "?")), description(doc)
