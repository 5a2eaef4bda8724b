"""The plugin reaches SGLang's processes when sglang-pic runs from a source tree, and a server
process whose plugin did not load refuses to start (it would serve plain SGLang)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from importlib.metadata import distributions

from conftest import REPO
from sglang_pic.launcher import plugin_site


def test_an_installed_entry_point_leaves_the_environment_alone(tmp_path):
    assert plugin_site.declared()  # the test environment installs sglang-pic (editable)
    env = {"PYTHONPATH": "/elsewhere"}
    assert plugin_site.plugin_env(env, tmp_path / "site") == env
    assert not (tmp_path / "site").exists()


def test_a_source_tree_gets_the_entry_point_first_on_the_path(tmp_path, monkeypatch):
    monkeypatch.setattr(plugin_site, "declared", lambda: False)
    site = tmp_path / "site"
    env = plugin_site.plugin_env({"PYTHONPATH": os.pathsep.join(["/a", str(REPO / "python")])},
                                 site)
    parts = env["PYTHONPATH"].split(os.pathsep)
    kernels = plugin_site.kernel_root()  # sgl-kernel/python in this checkout (editable install)
    assert kernels is not None and (kernels / "sglang_pic_kernel").is_dir()
    # ours first; the given path kept as it was after them
    assert parts == [str(site), str(REPO / "python"), str(kernels), "/a", str(REPO / "python")]
    dists = list(distributions(path=[str(site)]))
    assert [d.metadata["Name"] for d in dists] == ["sglang-pic"]
    eps = {e.name: e.value for e in dists[0].entry_points if e.group == plugin_site.GROUP}
    assert eps == {"sglang_pic": "sglang_pic.plugin:register"}


def test_a_server_process_without_the_plugin_refuses_to_start():
    """SGLANG_PLUGINS leaving ours out: SGLang's load_plugins skips it, and the server process
    stops with status 2 and the reason before any model is loaded."""
    env = dict(os.environ, SGLANG_PLUGINS="not_ours")
    proc = subprocess.run([sys.executable, "-m", "sglang_pic.launcher.server_process", "--model-path",
                           tempfile.gettempdir()],  # a folder, no model: nothing gets that far
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "plugin was not loaded: SGLANG_PLUGINS='not_ours' leaves out 'sglang_pic'" \
        in proc.stderr
