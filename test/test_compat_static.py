"""The seam table read against an SGLang release's source (``sglang_pic.compat.static``): it
agrees with importing the installed SGLang, and it finds what a changed release lacks."""

from __future__ import annotations

import inspect
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import sglang
from sglang_pic.compat import SEAMS
from sglang_pic.compat.static import SourceTree, StaticChecker, report

REPO = Path(__file__).resolve().parent.parent
SITE = Path(sglang.__file__).resolve().parent.parent
RADIX = "sglang/srt/mem_cache/radix_cache.py"


@pytest.fixture(scope="module")
def installed() -> StaticChecker:
    return StaticChecker(SourceTree(SITE))


def test_the_installed_release_is_read_with_its_version(installed):
    assert installed.tree.version == sglang.__version__


@pytest.mark.parametrize("seam", [s for s in SEAMS if s.target.startswith("sglang.")],
                         ids=lambda s: f"{s.kind}:{s.label}")
def test_reading_the_source_agrees_with_importing_it(installed, seam):
    """Reference: Python's own import. Each SGLang symbol the table needs is found in the
    installed release's source exactly when importing it finds it (a dataclass's generated
    ``__repr__`` included)."""
    symbol = StaticChecker.symbol(seam)
    assert (installed.problem(seam) is None) == _imported(symbol), \
        (symbol, installed.problem(seam))


def _imported(symbol: str) -> bool:
    """Whether importing finds ``symbol``; an instance attribute (set in a method, absent on
    the class) counts when the class's source assigns it on ``self``."""
    try:
        pkgutil.resolve_name(symbol)
        return True
    except (ImportError, AttributeError):
        owner, _, name = symbol.rpartition(".")
        try:
            obj = pkgutil.resolve_name(owner)
        except (ImportError, AttributeError):
            return False
        if isinstance(obj, types.ModuleType):  # bound only under a condition (CUDA) here
            return re.search(rf"^\s+{name},?$|import {name}$", inspect.getsource(obj),
                             re.M) is not None
        return isinstance(obj, type) and any(
            f"self.{name} =" in inspect.getsource(c) for c in obj.__mro__
            if c.__module__.startswith("sglang."))


def _tree_with(tmp_path: Path, edit) -> Path:
    """A release like the installed one but for ``radix_cache.py``, edited by ``edit``, as a
    wheel (the form a new release is checked in)."""
    text = edit((SITE / RADIX).read_text())
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path in (SITE / "sglang").rglob("*.py"):
            rel = path.relative_to(SITE).as_posix()
            z.writestr(rel, text if rel == RADIX else path.read_text(errors="replace"))
        z.writestr("sglang-9.9.9.dist-info/METADATA", "Name: sglang\nVersion: 9.9.9\n")
    return wheel


def test_a_removed_method_is_named_with_each_feature_that_needs_it(tmp_path):
    wheel = _tree_with(tmp_path, lambda t: t.replace("def _split_node(", "def _split(", 1))
    tree = SourceTree(wheel)
    assert tree.version == "9.9.9"
    rows = report(tree, SEAMS)
    assert [(s.feature, s.kind, s.target, why) for s, why in rows] == [
        ("eviction", "AROUND", "sglang.srt.mem_cache.radix_cache.RadixCache._split_node",
         "sglang.srt.mem_cache.radix_cache.RadixCache has no _split_node")]


def test_changed_parameters_are_reported_against_the_release_the_table_was_written_for(tmp_path):
    wheel = _tree_with(tmp_path, lambda t: t.replace(
        "def evict(self, params", "def evict(self, budget, params", 1))
    rows = report(SourceTree(wheel), SEAMS, against=SourceTree(SITE))
    changed = [(s.target, why) for s, why in rows if "parameters changed" in why]
    assert [t for t, _ in changed] == ["sglang.srt.mem_cache.radix_cache.RadixCache.evict"]
    assert "(self, budget, params)" in changed[0][1]
    assert report(SourceTree(SITE), SEAMS, against=SourceTree(SITE)) == []


def test_the_command_line_reports_and_refuses_what_is_not_a_release(tmp_path):
    wheel = _tree_with(tmp_path, lambda t: t.replace("class RadixCache(", "class Radix(", 1))
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    run = subprocess.run([sys.executable, "-m", "sglang_pic.compat", "--static", str(wheel)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 1
    assert "SGLang 9.9.9" in run.stdout and "radix_cache has no RadixCache" in run.stdout
    assert "spans:" in run.stdout and "eviction:" in run.stdout
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing.whl"):
        run = subprocess.run([sys.executable, "-m", "sglang_pic.compat", "--static", str(bad)],
                             capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 2 and "neither a wheel nor a folder" in run.stderr, run.stderr
    shutil.rmtree(tmp_path / "empty")
