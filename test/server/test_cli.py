"""The `sglang-pic` command: versions, argv building, plugin entry point, help and typos."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import entry_points, version

import pytest
import requests
from sglang_pic.launcher.launch_server import build_argv


def test_version_prints_three_versions():
    out = subprocess.run([sys.executable, "-m", "sglang_pic", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "sglang-pic 0.1.0" in out.stdout
    assert f"sglang {version('sglang')}" in out.stdout  # the installed release
    assert "torch " in out.stdout


def test_plugin_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("sglang_pic") == "sglang_pic.plugin:register"


def test_build_argv_uses_default_model_and_keeps_user_flags(model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    argv = build_argv(["--port", "1234", "--attention-backend", "triton"])
    assert argv[:2] == ["--model-path", str(model_dir)]
    assert argv[argv.index("--port") + 1] == "1234"
    assert argv.count("--attention-backend") == 1
    assert "--max-total-tokens" in argv


def test_build_argv_respects_given_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    argv = build_argv(["--model-path", str(tmp_path)])
    assert argv.count("--model-path") == 1
    # no config.json to size the KV pool from: a fixed, small budget instead of SGLang's RAM sizing
    assert argv[argv.index("--max-total-tokens") + 1] == "16384"


def test_ptstore_flag_expands_to_the_hicache_storage_flags(model_dir, monkeypatch):
    import json

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    argv = build_argv(["--ptstore", "tcp://a:1, tcp://b:2",
                       "--hicache-size", "2", "--hicache-mem-layout", "layer_first"])
    assert "--ptstore" not in argv
    assert "--enable-hierarchical-cache" in argv
    assert argv[argv.index("--hicache-storage-backend") + 1] == "dynamic"
    config = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])
    assert config["servers"] == ["tcp://a:1", "tcp://b:2"] and "token" not in config
    assert config["interface_v1"] == 1
    assert config["module_path"] == "sglang_pic.store.hicache_backend"
    assert argv.count("--hicache-mem-layout") == 1  # the user's choice wins
    assert argv[argv.index("--hicache-size") + 1] == "2"
    merged = build_argv(["--ptstore", "tcp://a:1", "--hicache-storage-backend-extra-config",
                         '{"timeout_ms": 5000, "local": "tcp://a:1"}'])
    assert merged.count("--hicache-storage-backend-extra-config") == 1
    config = json.loads(merged[merged.index("--hicache-storage-backend-extra-config") + 1])
    assert config["timeout_ms"] == 5000 and config["local"] == "tcp://a:1"
    assert config["servers"] == ["tcp://a:1"] and config["interface_v1"] == 1
    with pytest.raises(SystemExit, match="not JSON"):
        build_argv(["--ptstore", "tcp://a:1", "--hicache-storage-backend-extra-config", "{x"])
    with pytest.raises(SystemExit, match="needs store endpoints"):
        build_argv(["--ptstore", " , "])
    with pytest.raises(SystemExit, match="drop --hicache-storage-backend file"):
        build_argv(["--ptstore", "tcp://a:1", "--hicache-storage-backend", "file"])


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    import time

    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "sglang_pic", *args], capture_output=True,
                         text=True, timeout=300)
    return out, time.monotonic() - t0


def test_top_level_help_describes_each_command_in_one_line():
    from sglang_pic.cli import COMMANDS

    out, _ = _cli("--help")
    assert out.returncode == 0 and out.stderr == ""
    for name in COMMANDS:
        assert re.search(rf"^  {name} +\S.*$", out.stdout, re.M), name
    out, _ = _cli("serv")
    assert out.returncode == 2
    assert out.stderr.strip() == "sglang-pic: error: unknown command serv (did you mean serve?)"


@pytest.mark.parametrize("typo,meant", [("--spn-schedule", "--span-schedule"),
                                        ("--max-total-tokns", "--max-total-tokens"),
                                        ("--sparse-top-k", "--sparse-topk"),
                                        # an abbreviation SGLang's parser would take: the value
                                        # checks look flags up by their whole name
                                        ("--max-total-token", "--max-total-tokens")])
def test_a_mistyped_flag_is_one_line_naming_the_nearest(typo, meant):
    """Issue 26 item 9: a typo took 16 s and printed 432 lines of usage. SGLang's flag names are
    cached (built once, quietly, if missing) so the launcher answers without importing SGLang."""
    from sglang_pic.launcher import sglang_flags

    assert sglang_flags.names()  # the cache, built here if this is the first launch
    out, seconds = _cli("serve", "--port", "30001", typo, "4", "--enable-span-cache")
    print(f"typo answered in {seconds:.2f} s")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        f"sglang-pic serve: error: unrecognized argument {typo} (did you mean {meant}?)"]
    assert seconds < 6, seconds


def test_help_all_lists_our_flags_first_then_sglangs():
    """Every flag is discoverable: `--help-all` prints SGLang's parser with our groups first and
    --model-path optional (the launcher serves the default model without it)."""
    out, seconds = _cli("serve", "--help-all")
    print(f"sglang-pic serve --help-all: {seconds:.1f} s")
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "usage: sglang-pic serve [sglang-pic flags] [SGLang server flags]" in text
    assert text.index("sglang-pic: span caching:") < text.index("\n  --tokenizer-path ")
    assert "--model-path MODEL_PATH, --model MODEL_PATH" in text
    assert "(required)" not in text and "sglang serve" not in text.replace("sglang-pic serve", "")


def test_build_argv_turns_the_cache_report_on(model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    argv = build_argv(["--model-path", str(model_dir)])
    assert argv.count("--enable-cache-report") == 1
    argv = build_argv(["--model-path", str(model_dir), "--enable-cache-report"])
    assert argv.count("--enable-cache-report") == 1


def test_plain_sglang_launcher_serves_on_cpu(model_dir, tmp_path):
    """`python -m sglang.launch_server --model-path M` (not our CLI) on a machine without an
    accelerator: SGLang's plugin loader runs our plugin, which selects SGLang's CPU engine and
    adds its flags, so SGLang's own launcher serves (it stopped with "No accelerator ... or
    platform plugin")."""
    import os

    from conftest import start_server, stop_server

    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    server = start_server(["--model-path", str(model_dir)], tmp_path / "plain.log",
                          launcher=("-m", "sglang.launch_server"), env=env)
    try:
        r = server.post("/generate", json={
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["text"]
        assert "sglang-pic 0.1.0 plugin active" in (tmp_path / "plain.log").read_text()
        # the key handed over in $SGLANG_PIC_API_KEY reached SGLang's own launcher too
        anonymous = requests.post(server.url + "/generate", json={"text": "Hi"}, timeout=30)
        assert anonymous.status_code == 401
    finally:
        stop_server(server)  # SIGTERM to its process group; the session's end waits for it
