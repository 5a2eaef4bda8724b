"""Our server flags (issue 23 item 2, issue 26 items 4, 8, 10): one table, validated before anything
loads, refused combinations in one line, the hand-off to SGLang's processes, SGLang's own launcher,
the cache report, and a clean stop on SIGTERM.

One server for the module (``cfg_server``): the cache-report test uses it, and the SIGTERM test,
last, stops it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from conftest import REPO, start_server, stop_server, use_generated_key
from sglang_pic.compat.versions import streaming_sessions_need_unified_tree
from sglang_pic.cpu.support import has_cuda
from sglang_pic.launcher import serve_conflicts, server_flags
from sglang_pic.launcher.server_flags import FLAGS, UsageError

SERVE = [sys.executable, "-m", "sglang_pic", "serve"]


def _serve(args: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=120,
                         env=None if env is None else {**os.environ, **env})
    return out, time.monotonic() - t0


# ---- the table -----------------------------------------------------------------------------------


def test_every_flag_round_trips_through_its_variable():
    """What the launcher writes into a variable, the readers in SGLang's processes parse back to
    the same value; a default written out reads back as the default."""
    for name, flag in FLAGS.items():
        if flag.env is None:
            continue
        value = flag.default if flag.parse is not None else True
        if value is None:
            value = flag.parse({"--span-pad-token-id": "7", "--admin-path-root": "/tmp"}.get(
                name, "/tmp/x"))
        env = server_flags.handed_over({name: value}, environ={})
        assert server_flags.setting(name, env) == value, name
        assert server_flags.setting(name, {}) == (flag.default if flag.parse else False), name


def test_readers_refuse_a_bad_variable_naming_it_and_the_flag():
    with pytest.raises(ValueError, match=r"\$SGLANG_PIC_SAE_SAMPLE .*--sae-sample"):
        server_flags.setting("--sae-sample", {"SGLANG_PIC_SAE_SAMPLE": "many"})
    from sglang_pic.spans import config

    os.environ["SGLANG_PIC_SPAN_SCHEDULE"] = "bogus"
    try:
        with pytest.raises(ValueError, match="--span-schedule"):
            config.load()
    finally:
        del os.environ["SGLANG_PIC_SPAN_SCHEDULE"]


def test_docs_list_every_flag_and_variable():
    text = (REPO / "docs" / "configuration.md").read_text()
    for name, flag in FLAGS.items():
        if flag.hidden:
            continue
        assert f"`{name}" in text, name
        if flag.env:
            assert f"`{flag.env}`" in text, flag.env


# ---- --help ---------------------------------------------------------------------------------------


def test_serve_help_is_fast_quiet_and_lists_our_flags_with_defaults():
    out, seconds = _serve(["--help"])
    print(f"sglang-pic serve --help: {seconds:.2f} s")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert seconds < 6, seconds  # ~0.1 s idle; a margin for a busy 2-core machine
    text = out.stdout
    assert text.startswith("usage: sglang-pic serve [sglang-pic flags] [SGLang server flags]")
    assert "required" not in text
    for name, flag in FLAGS.items():
        if flag.hidden:
            assert name + " " not in text
            continue
        assert f"  {name}" in text, name
        if flag.env:
            assert f"[${flag.env}]" in text, flag.env
    flat = " ".join(text.split())
    assert "keys retrieved per KV head and step (default 100; >= 1)" in flat  # default, range
    assert "sglang-pic serve --help-all" in text and "docs/configuration.md" in text


# ---- values and combinations refused in one line, before anything loads ---------------------------


SPANS = pytest.mark.capability("spans")
"""A combination the span cache refuses: on a release without spans (``compat.gaps``) the
launcher refuses the span cache itself first."""


STREAMING = pytest.mark.skipif(not streaming_sessions_need_unified_tree(),
                               reason="this SGLang wraps any prefix tree for streaming sessions")


@pytest.mark.parametrize("args,message", [
    # issue 26 item 8: these took 25-78 s and ended in a traceback
    (["--enable-span-cache", "--span-schedule", "bogus"], "--span-schedule: supports 'isps'"),
    (["--enable-span-cache", "--span-recompute-tokens", "abc"],
     "--span-recompute-tokens: 'abc' is not an integer"),
    pytest.param(["--enable-span-cache", "--disable-radix-cache"],
                 "--enable-span-cache does not combine with --disable-radix-cache", marks=SPANS),
    # values
    (["--enable-span-cache", "--span-markers", "<a>"], "--span-markers: '<a>' is not two"),
    (["--sparse-decode", "pariskv", "--sparse-sink=-1"], "--sparse-sink: -1 is out of range"),
    (["--sparse-decode", "pariskv", "--sparse-max-context", "4096"],
     "--sparse-max-context (4096) must be over --sparse-threshold"),
    (["--radix-eviction-policy", "sae", "--sae-predictor", "maybe"], "--sae-predictor: 'maybe'"),
    (["--radix-eviction-policy", "sae", "--sae-stats", "/no/such/dir/s.json"],
     "--sae-stats: '/no/such/dir/s.json': no writable directory"),
    (["--radix-eviction-policy", "sae", "--sae-stats", "/dev/null"],
     "--sae-stats: '/dev/null': not a regular file"),
    (["--enable-position-free-kv", "--position-free-decode-config", "64,3,3"],
     "--position-free-decode-config"),
    # knobs without their feature
    (["--span-schedule", "barrier"], "--span-schedule: span caching flags need --enable-span-cache"),
    (["--sae-sample", "0"], "need --radix-eviction-policy sae"),
    (["--position-free-decode-config", "64,2,3"], "need --enable-position-free-kv"),
    (["--ptstore-trace"], "need --ptstore"),
    (["--hicache-storage-idle-yield-us", "50"], "need --ptstore or --hicache-storage-backend"),
    (["--ptstore", "tcp://a:1", "--hicache-storage-idle-yield-us", "9000"],
     "--hicache-storage-idle-yield-us: 9000 is out of range (0-5000)"),
    # combinations the features refused only after the weights loaded
    pytest.param(["--enable-span-cache", "--enable-hierarchical-cache"],
                 "--enable-hierarchical-cache", marks=SPANS),
    pytest.param(["--enable-span-cache", "--enable-streaming-session"],
                 "--enable-span-cache does not combine with --enable-streaming-session",
                 marks=STREAMING),
    (["--radix-eviction-policy", "sae", "--enable-session-radix-cache"],
     "--radix-eviction-policy sae does not combine with --enable-session-radix-cache"),
    pytest.param(["--enable-span-cache", "--radix-cache-backend", "radix"],
                 "drop --radix-cache-backend radix", marks=SPANS),
    pytest.param(["--enable-span-cache", "--disaggregation-mode", "decode"],
                 "--disaggregation-mode decode", marks=SPANS),
    pytest.param(["--enable-span-cache", "--ptstore", "tcp://a:1", "--tp-size", "2"],
                 "--tp-size 1", marks=SPANS),
    pytest.param(["--enable-span-cache", "--attention-backend", "fa3"],
                 "--enable-span-cache needs --attention-backend flashinfer or triton or "
                 "torch_native", marks=SPANS),
    (["--enable-position-free-kv", "--decode-attention-backend", "triton"],
     "does not combine with --decode-attention-backend triton"),
    (["--enable-position-free-kv", "--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3"),
    (["--enable-position-free-kv", "--speculative-algorithm", "EAGLE"], "--speculative-algorithm"),
    (["--enable-position-free-kv", "--dcp-size", "2"], "--dcp-size 2"),
    (["--enable-position-free-kv", "--enable-deterministic-inference"], "deterministic"),
    (["--sparse-decode", "pariskv", "--enable-dp-attention"], "--enable-dp-attention"),
    (["--sparse-decode", "pariskv", "--disaggregation-mode", "decode"], "--disaggregation-mode"),
    (["--sparse-decode", "pariskv", "--context-length", "8192"], "--context-length 8192"),
    (["--sparse-decode", "pariskv", "--sparse-offload", "--enable-mixed-chunk"],
     "--sparse-offload does not combine with --enable-mixed-chunk"),
    (["--sparse-decode", "pariskv", "--sparse-offload", "--page-size", "16"], "--page-size 16"),
    (["--ptstore", "tcp://a:1", "--ptstore-token", "x" * 40], "(ps)"),
    # SGLang's own values (issue 58: 4-24 s, accepted, or a traceback about repo ids)
    (["--port", "abc"], "--port: 'abc' is not an integer"),
    (["--max-total-tokens", "abc"], "--max-total-tokens: 'abc' is not an integer"),
    (["--radix-eviction-policy", "lruu"], "--radix-eviction-policy: 'lruu' is not a policy"),
    (["--mem-fraction-static", "2"], "--mem-fraction-static: 2 is not in (0, 1)"),
    (["--model-path", "/nonexistent"], "--model-path: '/nonexistent': no such file or folder"),
])
def test_refused_in_one_line_before_anything_loads(args, message, model_dir):
    # model_dir: the embedded model is prepared first (~10 s in a fresh cache, once), so the
    # time measured is the refusal's alone, whatever ran before this test
    out, seconds = _serve(args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert seconds < 10, seconds
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sglang-pic serve: error: "), out.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in out.stderr and out.stdout == ""


@SPANS
@pytest.mark.skipif(has_cuda(), reason="the CPU engine's refusal")
def test_a_gpu_backend_on_the_cpu_engine_is_refused_in_one_line():
    """It ended in a NameError in the scheduler and exit 137 after the model loaded."""
    out, seconds = _serve(["--enable-span-cache", "--attention-backend", "flashinfer"])
    assert out.returncode == 2 and seconds < 10, (out.stderr, seconds)
    assert out.stderr.strip().splitlines() == [
        "sglang-pic serve: error: --attention-backend flashinfer needs a GPU; this machine runs "
        "SGLang's CPU engine (torch_native, the default here, or triton)"]


def test_a_bad_variable_in_the_environment_is_refused_naming_its_flag():
    out, _ = _serve(["--enable-span-cache"], env={"SGLANG_PIC_SPAN_SCHEDULE": "bogus"})
    assert out.returncode == 2
    assert "$SGLANG_PIC_SPAN_SCHEDULE in the environment (the hand-off of --span-schedule" \
        in out.stderr


def _gap_asked_for(args: list[str]):
    """The installed release's gap (``compat.gaps``) for what ``args`` ask for, if any."""
    from sglang_pic.compat import gaps

    spans = "--enable-span-cache" in args or "pic_span" in args
    return (spans and gaps.gap("spans")) or None


def test_what_can_be_served_passes_the_checks():
    for args in (["--enable-span-cache", "--span-schedule", "barrier", "--page-size", "16"],
                 ["--enable-position-free-kv", "--attention-backend", "torch_native"],
                 ["--enable-span-cache", "--attention-backend", "flashinfer"],
                 ["--sparse-decode", "pariskv", "--sparse-offload", "--sparse-topk", "32",
                  "--context-length", "65536"],
                 ["--radix-eviction-policy", "sae", "--sae-sample", "0", "--sae-predictor", "off"],
                 ["--hicache-storage-backend", "file", "--hicache-storage-idle-yield-us", "0"],
                 ["--radix-cache-backend", "pic_span", "--attention-backend", "pic_triton",
                  "--span-markers", "[S],[D]"]):
        given, rest = server_flags.parse(args)
        gap = _gap_asked_for(args)
        if gap is None:
            serve_conflicts.refuse(given, rest)
        else:  # a release without the capability refuses it, naming what it lacks
            with pytest.raises(UsageError, match=re.escape(gap.symbol)):
                serve_conflicts.refuse(given, rest)
    with pytest.raises(UsageError):
        serve_conflicts.refuse(*server_flags.parse(["--span-markers", "[S],[D]"]))


@pytest.mark.capability("eviction")
def test_flags_reach_sglangs_processes_as_variables(model_dir, monkeypatch):
    from sglang_pic.launcher.launch_server import build_argv

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    for flag in FLAGS.values():
        if flag.env:  # build_argv sets them: undone after the test
            monkeypatch.setenv(flag.env, "")
            monkeypatch.delenv(flag.env)
    argv = build_argv(["--model-path", str(model_dir), "--radix-eviction-policy", "sae",
                       "--sae-sample", "0", "--sae-queue-weights", "on"])
    assert "--sae-sample" not in argv and "--sae-queue-weights" not in argv
    assert os.environ["SGLANG_PIC_SAE_SAMPLE"] == "0"
    assert os.environ["SGLANG_PIC_SAE_QUEUE_WEIGHTS"] == "1"
    assert "SGLANG_PIC_SAE_PREDICTOR" not in os.environ  # not given: the reader's default
    from sglang_pic.eviction.sae import SAEStrategy

    sae = SAEStrategy()
    assert sae.sample_size == 0 and sae.queue_weights and sae.sessions.use_predictor


# ---- SGLang's own launcher takes our flags (plugin hooks) ------------------------------------------

PLAIN = r"""
import contextlib, io, json, os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
ours, variable, bad = json.loads(sys.argv[2])
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    prepare_server_args(["--help"])
text = help_text.getvalue()
print("ORDER", text.index("sglang-pic: span caching:") < text.index("\n  --tokenizer-path "))
args = prepare_server_args(["--model-path", sys.argv[1], "--device", "cpu",
                            "--attention-backend", "torch_native", *ours])
print("ARGS", args.attention_backend, args.radix_cache_backend, os.environ[variable])
try:
    prepare_server_args(["--model-path", sys.argv[1], *bad])
except SystemExit as e:
    print("EXIT", e.code)
"""


@pytest.mark.parametrize("ours,variable,bad,translated,refused", [
    pytest.param(["--enable-span-cache", "--span-schedule", "barrier"],
                 "SGLANG_PIC_SPAN_SCHEDULE", ["--enable-span-cache", "--span-recompute-tokens",
                                              "abc"],
                 "pic_torch_native pic_span barrier", "--span-recompute-tokens: 'abc'",
                 marks=SPANS, id="spans"),
    pytest.param(["--sparse-decode", "pariskv", "--sparse-threshold", "700", "--sparse-topk",
                  "32"], "SGLANG_PIC_SPARSE_TOPK", ["--sparse-decode", "pariskv",
                                                   "--sparse-topk", "abc"],
                 "pariskv_torch_native None 32", "--sparse-topk: 'abc'", id="sparse"),
])
def test_sglangs_own_launcher_takes_our_flags(model_dir, ours, variable, bad, translated,
                                               refused):
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", PLAIN, str(model_dir),
                          json.dumps([ours, variable, bad])], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ORDER True" in out.stdout  # our groups before SGLang's flags in --help
    assert f"ARGS {translated}" in out.stdout
    assert "EXIT 2" in out.stdout
    assert f"sglang-pic: error: {refused} is not an integer" in out.stderr


# ---- the server: cache report, then SIGTERM ----------------------------------------------------------


@pytest.fixture(scope="module")
def cfg_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("cfg") / "server.log"
    # the launcher itself (not a forked server process): the SIGTERM test stops it. No key
    # given: it generates one into its key file (test_the_launcher_generates_a_private_key_...)
    srv = start_server(["--max-total-tokens", "4096"], log, forked=False, pass_key=False)
    key_file = use_generated_key(srv)
    yield srv
    stop_server(srv)
    key_file.unlink(missing_ok=True)


def test_the_launcher_generates_a_private_key_kept_off_every_command_line(cfg_server):
    """No key given: the server generates one into ``~/.cache/sglang-pic/api-keys/PORT`` (600,
    folder 700), says where on stderr without the key, and requires it; no process of the
    server (launcher, server process, scheduler, detokenizer) has it in its argv or the
    environment it started with, and neither its log nor ``/get_server_info`` shows it."""
    import psutil

    path = use_generated_key(cfg_server)
    key = cfg_server.api_key
    port = cfg_server.url.rsplit(":", 1)[1]
    root = os.environ.get("SGLANG_PIC_CACHE") or Path.home() / ".cache" / "sglang-pic"
    assert path == Path(root) / "api-keys" / port
    assert len(key) >= 40
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    log = Path(cfg_server.log).read_text(errors="replace")
    assert f'generated into {path} (mode 600' in log
    assert f'-H "Authorization: Bearer $(cat {path})"' in log
    assert key not in log
    assert "api_key='<redacted>'" in log or "'api_key': '<redacted>'" in log  # server_args= at start
    anonymous = requests.post(cfg_server.url + "/generate", json={"text": "Hi"}, timeout=30)
    assert anonymous.status_code == 401
    info = cfg_server.get("/get_server_info")
    assert info.status_code == 200 and key not in info.text
    assert info.json()["api_key"] == "<redacted>"
    launcher = psutil.Process(cfg_server.proc.pid)
    family = [launcher, *launcher.children(recursive=True)]
    assert len(family) >= 4, [p.cmdline() for p in family]  # launcher, server, scheduler, detok.
    for proc in family:
        for what in ("cmdline", "environ"):
            assert key.encode() not in Path(f"/proc/{proc.pid}/{what}").read_bytes(), (
                what, proc.cmdline())


def test_openai_usage_reports_cached_prompt_tokens(cfg_server):
    """``--enable-cache-report`` is on by default: the second identical chat request reports its
    prompt as cached (issue 26 item 4)."""
    body = {"model": "default", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    first = cfg_server.post("/v1/chat/completions", json=body)
    second = cfg_server.post("/v1/chat/completions", json=body)
    assert first.status_code == second.status_code == 200, second.text
    usage = second.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    completion = cfg_server.post("/v1/completions", json={
        "model": "default", "prompt": "The capital of France is", "max_tokens": 2})
    completion = cfg_server.post("/v1/completions", json={
        "model": "default", "prompt": "The capital of France is", "max_tokens": 2})
    assert completion.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_sigterm_drains_and_exits_cleanly(cfg_server):
    """SIGTERM to the launcher's process group (what ``make``, a terminal or a service manager
    sends): the request in flight completes, the launcher exits 0 (was: SGLang SIGKILLed itself,
    ``make: *** Killed``), the log has no traceback, and no server process is left (issue 26
    item 10)."""
    import psutil

    launcher = psutil.Process(cfg_server.proc.pid)
    family = [launcher, *launcher.children(recursive=True)]
    answer: dict = {}

    def ask() -> None:
        answer["r"] = cfg_server.post("/generate", json={
            "text": "Count from one to fifty:", "sampling_params": {
                "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}})

    asking = threading.Thread(target=ask)
    asking.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    os.killpg(cfg_server.proc.pid, signal.SIGTERM)
    code = cfg_server.proc.wait(timeout=30)
    seconds = time.monotonic() - t0
    asking.join(timeout=30)
    print(f"stopped {seconds:.1f} s after SIGTERM, exit status {code}")
    assert code == 0
    assert answer["r"].status_code == 200 and answer["r"].json()["meta_info"][
        "completion_tokens"] == 24
    log = Path(cfg_server.log).read_text(errors="replace")
    assert "SIGTERM received" in log
    assert "Traceback" not in log and "Killed" not in log
    assert not re.search(r"crashed with exit code", log)
    time.sleep(1.0)
    left = [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], left
