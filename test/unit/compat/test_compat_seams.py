"""The seam table (``sglang_pic.compat``): complete, current, the only place a target is written,
and enforced by the plugin."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import sglang
from conftest import REPO
from plugin_process import refused, run_python
from sglang_pic import compat, plugin
from sglang_pic.compat import HOOK_KINDS, SEAMS, Seam, resolve
from sglang_pic.compat.__main__ import section, updated
from sglang_pic.compat.conditions import CONDITIONS

PACKAGE = REPO / "python" / "sglang_pic"
DOC = REPO / "docs" / "architecture.md"
INSTALLED = compat.rows_for(sglang.__version__)
"""The rows for the installed SGLang (the table holds rows for other supported releases)."""
EVERY_CONDITION = {  # every condition of the table on, as variables the features read
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_PIC_SPARSE_OFFLOAD": "1",
    "SGLANG_PIC_SAE_STATS": "/tmp/sglang-pic-test-sae-stats.json",
    "SGLANG_PIC_STORE_TRACE": "1",
    "SGLANG_PIC_STORAGE_IDLE_YIELD_US": "100",
}


def test_the_doc_holds_the_generated_table():
    """docs/architecture.md's seam section is the table's: regenerate it with
    ``python -m sglang_pic.compat --update docs/architecture.md``."""
    text = DOC.read_text()
    assert section(text) == compat.markdown(), \
        "stale: run .venv/bin/python -m sglang_pic.compat --update docs/architecture.md"
    assert updated(text) == text


def test_rows_are_well_formed():
    """Every row names a plugin feature and a known condition; a hook row says how to find its
    hook; a registry row names its entry; no row is there twice."""
    for seam in SEAMS:
        assert seam.feature in plugin.FEATURES, seam
        assert seam.condition is None or seam.condition in CONDITIONS, seam
        assert (seam.key is not None) == (seam.kind == "registry"), seam
    keys = [(s.target, s.key, s.hook, s.kind) for s in SEAMS]
    assert len(keys) == len(set(keys))
    with pytest.raises(ValueError, match="unknown kind"):
        Seam("sglang.srt.x.y", "sglang_pic.x:y", "PATCH", "demo")
    with pytest.raises(ValueError, match="module:name"):
        Seam("sglang.srt.x.y", "sglang_pic.x.y", "AROUND", "demo")


def test_every_hook_resolves_to_a_callable():
    for seam in SEAMS:
        if seam.hook is not None:
            assert callable(resolve(seam.hook)), seam


def test_every_target_resolves():
    """Every target exists in the installed SGLang (and uvicorn, torch, Triton); for a name we
    replace or hang at run time, its owner does."""
    for seam in INSTALLED:
        if seam.kind in ("instance-patch", "attribute"):
            resolve(seam.owner)
        else:
            resolve(seam.target)
        if seam.kind in HOOK_KINDS:
            assert callable(resolve(seam.target)), seam


def test_overrides_calls_and_attributes_check_out():
    """What can be checked without a feature's set-up (registry entries and module attributes
    need it: the next test): our subclasses still override a method their SGLang base has, the
    APIs we call exist, and SGLang's classes define none of the attributes we hang on them."""
    for seam in INSTALLED:
        if seam.kind in ("override", "call") or (seam.kind == "attribute"
                                                 and seam.target != "sglang.span"):
            assert compat.check(seam) is None, seam


def test_every_row_applies_with_every_condition_on():
    """With every condition on (CPU engine, sparse offload, span graphs, SAE statistics, store
    trace, idle yield), the plugin registers every row: each hook target patched, each other row
    checked, and the count of targets it announces is the table's."""
    targets = {s.target for s in INSTALLED if s.kind in HOOK_KINDS}
    out = run_python("from sglang.srt.plugins import load_plugins; load_plugins(); "
               "from sglang.srt.plugins.hook_registry import HookRegistry as H; "
               "import sglang; from sglang_pic.compat import rows_for, HOOK_KINDS; "
               "print(sorted(s.target for s in rows_for(sglang.__version__) "
               "if s.kind in HOOK_KINDS and s.target not in H._patched))", EVERY_CONDITION)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert f"features: {', '.join(plugin.FEATURES)}; {len(targets)} hooks verified" in out.stderr


def _feature_sources() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "compat" not in p.relative_to(PACKAGE).parts]


def _strings(tree: ast.AST) -> list[str]:
    """Every string literal of a module, the literal parts of f-strings too."""
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def test_no_target_string_outside_the_table():
    """Outside ``compat/`` no module calls ``HookRegistry.register`` but the plugin, which takes
    its targets from the table, and no string names a hook target or the class or module it is on."""
    names = set()
    for seam in SEAMS:
        if seam.kind in HOOK_KINDS:
            names.update({seam.target, seam.owner, seam.owner + "."})
    for path in _feature_sources():
        tree = ast.parse(path.read_text())
        where = path.relative_to(REPO)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "register" \
                    and getattr(node.func.value, "id", None) == "HookRegistry":
                assert path.name == "plugin.py", f"{where}:{node.lineno} registers a hook"
                first = node.args[0]
                assert not isinstance(first, (ast.Constant, ast.JoinedStr)), \
                    f"{where}:{node.lineno} writes its target"
        found = sorted(names.intersection(_strings(tree)))
        assert not found, f"{where} names {found}: a target belongs in sglang_pic.compat"


def test_a_base_method_gone_stops_the_process_naming_feature_and_symbol():
    """An override whose SGLang base method is gone (our method would never be called) ends the
    process, naming the method and each feature whose subclass overrides it."""
    err = refused(
        "from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend as F\n"
        "del F._prepare_cuda_graph_metadata")
    assert ("sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend."
            "_prepare_cuda_graph_metadata (needed by sparse-decode)") in err


def test_a_registry_entry_that_is_not_ours_stops_the_process():
    err = refused(
        "import dataclasses, sglang_pic.compat as c\n"
        "c.SEAMS = tuple(dataclasses.replace(s, key='no_such_backend') if s.kind == 'registry'\n"
        "    and s.key == 'pic_triton' and s.hook else s for s in c.SEAMS)")
    assert "ATTENTION_BACKENDS['no_such_backend'] (needed by position-free-kv)" in err


def test_a_row_whose_hook_cannot_be_imported_stops_the_process():
    err = refused(
        "import dataclasses, sglang_pic.compat as c\n"
        "c.SEAMS = tuple(dataclasses.replace(s, hook='sglang_pic.no_such_module:hook')\n"
        "    if s.feature == 'secret-redaction' and s.kind == 'AROUND' else s for s in c.SEAMS)")
    assert "feature secret-redaction failed to register sglang.srt.server_args.ServerArgs" \
           ".__repr__" in err


def test_every_row_is_for_supported_releases_only():
    from sglang_pic.compat.versions import SUPPORTED_SGLANG

    for seam in SEAMS:
        assert seam.releases is None or set(seam.releases) <= set(SUPPORTED_SGLANG), seam.label


def test_a_row_is_for_its_releases_and_their_builds():
    """``releases`` compares release numbers: a local build or post-release of a release is
    that release; a row without ``releases`` is for every one."""
    row = Seam("sglang.srt.x.y", None, "call", "spans", releases=("0.5.23",))
    assert row.applies_to("0.5.23") and row.applies_to("0.5.23+cu130")
    assert row.applies_to("0.5.23.post1") and not row.applies_to("0.5.17")
    assert row.applies_to(None)  # release unknown: every row
    assert Seam("sglang.srt.x.y", None, "call", "spans").applies_to("0.5.17")
    assert row not in compat.rows_for("0.5.17") and row not in compat.SEAMS


def test_a_missing_symbol_refuses_start_only_on_the_release_its_row_is_for():
    """A row for another release is neither registered nor checked: a symbol that release has
    and the installed one lacks does not stop the plugin. The same row for the installed
    release stops it, naming the feature and the symbol."""
    import sglang

    row = ("c.SEAMS = c.SEAMS + (Seam('sglang.srt.managers.scheduler.Scheduler.no_such_method',"
           " None, 'call', 'spans', releases=({release!r},)),)\n")
    setup = "import sglang_pic.compat as c\nfrom sglang_pic.compat.seam import Seam\n"
    other = run_python(setup + row.format(release="0.0.1") + "from sglang.srt.plugins import "
                       "load_plugins; load_plugins(); print('SERVED')")
    assert "SERVED" in other.stdout, other.stderr[-2000:]
    err = refused(setup + row.format(release=sglang.__version__))
    assert "sglang.srt.managers.scheduler.Scheduler.no_such_method (needed by spans)" in err
