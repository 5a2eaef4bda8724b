"""The environment registry (``sglang_pic.environment``): the only reader of the environment in
the package, every variable declared and documented."""

from __future__ import annotations

import ast

import pytest
from conftest import REPO
from sglang_pic import environment

PACKAGE = REPO / "python" / "sglang_pic"


def _reads(tree: ast.AST) -> list[int]:
    """Lines reading ``os.environ`` by name: ``.get``, ``.pop``, ``.setdefault``, a subscript
    that loads, ``os.getenv``. Passing the whole mapping on (a child's environment) is not."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("get", "pop", "setdefault") \
                and ast.unparse(node.value) == "os.environ":
            out.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and ast.unparse(node.value) == "os.environ":
            out.append(node.lineno)
        elif isinstance(node, ast.Attribute) and ast.unparse(node) == "os.getenv":
            out.append(node.lineno)
    return out


def test_only_the_registry_reads_the_environment():
    found = {f"{p.relative_to(REPO)}:{line}" for p in PACKAGE.rglob("*.py")
             if p.name != "environment.py" or p.parent != PACKAGE
             for line in _reads(ast.parse(p.read_text()))}
    assert not found, f"read through sglang_pic.environment instead: {sorted(found)}"


def test_the_check_sees_each_kind_of_read():
    src = "import os\na = os.environ.get('X')\nb = os.environ['Y']\nc = os.getenv('Z')\n" \
          "d = os.environ.pop('W', None)\nos.environ['V'] = '1'\ne = dict(os.environ)\n"
    assert sorted(_reads(ast.parse(src))) == [2, 3, 4, 5]


def test_an_undeclared_variable_is_refused(monkeypatch):
    monkeypatch.setenv("SGLANG_PIC_NOT_A_THING", "1")
    with pytest.raises(KeyError, match="not declared"):
        environment.read("SGLANG_PIC_NOT_A_THING")
    assert environment.read("OMP_NUM_THREADS", {"OMP_NUM_THREADS": "3"}) == "3"
    assert environment.is_on("SGLANG_USE_CPU_ENGINE", {"SGLANG_USE_CPU_ENGINE": "1"})


def test_the_flag_table_and_the_sparse_config_declare_their_variables():
    from sglang_pic.launcher.server_flags import FLAGS
    from sglang_pic.sparse.config import SparseDecodeConfig

    for flag in FLAGS.values():
        if flag.env:
            assert environment.read(flag.env, {}) is None  # declared: no KeyError
    assert environment.read(SparseDecodeConfig.env_name("offload"), {}) is None


def test_take_removes_a_hand_over(monkeypatch):
    monkeypatch.delenv("SGLANG_PIC_LAUNCHER_PID", raising=False)
    environment.hand_over("SGLANG_PIC_LAUNCHER_PID", "123")
    assert environment.take("SGLANG_PIC_LAUNCHER_PID") == "123"
    assert environment.read("SGLANG_PIC_LAUNCHER_PID") is None


def test_every_variable_is_documented():
    doc = (REPO / "docs" / "configuration.md").read_text()
    missing = [name for name in environment.VARIABLES if f"`{name}`" not in doc]
    assert not missing, f"docs/configuration.md does not name {missing}"


def test_the_kernels_read_no_setting_of_ours():
    """Kernels take their tuning as arguments (the server passes its flags); the only variable
    they look at is Triton's own ``TRITON_INTERPRET``."""
    kernels = REPO / "sgl-kernel" / "python" / "sglang_pic_kernel"
    found = [f"{p.relative_to(REPO)}" for p in kernels.rglob("*.py")
             if "SGLANG_PIC_" in p.read_text()]
    assert not found, found
