"""The seam table read against an SGLang release's source (``sglang_pic.compat.static``): it
agrees with importing the installed SGLang, and it finds what a changed release lacks."""

from __future__ import annotations

import inspect
import os
import pkgutil
import re
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import sglang
from conftest import REPO
from sglang_pic.compat import rows_for
from sglang_pic.compat.static import SourceTree, StaticChecker, report

SITE = Path(sglang.__file__).resolve().parent.parent
RADIX = "sglang/srt/mem_cache/radix_cache.py"
CHANGED = f"{sglang.__version__}.post9"  # a later build of the installed release


@pytest.fixture(scope="module")
def installed() -> StaticChecker:
    return StaticChecker(SourceTree(SITE))


def test_the_installed_release_is_read_with_its_version(installed):
    assert installed.tree.version == sglang.__version__


@pytest.mark.parametrize("seam", [s for s in rows_for(sglang.__version__)
                                  if s.target.startswith("sglang.")],
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
        assigned = re.compile(rf"self\.{name}\s*(?::[^=\n]*)?=(?!=)")
        return isinstance(obj, type) and any(
            assigned.search(inspect.getsource(c)) for c in obj.__mro__
            if c.__module__.startswith("sglang."))


@pytest.fixture(scope="module")
def changed(tmp_path_factory) -> Path:
    """A release like the installed one as a wheel (the form a new release is checked in), but
    for ``radix_cache.py``: ``RadixCache._split_node`` renamed, ``RadixCache.evict`` given a
    parameter in front."""
    text = (SITE / RADIX).read_text()
    text = text.replace("def _split_node(", "def _split(", 1)
    text = text.replace("def evict(self, params", "def evict(self, budget, params", 1)
    wheel = tmp_path_factory.mktemp("release") / f"sglang-{CHANGED}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path in (SITE / "sglang").rglob("*.py"):
            rel = path.relative_to(SITE).as_posix()
            z.writestr(rel, text if rel == RADIX else path.read_text(errors="replace"))
        z.writestr(f"sglang-{CHANGED}.dist-info/METADATA", f"Name: sglang\nVersion: {CHANGED}\n")
    return wheel


def test_a_removed_method_is_named_with_the_feature_that_needs_it(changed):
    tree = SourceTree(changed)
    assert tree.version == CHANGED
    assert [(s.feature, s.kind, s.target, why) for s, why in report(tree, rows_for(CHANGED))] == [
        ("eviction", "AROUND", "sglang.srt.mem_cache.radix_cache.RadixCache._split_node",
         "sglang.srt.mem_cache.radix_cache.RadixCache has no _split_node")]


def test_changed_parameters_are_reported_against_the_release_the_table_was_written_for(
        changed, installed):
    rows = report(SourceTree(changed), rows_for(CHANGED), against=installed.tree)
    changed_rows = [(s.target, why) for s, why in rows if "parameters changed" in why]
    assert [t for t, _ in changed_rows] == ["sglang.srt.mem_cache.radix_cache.RadixCache.evict"]
    assert "(self, budget, params)" in changed_rows[0][1]
    assert report(installed.tree, rows_for(sglang.__version__), against=installed.tree) == []


def test_the_command_line_reports_and_refuses_what_is_not_a_release(changed, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    run = subprocess.run([sys.executable, "-m", "sglang_pic.compat", "--static", str(changed)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 1
    assert f"SGLang {CHANGED}" in run.stdout and "RadixCache has no _split_node" in run.stdout
    assert "eviction:" in run.stdout
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing.whl"):
        run = subprocess.run([sys.executable, "-m", "sglang_pic.compat", "--static", str(bad)],
                             capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 2 and "neither a wheel nor a folder" in run.stderr, run.stderr


SMALL = {  # a release of a few modules with the shapes the checker must read
    "sglang/__init__.py": "",
    # sglang/srt/ has no __init__.py: a namespace package
    "sglang/srt/a.py": """
from typing import TYPE_CHECKING, Generic, TypeVar
from .b import Base
from .star import *
T = TypeVar("T")
if TYPE_CHECKING:
    from .b import OnlyTyped
try:
    from .b import fast
except ImportError:
    fast = None
with open(__file__):
    WITH_BOUND = 1
class K(Base):
    class Inner:
        def m(self, x, /, y=1, *, z): ...
    def __init__(self):
        self.attr: int = 1
        self.compared == 2
    def f(self): ...
class G(Generic[T]):
    def g(self, a, *args, b=None, **kw): ...
class H(G[int]): ...
""",
    "sglang/srt/b.py": "class Base:\n    def inherited(self): ...\ndef fast(): ...\n"
                       "class OnlyTyped: ...\n",
    "sglang/srt/star.py": "def starred(): ...\n",
    "sglang/srt/broken.py": "def (:\n",
    "sglang/_version.py": "__version__ = (\n",
}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> StaticChecker:
    root = tmp_path_factory.mktemp("small")
    for rel, text in SMALL.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return StaticChecker(SourceTree(root))


@pytest.mark.parametrize("symbol", [
    "sglang.srt.a.K.f", "sglang.srt.a.K.inherited", "sglang.srt.a.K.attr",
    "sglang.srt.a.K.Inner.m", "sglang.srt.a.H.g", "sglang.srt.a.starred", "sglang.srt.a.fast",
    "sglang.srt.a.WITH_BOUND", "sglang.srt.a.K.__repr__", "sglang.srt.b"])
def test_a_release_s_names_are_found_however_they_are_bound(small, symbol):
    assert small.find(symbol)[1] is None


@pytest.mark.parametrize(("symbol", "why"), [
    ("sglang.srt.a.OnlyTyped", "sglang.srt.a has no OnlyTyped"),  # imported for type checks
    ("sglang.srt.a.K.nope", "sglang.srt.a.K has no nope"),
    ("sglang.srt.a.K.compared", "sglang.srt.a.K has no compared"),  # compared, not assigned
    ("sglang.srt.a.K.__call__", "sglang.srt.a.K has no __call__"),
    ("sglang.srt.c.X", "no module sglang.srt.c"),
])
def test_a_missing_name_is_named(small, symbol, why):
    assert small.find(symbol) == (None, why)


def test_an_unparsable_module_or_version_file_is_said_not_guessed(small):
    node, why = small.find("sglang.srt.broken.anything")
    assert node is None and why.startswith("cannot parse sglang.srt.broken: SyntaxError")
    assert small.tree.version is None  # no metadata, and its _version.py does not parse


def test_parameters_keep_their_kinds_and_defaults(small):
    from sglang_pic.compat import Seam

    def params(target: str) -> str | None:
        return small.signature(Seam(target, "x:y", "AROUND", "demo"))

    assert params("sglang.srt.a.K.Inner.m") == "self, x, /, y=1, *, z"
    assert params("sglang.srt.a.H.g") == "self, a, *args, b=None, **kw"  # through G[int]
    assert params("sglang.srt.a.K.f.deeper") is None  # below a method: not followed
