"""Another SGLang release than those supported stops the plugin and the commands that run
SGLang with one line naming the supported releases (``sglang_pic.compat.versions``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from plugin_process import refused
from sglang_pic.compat.versions import SUPPORTED_SGLANG, installed_sglang


def _site_with_sglang(tmp_path: Path, version: str) -> Path:
    """A folder that, first on the path, makes the package metadata say SGLang ``version``."""
    site = tmp_path / "site"
    info = site / f"sglang-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return site


def test_the_installed_release_is_supported():
    assert installed_sglang() in SUPPORTED_SGLANG


def test_the_plugin_refuses_another_release_in_one_line(tmp_path):
    site = _site_with_sglang(tmp_path, "0.5.99")
    err = refused(f"import sys; sys.path.insert(0, {str(site)!r})")
    line = next(ln for ln in err.splitlines() if "refusing to start" in ln)
    assert "supports SGLang " + ", ".join(SUPPORTED_SGLANG) in line
    assert "found SGLang 0.5.99" in line and "pip install 'sglang==" in line


def test_the_serve_command_refuses_another_release_in_one_line(tmp_path):
    site = _site_with_sglang(tmp_path, "0.6.0")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    run = subprocess.run([sys.executable, "-m", "sglang_pic.cli", "serve", "--help"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0, run.stderr
    assert "found SGLang 0.6.0" in run.stderr and "supports SGLang" in run.stderr


def test_the_package_requires_exactly_the_supported_releases():
    """pip's view (the pyproject's requirement) and the plugin's (``SUPPORTED_SGLANG``) agree
    on every SGLang release from the oldest supported to one past the newest, builds and
    post-releases of each included."""
    import tomllib
    from conftest import REPO
    from packaging.requirements import Requirement
    from packaging.version import Version
    from sglang_pic.compat.seam import release_numbers

    project = tomllib.loads((REPO / "python" / "pyproject.toml").read_text())["project"]
    spec = next(r.specifier for r in map(Requirement, project["dependencies"])
                if r.name == "sglang")
    supported = {release_numbers(v) for v in SUPPORTED_SGLANG}
    first, last = min(supported), max(supported)
    for patch in range(first[2] - 1, last[2] + 2):
        for version in (f"0.5.{patch}", f"0.5.{patch}.post1"):
            wanted = release_numbers(version) in supported
            assert spec.contains(Version(version)) == wanted, version
