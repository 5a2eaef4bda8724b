"""`sglang-pic serve` requires an API key unless ``--insecure`` (``sglang_pic.security.api_key``).

Against the shared plain server (``server``: its key handed over in ``$SGLANG_PIC_API_KEY``, as
every test server's is): requests without the key or with a wrong one get 401, with it 200;
``/health`` needs none; the key is in no process's argv, nor in ``/get_server_info`` or the log.
The rest needs no server: where a key comes from and what is refused (in one line, before
anything loads), the private key file, the hand-off to SGLang's parser, the redaction hooks and
the client-side lookup. The launcher's generated key is checked on the launcher-started server
of test_config_flags (``cfg_server``), ``--insecure`` on test_hicache_cpu's server.
"""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import requests
from sglang_pic.launcher import launch_server
from sglang_pic.launcher.server_flags import UsageError
from sglang_pic.security import api_key, secret_files
from sglang_pic.security.redaction import (
    REDACTED,
    redact_config,
    redact_repr,
    redact_server_info,
    redacted_server_args,
)

KEY = "k3y-of-24-characters-ok"
OTHER = "an0ther-key-of-24-chars"
GENERATE = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 2}}
CHAT = {"model": "default", "max_tokens": 2,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def _key_file(tmp_path: Path, text: str = KEY + "\n", mode: int = 0o600) -> Path:
    path = tmp_path / "api.key"
    path.write_text(text)
    path.chmod(mode)
    return path


# ---- the server refuses requests without the key -------------------------------------------------


@pytest.mark.parametrize("path,body", [("/generate", GENERATE), ("/v1/chat/completions", CHAT)])
def test_requests_need_the_key(server, path, body):
    none = requests.post(server.url + path, json=body, timeout=60)
    wrong = requests.post(server.url + path, json=body, timeout=60,
                          headers={"Authorization": f"Bearer {OTHER}"})
    not_bearer = requests.post(server.url + path, json=body, timeout=60,
                               headers={"Authorization": server.api_key})
    assert none.status_code == wrong.status_code == not_bearer.status_code == 401, none.text
    assert server.post(path, json=body).status_code == 200


def test_health_needs_no_key_and_a_non_ascii_header_is_a_401(server):
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    # SGLang's compare_digest raised on it: a 500 and a traceback (api_key.decide_auth)
    r = requests.post(server.url + "/generate", json=GENERATE, timeout=60,
                      headers={"Authorization": "Bearer cl\u00e9-de-vingt-caract\u00e8res"})
    assert r.status_code == 401, r.text


def test_the_key_is_on_no_command_line_and_not_shown(server):
    import psutil

    key = server.api_key
    info = server.get("/get_server_info")
    assert info.status_code == 200
    assert key not in info.text
    body = info.json()
    assert body["api_key"] == REDACTED and body["admin_api_key"] is None
    assert all(s["api_key"] == REDACTED for s in body["internal_states"])
    root = psutil.Process(server.proc.pid)
    family = [root, *root.children(recursive=True)]
    assert len(family) >= 3  # server process, scheduler, detokenizer
    for proc in family:
        assert key.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    log = server.log.read_text(errors="replace")
    assert key not in log  # SGLang logs its settings at start: as a repr (0.5.17), a dict (0.5.23)
    assert "api_key='<redacted>'" in log or "'api_key': '<redacted>'" in log


# ---- where the key comes from, what is refused -------------------------------------------------


def test_sources_first_found_wins(tmp_path):
    path = _key_file(tmp_path, OTHER + "\n")
    env = {api_key.ENV: "env-key-of-20-chars!"}
    choose = api_key.choose
    assert choose({}, ["--api-key", KEY, "--port", "1"], env).key == KEY
    assert choose({}, [f"--api-key={KEY}"], env).source == "--api-key"
    assert choose({"--api-key-file": str(path)}, [], env).key == OTHER
    assert choose({}, [], env) == api_key.Choice("env-key-of-20-chars!", f"${api_key.ENV}", False)
    assert choose({}, [], {}) == api_key.Choice(None, None, False)
    assert choose({"--insecure": True}, [], {}) == api_key.Choice(None, None, True)


@pytest.mark.parametrize("given,argv,env,message", [
    ({}, ["--api-key", "short"], {}, "--api-key: an API key needs at least 16 characters"),
    ({}, [], {api_key.ENV: "x" * 15}, "$SGLANG_PIC_API_KEY: an API key needs at least 16"),
    ({}, ["--api-key", "cl\u00e9-de-vingt-caract\u00e8res"], {}, "printable ASCII"),
    ({}, ["--api-key", "with a space in it, long"], {}, "without spaces"),
    ({"--insecure": True}, ["--api-key", KEY], {},
     "--insecure and an API key (--api-key) exclude each other"),
    ({"--insecure": True}, [], {api_key.ENV: KEY}, "($SGLANG_PIC_API_KEY) exclude each other"),
    ({"--insecure": True, "--api-key-file": "/no/such"}, [], {},
     "--insecure and an API key (--api-key-file /no/such)"),
    ({"--api-key-file": "/no/such/key"}, [], {}, "--api-key-file /no/such/key: No such file"),
    ({"--api-key-file": "/dev/null"}, [], {}, "--api-key-file /dev/null: not a regular file"),
])
def test_refused(given, argv, env, message):
    with pytest.raises(UsageError) as e:
        api_key.choose(given, argv, env)
    assert message in e.value.message, e.value.message
    assert KEY not in e.value.message


def test_a_key_file_must_be_private_and_hold_a_long_key(tmp_path):
    for mode in (0o644, 0o640, 0o604):
        path = _key_file(tmp_path, mode=mode)
        with pytest.raises(UsageError, match="readable by other users; chmod 600 it"):
            api_key.choose({"--api-key-file": str(path)}, [], {})
    path = _key_file(tmp_path, "short\n")
    with pytest.raises(UsageError, match="at least 16 characters"):
        api_key.choose({"--api-key-file": str(path)}, [], {})
    path = _key_file(tmp_path, f"{KEY}\n{OTHER}\n")  # two lines: not one key
    with pytest.raises(UsageError, match="without spaces"):
        api_key.choose({"--api-key-file": str(path)}, [], {})
    assert api_key.choose({"--api-key-file": str(_key_file(tmp_path))}, [], {}).key == KEY


def test_without_insecure_unchecked_listeners_are_refused():
    for argv in (["--grpc-port", "5000"], ["--smg-grpc-mode"], ["--tokenizer-worker-num", "2"]):
        with pytest.raises(UsageError, match="--insecure"):
            api_key.refuse_unchecked(api_key.Choice(KEY, "--api-key", False), argv)
        api_key.refuse_unchecked(api_key.Choice(None, None, True), argv)
    api_key.refuse_unchecked(api_key.Choice(None, None, False), ["--tokenizer-worker-num", "1"])


def _serve(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != api_key.ENV}
    return subprocess.run([sys.executable, "-m", "sglang_pic", "serve", *args],
                          capture_output=True, text=True, timeout=120, env={**environ, **env})


def test_the_launcher_refuses_in_one_line(tmp_path):
    """What ``sglang-pic serve`` itself answers (exit status 2, one line, nothing loaded)."""
    loose = _key_file(tmp_path, mode=0o644)
    for args, env, message in (
        (["--api-key-file", str(loose)], {}, f"--api-key-file {loose}: readable by other users"),
        (["--api-key", "short"], {}, "--api-key: an API key needs at least 16 characters"),
        (["--insecure"], {api_key.ENV: KEY}, "--insecure and an API key ($SGLANG_PIC_API_KEY)"),
        (["--grpc-port", "5000"], {}, "--grpc-port: SGLang's gRPC listener does not check"),
    ):
        out = _serve(args, env)
        assert out.returncode == 2, (out.stdout, out.stderr)
        lines = out.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("sglang-pic serve: error: "), out.stderr
        assert message in lines[0] and out.stdout == ""


# ---- the private key file ----------------------------------------------------------------------


def test_private_files_are_regular_and_600(tmp_path):
    os.mkfifo(tmp_path / "fifo", 0o600)  # would block a plain open
    with pytest.raises(ValueError, match="not a regular file"):
        secret_files.read_private(tmp_path / "fifo")
    with pytest.raises(ValueError, match="not a regular file"):
        secret_files.read_private(tmp_path)
    assert secret_files.read_private(_key_file(tmp_path)) == KEY + "\n"


def test_a_generated_key_file_is_600_in_a_700_folder_and_replaces_a_planted_link(tmp_path):
    folder = tmp_path / "keys"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (folder / "30000").symlink_to(victim)
    path = secret_files.write_private(folder, "30000", KEY + "\n")
    assert path == folder / "30000" and not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert victim.read_text() == "untouched"
    assert sorted(p.name for p in folder.iterdir()) == ["30000"]  # no temporary file left
    link = tmp_path / "link"
    link.symlink_to(folder)
    with pytest.raises(ValueError, match="not a directory"):
        secret_files.private_directory(link)


def test_serve_generates_a_key_and_says_where_not_what(tmp_path, monkeypatch, capsys):
    """What the server process does once every check passed (``server_process.main``);
    ``build_argv`` before it generates nothing, so a start refused there leaves the key file of
    a server running on that port alone."""
    import socket

    monkeypatch.delenv(api_key.ENV, raising=False)
    monkeypatch.setattr(api_key, "key_dir", lambda: tmp_path / "api-keys")
    assert api_key.hand_over({}, ["--port", "31999"], "p", require=True) == ["--port", "31999"]
    assert api_key.ENV not in os.environ and not (tmp_path / "api-keys").exists()
    with pytest.raises(UsageError, match="--port: 'x' is not a port"):
        api_key.hand_over({}, ["--port", "x"], "p", require=True)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UsageError, match=f"--port {port}: address already in use"):
            api_key.generate_unless_given(["--port", str(port)], "p")
    assert not (tmp_path / "api-keys").exists()
    api_key.generate_unless_given(["--port", str(port), "--max-total-tokens", "64"], "p")
    key = os.environ[api_key.ENV]
    path = tmp_path / "api-keys" / str(port)
    assert path.read_text() == key + "\n" and len(key) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"p: API key generated into {path} (mode 600, new at each start); clients send it: "
        f'-H "Authorization: Bearer $(cat {path})"']
    assert key not in err
    api_key.generate_unless_given(["--port", str(port)], "p")  # a key given: nothing happens
    monkeypatch.delenv(api_key.ENV)
    api_key.generate_unless_given(["--port", str(port), "--insecure"], "p")
    assert path.read_text() == key + "\n" and api_key.ENV not in os.environ


def test_insecure_warns_and_loudly_beyond_loopback(monkeypatch, capsys):
    monkeypatch.delenv(api_key.ENV, raising=False)
    api_key.hand_over({"--insecure": True}, [], "p", require=True)
    assert capsys.readouterr().err == ("p: warning: --insecure: no API key; every process on "
                                       "this machine can use the server\n")
    api_key.hand_over({"--insecure": True}, ["--host", "0.0.0.0", "--port", "8000"], "p",
                      require=True)
    err = capsys.readouterr().err
    assert err.startswith("p: WARNING: --insecure with --host 0.0.0.0: NO API KEY")
    assert "ANYONE WHO REACHES PORT 8000" in err
    assert api_key.ENV not in os.environ
    api_key.hand_over({}, [], "p", require=False)  # SGLang's own launcher: no key required
    assert capsys.readouterr().err == "" and api_key.ENV not in os.environ


# ---- the key reaches SGLang on no command line ------------------------------------------------


def test_the_launcher_moves_an_argv_key_into_the_environment(monkeypatch, capsys):
    started = {}
    monkeypatch.setattr(launch_server, "supervise",
                        lambda argv, env=None: started.update(argv=argv, env=env) or 0)
    monkeypatch.delenv(api_key.ENV, raising=False)
    assert launch_server.serve(["--port", "31998", "--api-key", KEY, f"--api-key={OTHER}",
                                "--max-total-tokens", "4096"]) == 0
    assert started["argv"] == ["--port", "31998", "--max-total-tokens", "4096"]
    assert started["env"] == {api_key.ENV: OTHER}  # the last one, as SGLang's parser takes it
    err = capsys.readouterr().err
    assert "--api-key puts the key on the command line" in err and "--api-key-file" in err
    assert KEY not in err and OTHER not in err
    # an abbreviation is ambiguous beside our --api-key-file: refused, never passed on
    assert launch_server.serve(["--api-ke", KEY]) == 2
    assert "unrecognized argument --api-ke" in capsys.readouterr().err


def test_the_hook_hands_the_key_to_sglangs_parser_and_out_of_the_environment(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()  # SGLang's flag, as its parser declares it
    parser.add_argument("--api-key", type=str, default=None)
    parser.add_argument("--port", type=int)
    for key in (KEY, "-starts-with-a-dash-" + KEY):  # token_urlsafe's alphabet has "-"
        monkeypatch.setenv(api_key.ENV, key)
        argv = api_key.to_sglang(["--port", "1", "--api-key", OTHER])
        assert api_key.ENV not in os.environ and OTHER not in argv
        assert parser.parse_args(argv).api_key == key
    assert api_key.to_sglang(["--port", "1"]) == ["--port", "1"]


def test_hosts_and_client_lookup(tmp_path, monkeypatch):
    for host in ("localhost", "127.0.0.1", "127.3.2.1", "::1", "[::1]"):
        assert api_key.is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "example.com"):
        assert not api_key.is_loopback(host), host
    # the key file of a local server on the URL's port
    monkeypatch.setattr(api_key, "key_dir", lambda: tmp_path / "api-keys")
    secret_files.write_private(api_key.key_dir(), "31997", KEY + "\n")
    assert api_key.client_key("http://127.0.0.1:31997/", {}) == KEY
    # localhost may resolve to ::1, where another user's process may listen on the port
    assert api_key.client_key("http://localhost:31997", {}) is None
    assert api_key.client_key("http://[::1]:31997", {}) is None
    assert api_key.client_key("http://10.0.0.1:31997", {}) is None  # another machine's server
    assert api_key.client_key("http://127.0.0.1:31996", {}) is None  # no such file
    assert api_key.client_key("http://127.0.0.1:31997", {api_key.ENV: OTHER}) == OTHER


# ---- redaction hooks ---------------------------------------------------------------------------


@dataclass
class _Args:
    model_path: str
    api_key: str | None
    admin_api_key: str | None
    ssl_keyfile_password: str | None = None


def test_server_info_launch_command_is_redacted():
    """0.5.23's ``/server_info`` carries the argv SGLang parsed, space-joined."""
    info = redact_server_info({"api_key": KEY, "port": 1, "launch_command":
                               f"python -m sglang.launch_server --api-key {KEY} --port 1 "
                               f"--admin-api-key={OTHER}"})
    assert KEY not in str(info) and OTHER not in str(info)
    assert info["launch_command"] == ("python -m sglang.launch_server --api-key <redacted> "
                                      "--port 1 --admin-api-key=<redacted>")
    assert info["api_key"] == REDACTED and info["port"] == 1


class _SealedArgs(msgspec.Struct):
    """0.5.23's ``ServerArgs``: a msgspec record that refuses assignments once resolved."""

    model_path: str
    api_key: str | None
    admin_api_key: str | None = None

    def __setattr__(self, name, value):
        raise AttributeError(f"server_args.{name} assigned after resolution")


def test_a_dump_holds_a_copy_without_the_secrets():
    for args in (_Args("/m", KEY, OTHER), _SealedArgs("/m", KEY, OTHER)):
        copy = redacted_server_args(args)
        assert copy.api_key == REDACTED and copy.admin_api_key == REDACTED
        assert copy.model_path == "/m" and args.api_key == KEY  # the server's own is untouched
        assert KEY.encode() not in pickle.dumps(copy)


def test_secrets_are_redacted_from_repr_and_config():
    args = _Args("/m", KEY, None, OTHER)
    text = redact_repr(_Args.__repr__, args)
    assert KEY not in text and OTHER not in text
    assert "api_key='<redacted>'" in text and "admin_api_key=None" in text
    assert "model_path='/m'" in text
    config = redact_config({"api_key": KEY, "admin_api_key": None, "ssl_keyfile_password": "",
                            "port": 1}, object(), {})
    assert config == {"api_key": REDACTED, "admin_api_key": None, "ssl_keyfile_password": "",
                      "port": 1}


def test_a_non_ascii_header_is_decided_as_none():
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    def decide(header: str | None, path: str = "/generate"):
        return api_key.decide_auth(
            decide_request_auth, method="POST", path=path, authorization_header=header,
            api_key=KEY, admin_api_key=None, auth_level=AuthLevel.NORMAL)

    assert not decide("Bearer cl\u00e9").allowed and decide("Bearer cl\u00e9").error_status_code == 401
    assert decide(f"Bearer {KEY}").allowed and not decide(f"Bearer {OTHER}").allowed
    assert decide("Bearer cl\u00e9", "/health").allowed
