"""PTStore against an attacker (issue 21): every test names the defect it guards against.

1 ids never become paths; 2 secure defaults; 3 no token in argv, extra config or logs; 4 no
message is accepted before authentication; 5 corrupt SSD pages are misses; 6 tenants are
isolated; 7 one bad item never fails another; 8 the SSD tier, the object journal and the data
plane's buffers are bounded, and a damaged journal does not stop a start; 9 secrets compared in
constant time; 10 the TCP data plane; 11 the CLI refuses every bad value in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from conftest import REPO, free_port
from sglang_pic.store.auth import (
    SERVE_TOKEN_ENV,
    STORE_TOKEN_ENV,
    client_keys,
    parse_tokens,
    read_token_file,
    secure_client,
    server_keys,
)
from sglang_pic.store.client import StoreClient
from sglang_pic.store.engine import StoreEngine
from sglang_pic.store.protocol import Limits, ProtocolError, decode_request
from sglang_pic.store.server import StoreServer

PAGE = 1024
TOKEN = "security-test-token-alice-0123"
OTHER = "security-test-token-bob-456789"


def _pages(prefix: str, n: int, size: int = PAGE) -> list[tuple[str, bytes]]:
    return [(f"{prefix}{i}", bytes([i % 251]) * size) for i in range(n)]


# ---- a record of every file the process opens, renames or deletes ------------------------
_TOUCHED: list[str] | None = None
_MAIN = threading.get_ident()


def _audit(event: str, args: tuple) -> None:
    if _TOUCHED is None or threading.get_ident() != _MAIN:
        return
    if event in ("open", "os.remove", "os.mkdir", "os.rmdir"):
        paths = args[:1]
    elif event == "os.rename":
        paths = args[:2]
    else:
        return
    for p in paths:
        if isinstance(p, (str, bytes, os.PathLike)):
            _TOUCHED.append(os.path.abspath(os.fsdecode(p)))


sys.addaudithook(_audit)


@contextmanager
def files_touched():
    """The absolute paths this thread opens / renames / deletes / creates inside the block."""
    global _TOUCHED
    _TOUCHED = touched = []
    try:
        yield touched
    finally:
        _TOUCHED = None


def _inside(path: str, root: Path) -> bool:
    """``path`` is ``root`` or below it."""
    real, top = os.path.realpath(path), str(root.resolve())
    return real == top or real.startswith(top + os.sep)


# ---- 1: ids are never paths --------------------------------------------------------------
ATTACK_IDS = ["/etc/passwd", "../../../../../../etc/passwd", "/" + "../" * 12 + "ptstore-no-such-dir/x",
              "a/./b", "a/b", "a//b", "./a/b", "..", ".", "", "tensors", "x" * 1024,
              "\udc80-lone-surrogate", "con", "a\\b"]


def test_no_id_reads_a_file_outside_the_ssd_dir(tmp_path):
    """``get("/etc/passwd")`` used to return /etc/passwd (``ssd / "tensors" / tid``)."""
    eng = StoreEngine(4 * PAGE, replica_fraction=0.0, ssd_dir=tmp_path / "ssd")
    with files_touched() as touched:
        got = eng.get_tensors(["/etc/passwd", "../../../../../../../../etc/passwd",
                               "/proc/self/environ"])
    assert got == [None, None, None]
    assert not any(_inside(p, Path("/etc")) or p.startswith("/proc") for p in touched)


def test_ids_that_look_like_paths_are_distinct_pages_kept_inside_the_ssd_dir(tmp_path):
    """Every form of path id is a valid, distinct id; spilled, it lands in a file named by a
    digest inside the SSD dir, and nothing outside the dir is opened, renamed or deleted
    (``"/" + "../" * 12 + path`` used to be written wherever it pointed)."""
    root = tmp_path / "ssd"
    escaped = tmp_path / "escaped"
    ids = [*ATTACK_IDS, "/" + "../" * 12 + str(escaped).lstrip("/")]
    pages = [(t, hashlib.blake2b(t.encode("utf-8", "surrogatepass")).digest() * (PAGE // 64))
             for t in ids]
    with files_touched() as touched:
        eng = StoreEngine(2 * PAGE, replica_fraction=0.0, ssd_dir=root)
        assert eng.put_tensors(pages) == len(pages) * PAGE
        eng.flush_to_ssd()
        restarted = StoreEngine(2 * PAGE, replica_fraction=0.0, ssd_dir=root)
        got = restarted.get_tensors(ids)  # all from SSD now
    assert got == [d for _, d in pages]  # "a/./b", "a/b", "a//b" stay three pages
    assert restarted.stats["ssd_hits"] == len(ids)
    assert touched and all(_inside(p, root) for p in touched), \
        [p for p in touched if not _inside(p, root)]
    assert not escaped.exists()
    names = {p.name for p in (root / "pages").iterdir()}
    assert len(names) == len(ids) and all(len(n) == 32 for n in names)


def test_ids_are_bounded_and_nul_free_at_the_protocol_layer():
    def frames(tids, op="get", **extra):
        return [json.dumps({"op": op, "tids": tids, **extra}).encode()]

    limits = Limits()
    assert decode_request(frames(["x" * 1024, "/etc/passwd"]), limits)[0]["tids"][0] == "x" * 1024
    for bad in (["a\0b"], ["x" * 1025], [7], [None], [["nested"]]):
        with pytest.raises(ProtocolError, match="id"):
            decode_request(frames(bad), limits)
    with pytest.raises(ProtocolError, match="key"):
        decode_request([json.dumps({"op": "get_object", "key": "a\0"}).encode()], limits)
    with pytest.raises(ProtocolError, match="key"):
        decode_request(frames([], "put_object", key=None), limits)


@pytest.fixture
def server(tmp_path):
    srv = StoreServer(StoreEngine(8 * PAGE, replica_fraction=0.0, ssd_dir=tmp_path / "ssd"),
                      f"ipc://{tmp_path}/s.sock", TOKEN).start()
    yield srv
    srv.stop()


def test_headers_json_cannot_parse_are_protocol_errors():
    """A number past 64 bits, nesting past any parser's stack, bad UTF-8 and cut JSON are
    refused like any malformed header (not an internal error with a traceback per request)."""
    for head in (b'{"op": "get", "tids": [' + b"9" * 5000 + b"]}",
                 b'{"op": "put", "sums": [' + b"9" * 5000 + b"]}",
                 b"[" * 100_000 + b"]" * 100_000, b'{"op": "get", "tids": ' + b"[" * 100_000,
                 b"\xff\xfe", b"{"):
        with pytest.raises(ProtocolError, match="malformed header|invalid request"):
            decode_request([head], Limits())


def test_a_request_is_exactly_one_ops_schema():
    """Requests are validated whole: a field the op does not take, anywhere, a value of another
    type (a bool for a count, a float for a checksum, a negative offset), a pool spec or nonce
    of the wrong shape, or an unknown op are refused naming the field."""
    def refused(header: dict, *payloads: bytes) -> str:
        with pytest.raises(ProtocolError) as e:
            decode_request([json.dumps(header).encode(), *payloads], Limits())
        return str(e.value)

    spec = {"pid": 1, "fd": 3, "dev": 2, "ino": 4, "ticket": 5, "proof": "0" * 32}
    pool = {"pool": spec, "offsets": [0], "sizes": [8], "until": 1.0}
    assert decode_request([json.dumps({"op": "get", "tids": ["a"], "shm": pool}).encode()],
                          Limits())[0]["shm"]["pool"] == spec
    assert "unknown field `evil`" in refused({"op": "get", "tids": ["a"], "evil": 1})
    assert "unknown field `shm`" in refused({"op": "exists", "tids": ["a"], "shm": pool})
    assert "unknown field `tids`" in refused({"op": "status", "tids": ["a"]})
    assert "unknown field `x`" in refused({"op": "get", "tids": ["a"],
                                           "shm": {**pool, "pool": {**spec, "x": 1}}})
    assert "`$.sums[0]`" in refused({"op": "put", "tids": ["a"], "sums": [True]}, b"x")
    assert "`$.sums[0]`" in refused({"op": "put", "tids": ["a"], "sums": [1.5]}, b"x")
    assert "`$.shm.offsets[0]`" in refused({"op": "get", "tids": ["a"],
                                            "shm": {**pool, "offsets": [-1]}})
    assert "`$.shm.pool.proof`" in refused({"op": "get", "tids": ["a"],
                                            "shm": {**pool, "pool": {**spec, "proof": "x"}}})
    assert "`$.tcp.streams`" in refused({"op": "get", "tids": ["a"], "tcp": {"streams": 65}})
    assert "`$.kind`" in refused({"op": "put", "tids": [], "sums": [], "kind": "mine"})
    assert "`$.op`" in refused({"op": "drop_all"})
    assert "one of them" in refused({"op": "probe", "shm": {"name": "x", "pool": spec}})
    assert "each tensor id once" in refused({"op": "get", "tids": ["a", "b", "a"]})


def test_a_page_at_the_size_limit_is_stored_over_an_encrypted_connection(tmp_path):
    """zmq compares the encrypted frame with its size limit: CURVE's bytes on top of a page of
    exactly ``max_tensor_bytes`` must not get the connection dropped (the client would wait
    for its time-out), and a page one byte over is refused by the protocol, with a reply."""
    limits = Limits(max_tensor_bytes=1 << 20, max_header_bytes=1 << 16)
    srv = StoreServer(StoreEngine(8 << 20), f"ipc://{tmp_path}/l.sock", TOKEN, limits,
                      data_plane=None).start()
    client = StoreClient([srv.endpoint], TOKEN, timeout_ms=5000)
    try:
        t0 = time.monotonic()
        assert client.batch_set([("edge", b"e" * (1 << 20))]) == 1 << 20
        assert client.batch_set([("over", b"o" * ((1 << 20) + 1))]) == 0
        assert time.monotonic() - t0 < 4  # answered, not timed out
        assert srv.rejected == 1
    finally:
        client.close()
        srv.stop()


def test_over_the_wire_path_ids_read_nothing_and_a_nul_id_is_refused(server):
    client = StoreClient([server.endpoint], TOKEN)
    try:
        assert client.batch_get(["/etc/passwd", "../../../etc/passwd"]) == [None, None]
        assert client.batch_exists(["/etc/passwd"]) == [False]
        assert client.batch_set([("a\0b", b"n" * PAGE)]) == 0  # refused, as a request
        assert client.last_failed == ["a\0b"]
        assert client.batch_set(_pages("ok", 2)) == 2 * PAGE  # the server keeps serving
        assert server.rejected == 1
    finally:
        client.close()


# ---- 2: secure defaults --------------------------------------------------------------------
def _store_cli(args: list[str], env_token: str | None = None, timeout: float = 20):
    env = {k: v for k, v in os.environ.items() if k not in (STORE_TOKEN_ENV, SERVE_TOKEN_ENV)}
    if env_token is not None:
        env[STORE_TOKEN_ENV] = env_token
    return subprocess.run([sys.executable, "-m", "sglang_pic", "store", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_a_store_without_a_token_refuses_to_start(tmp_path):
    ep = f"tcp://127.0.0.1:{free_port()}"
    out = _store_cli(["--endpoint", ep, "--memory-gb", "0.01"])
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no token" in lines[0] and "--insecure" in lines[0]
    token_on_argv = _store_cli(["--endpoint", ep, "--token", TOKEN])
    assert token_on_argv.returncode == 2 and "ps" in token_on_argv.stderr
    both = _store_cli(["--endpoint", ep, "--insecure"], env_token=TOKEN)
    assert both.returncode == 2
    short = _store_cli(["--endpoint", ep], env_token="short")
    assert short.returncode == 2 and "16 characters" in short.stderr


def test_the_default_endpoint_is_loopback(monkeypatch):
    from sglang_pic.store import cli, server

    bound = []

    class Bound(Exception):
        pass

    def fake_server(engine, endpoint, *args, **kwargs):
        bound.append(endpoint)
        raise Bound

    monkeypatch.setattr(server, "StoreServer", fake_server)
    monkeypatch.setenv(STORE_TOKEN_ENV, TOKEN)
    with pytest.raises(Bound):
        cli.serve(["--memory-gb", "0.01"])
    assert bound == ["tcp://127.0.0.1:7400"]


def test_token_files_name_tenants_and_must_be_private(tmp_path):
    text = f"# tenants\nalice {TOKEN}\n\n{OTHER}  # unnamed\nalice {TOKEN}-rotated\n"
    tokens = parse_tokens(text)
    assert tokens[TOKEN] == tokens[f"{TOKEN}-rotated"] == "alice"
    assert tokens[OTHER].startswith("t-") and OTHER not in tokens[OTHER]
    for bad in ("a b c", "bad/name " + TOKEN, "short", ""):
        with pytest.raises(ValueError):
            parse_tokens(bad)
    path = tmp_path / "tokens"
    path.write_text(text)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_token_file(path)
    path.chmod(0o600)
    assert read_token_file(path) == tokens


# ---- 3: the token never leaks -----------------------------------------------------------
def _token_file(tmp_path: Path, token: str = TOKEN) -> Path:
    path = tmp_path / "ptstore.token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


def test_serve_keeps_the_token_out_of_argv_and_the_extra_config(tmp_path, model_dir,
                                                                monkeypatch):
    """The extra config is what ``/get_server_info`` returns and SGLang logs; argv is in ``ps``.
    The token reaches SGLang's schedulers through the environment only."""
    from sglang_pic.launcher.launch_server import SPAN_STORE_ENV, build_argv

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    for var in (SERVE_TOKEN_ENV, SPAN_STORE_ENV):  # build_argv sets them: undone after the test
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    path = _token_file(tmp_path)
    argv = build_argv(["--model-path", str(model_dir), "--ptstore", "tcp://a:1",
                       "--ptstore-token-file", str(path)])
    assert not any(TOKEN in a for a in argv)
    config = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])
    assert "token" not in config and config["servers"] == ["tcp://a:1"]
    assert os.environ[SERVE_TOKEN_ENV] == TOKEN  # inherited by SGLang's scheduler processes

    with pytest.raises(SystemExit, match="ps"):
        build_argv(["--model-path", str(model_dir), "--ptstore", "tcp://a:1",
                    "--ptstore-token", TOKEN])
    with pytest.raises(SystemExit, match="get_server_info"):
        build_argv(["--model-path", str(model_dir), "--ptstore", "tcp://a:1",
                    "--hicache-storage-backend-extra-config", json.dumps({"token": TOKEN})])


@pytest.mark.capability("spans")
def test_the_span_store_settings_keep_the_token_out_too(tmp_path, model_dir, monkeypatch):
    """The span cache's store settings travel in a variable of their own: without the token."""
    from sglang_pic.launcher.launch_server import SPAN_STORE_ENV, build_argv

    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    for var in (SERVE_TOKEN_ENV, SPAN_STORE_ENV):  # build_argv sets them: undone after the test
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    build_argv(["--model-path", str(model_dir), "--ptstore", "tcp://a:1", "--enable-span-cache",
                "--ptstore-token-file", str(_token_file(tmp_path))])
    assert TOKEN not in os.environ[SPAN_STORE_ENV] and os.environ[SERVE_TOKEN_ENV] == TOKEN


def test_the_hicache_backend_authenticates_with_the_token_from_the_environment(server,
                                                                             monkeypatch):
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang_pic.store.hicache_backend import PTStoreHiCacheStorage

    monkeypatch.setenv(SERVE_TOKEN_ENV, TOKEN)
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, enable_storage_metrics=False, is_mla_model=False,
                               is_page_first_layout=True, model_name="m",
                               extra_config={"servers": [server.endpoint], "timeout_ms": 2000})
    backend = PTStoreHiCacheStorage(cfg)
    page = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert backend.batch_set(["k"], [page])
    assert torch.equal(backend.batch_get(["k"], [torch.empty_like(page)])[0], page)
    backend.close()
    with pytest.raises(ValueError, match="get_server_info"):
        PTStoreHiCacheStorage(HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            enable_storage_metrics=False, is_mla_model=False, is_page_first_layout=True,
            model_name="m", extra_config={"servers": [server.endpoint], "token": TOKEN}))


# ---- 4: nothing is accepted before authentication ------------------------------------------
def _vm_hwm_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.fixture
def store_process(tmp_path):
    """``sglang-pic store`` in its own process (its memory is measured), token from the env."""
    ep = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, **{STORE_TOKEN_ENV: TOKEN})
    proc = subprocess.Popen([sys.executable, "-m", "sglang_pic", "store", "--endpoint", ep,
                             "--memory-gb", "0.25"], env=env, stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        assert "PTStore server on" in proc.stdout.readline()
        yield proc, ep
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_an_unauthenticated_64_mb_message_is_never_accepted(store_process):
    """The token used to be checked only once zmq had buffered the whole message (up to
    1 GiB): now a peer without credentials, or with a wrong token, never gets past the
    handshake, and the server's memory does not grow by what it sends."""
    proc, ep = store_process
    ctx = zmq.Context.instance()
    blob = b"\xab" * (64 << 20)
    before = _vm_hwm_kb(proc.pid)
    peers = []
    for token in (None, "wrong-token-wrong-token-wrong"):
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        secure_client(peer, token, server_keys(TOKEN)[0] if token else None)
        peer.connect(ep)
        peer.send_multipart([json.dumps({"op": "status"}).encode(), blob], copy=False)
        peers.append(peer)
    poller = zmq.Poller()
    for peer in peers:
        poller.register(peer, zmq.POLLIN)
    assert not poller.poll(3000), "an unauthenticated peer got an answer"
    for peer in peers:
        peer.close(0)
    grown_mb = (_vm_hwm_kb(proc.pid) - before) / 1024
    assert grown_mb < 32, f"the server's peak memory grew by {grown_mb:.0f} MB"
    client = StoreClient([ep], TOKEN)
    status = client.status(ep)
    client.close()
    assert status is not None and status["requests"] == 1  # this status request only


def test_a_silent_connection_is_dropped_after_the_handshake_interval(tmp_path, monkeypatch):
    """Half-open connections used to be held forever (libzmq's default handshake interval is
    30 s); heartbeats drop dead peers after the handshake (its interval shortened here from
    ``auth.HANDSHAKE_MS``, the server's own setting, to 1 s)."""
    from sglang_pic.store import auth

    monkeypatch.setattr(auth, "HANDSHAKE_MS", 1000)
    server = StoreServer(StoreEngine(8 * PAGE, replica_fraction=0.0), f"ipc://{tmp_path}/s.sock",
                         TOKEN).start()
    try:
        assert server.sock.getsockopt(zmq.HANDSHAKE_IVL) == 1000
        assert server.sock.getsockopt(zmq.HEARTBEAT_IVL) > 0
        assert server.sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) > 0
        path = server.endpoint.removeprefix("ipc://")
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(path)
            raw.settimeout(15)
            t0 = time.monotonic()
            while raw.recv(4096):  # the server's greeting, then nothing until it hangs up
                pass
            assert time.monotonic() - t0 < 5
    finally:
        server.stop()


def test_a_wrong_token_gets_misses_and_the_right_one_works(server):
    right = StoreClient([server.endpoint], TOKEN)
    assert right.batch_set(_pages("p", 3)) == 3 * PAGE
    wrong = StoreClient([server.endpoint], OTHER, timeout_ms=300, server_key=server.server_key)
    try:
        assert wrong.batch_get(["p0", "p1"]) == [None, None]
        assert wrong.batch_set(_pages("w", 1)) == 0 and wrong.last_failed == ["w0"]
        assert wrong.status(server.endpoint) is None
        assert right.batch_get(["p0"]) == [_pages("p", 1)[0][1]]
    finally:
        wrong.close()
        right.close()


# ---- 5: corrupt SSD pages are misses -------------------------------------------------------
def _page_files(root: Path) -> list[Path]:
    """The files the SSD tier keeps pages in (whatever it names them)."""
    return [p for p in root.rglob("*") if p.is_file() and p.name != "objects.jsonl"]


def _file_of(root: Path, page: bytes) -> Path:
    """The page file holding ``page`` (found by its content)."""
    (path,) = [p for p in _page_files(root) if p.read_bytes().endswith(page)]
    return path


def _spilled(root: Path, n: int = 4) -> tuple[StoreEngine, list[tuple[str, bytes]]]:
    eng = StoreEngine(PAGE, replica_fraction=0.0, ssd_dir=root)
    pages = _pages("s", n)
    eng.put_tensors(pages)
    eng.flush_to_ssd()
    assert len(_page_files(root)) == n
    return eng, pages


def test_a_flipped_byte_on_ssd_is_a_miss_and_the_file_is_removed(tmp_path):
    """Pages read back from SSD used to be hashed when served, so a corrupted file was served
    with the checksum of its corrupted bytes."""
    eng, pages = _spilled(tmp_path / "ssd")
    path = _file_of(tmp_path / "ssd", pages[1][1])
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x01
    path.write_bytes(bytes(raw))
    got = eng.get_tensors([t for t, _ in pages])
    assert got[1] is None and got[0] == pages[0][1] and got[2] == pages[2][1]
    assert eng.stats["ssd_corrupt"] == 1 and not path.exists() and not eng.has("s1")


def test_a_truncated_or_swapped_ssd_file_is_a_miss(tmp_path):
    root = tmp_path / "ssd"
    eng, pages = _spilled(root)
    s0, s2, s3 = (_file_of(root, pages[i][1]) for i in (0, 2, 3))
    s0.write_bytes(s0.read_bytes()[:-1])  # a torn write
    s2.write_bytes(s3.read_bytes())  # another id's page under s2's name
    assert eng.get_tensors(["s0", "s2", "s3"]) == [None, None, pages[3][1]]
    assert eng.stats["ssd_corrupt"] == 2
    restarted = StoreEngine(PAGE, replica_fraction=0.0, ssd_dir=root)
    assert restarted.get_tensors(["s0", "s1", "s2", "s3"]) == [None, pages[1][1], None,
                                                                pages[3][1]]


def test_a_corrupt_ssd_page_is_a_miss_over_the_wire(server, tmp_path):
    client = StoreClient([server.endpoint], TOKEN)
    pages = _pages("w", 12)  # 8 pages of memory: 4 spill
    client.batch_set(pages)
    files = _page_files(tmp_path / "ssd")
    assert len(files) == 4
    for path in files:
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    got = client.batch_get([t for t, _ in pages])
    assert sum(g is None for g in got) == 4
    assert all(g == d for g, (_, d) in zip(got, pages, strict=True) if g is not None)
    client.close()


# ---- 6: tenants --------------------------------------------------------------------------
@pytest.fixture
def two_tenants(tmp_path):
    srv = StoreServer(StoreEngine(64 * PAGE, ssd_dir=tmp_path / "ssd"),
                      f"ipc://{tmp_path}/t.sock", {TOKEN: "alice", OTHER: "bob"}).start()
    alice = StoreClient([srv.endpoint], TOKEN)
    bob = StoreClient([srv.endpoint], OTHER, server_key=srv.server_key)
    yield srv, alice, bob
    alice.close()
    bob.close()
    srv.stop()


def test_a_tenant_can_neither_read_nor_overwrite_another_tenants_pages(two_tenants):
    srv, alice, bob = two_tenants
    assert alice.batch_set([("x", b"A" * PAGE)]) == PAGE
    assert bob.batch_exists(["x"]) == [False]
    assert bob.batch_get(["x"]) == [None]
    assert bob.batch_set([("x", b"B" * PAGE)]) == PAGE  # its own page, not a duplicate of A's
    assert alice.batch_get(["x"]) == [b"A" * PAGE]
    assert bob.batch_get(["x"]) == [b"B" * PAGE]
    alice.channels.call(srv.endpoint, {"op": "put_object", "key": "doc", "tids": ["x"]})
    assert bob.channels.call(srv.endpoint, {"op": "get_object", "key": "doc"})[0]["tids"] is None
    assert alice.channels.call(srv.endpoint, {"op": "get_object", "key": "doc"})[0]["tids"] == ["x"]


def test_tenants_stay_apart_on_ssd_and_across_a_restart(two_tenants, tmp_path):
    srv, alice, bob = two_tenants
    alice.batch_set([("same", b"a" * PAGE)])
    bob.batch_set([("same", b"b" * PAGE)])
    srv.engine.flush_to_ssd()
    restarted = StoreEngine(2 * PAGE, ssd_dir=tmp_path / "ssd")
    assert len(restarted.ssd) == 2
    srv2 = StoreServer(restarted, f"ipc://{tmp_path}/t2.sock",
                       {TOKEN: "alice", OTHER: "bob"}).start()
    a2 = StoreClient([srv2.endpoint], TOKEN)
    b2 = StoreClient([srv2.endpoint], OTHER, server_key=srv2.server_key)
    try:
        assert a2.batch_get(["same"]) == [b"a" * PAGE]
        assert b2.batch_get(["same"]) == [b"b" * PAGE]
    finally:
        a2.close()
        b2.close()
        srv2.stop()


def test_a_tenant_cannot_have_a_server_write_into_another_tenants_host_pool(two_tenants):
    """A pool is named by pid, fd and inode, which another tenant can guess: a request must also
    carry the secret of the reader's ticket memfd."""
    import mmap

    from sglang_pic.store.shm import address_of, pool_spec

    srv, alice, bob = two_tenants
    fd = os.memfd_create("ptstore-test-pool")
    os.ftruncate(fd, 2 * PAGE)
    mm = mmap.mmap(fd, 2 * PAGE)
    try:
        alice.use_pool(fd, address_of(mm), len(mm))
        assert alice.same_node.pool_ok == {srv.endpoint: True}
        bob.batch_set([("evil", b"E" * PAGE)])
        spec = pool_spec(fd)  # what bob may guess: all but the proof
        get = {"op": "get", "tids": ["evil"], "shm": {"offsets": [0], "sizes": [PAGE],
                                                      "until": time.monotonic() + 5}}
        for forged, why in (({**spec, "proof": "0" * 32}, "shm segment unavailable"),
                            ({k: v for k, v in spec.items() if k != "proof"},
                             "missing required field `proof`")):
            reply = bob.channels.call(srv.endpoint, {**get, "shm": {**get["shm"], "pool": forged}})[0]
            assert not reply["ok"] and why in reply["error"]
        assert mm[:PAGE] == bytes(PAGE)  # nothing written
        alice.batch_set([("mine", b"M" * PAGE)])
        assert alice.batch_get_into(["mine"], [memoryview(mm)[:PAGE]],
                                    [address_of(mm)]) == [True]
        assert mm[:PAGE] == b"M" * PAGE and alice.stats["pool_pages"] == 1
    finally:
        alice.close()
        mm.close()
        os.close(fd)


def test_keys_are_derived_per_role_and_token():
    assert server_keys(TOKEN) != client_keys(TOKEN)
    assert client_keys(TOKEN) != client_keys(OTHER)
    assert all(len(k) == 40 for pair in (server_keys(TOKEN), client_keys(TOKEN)) for k in pair)


# ---- 7: one bad item never fails another -----------------------------------------------------
def test_odd_ids_never_fail_other_clients_requests(server):
    """Ids with "/" or > 255 characters used to make the spill of an innocent client's put
    fail ("internal error"), and a NUL id every batched get that named it."""
    odd = StoreClient([server.endpoint], TOKEN)
    innocent = StoreClient([server.endpoint], TOKEN)
    try:
        odd_pages = [("x/y", b"1" * PAGE), ("z" * 300, b"2" * PAGE), ("../../p", b"3" * PAGE)]
        assert odd.batch_set(odd_pages) == 3 * PAGE
        odd.batch_set([("nul\0id", b"4" * PAGE)])  # refused on its own
        pages = _pages("i", 40)  # 8 pages of memory: the odd pages spill first
        for k in range(0, 40, 8):
            assert innocent.batch_set(pages[k:k + 8]) == 8 * PAGE
            assert innocent.last_failed == []
        assert innocent.batch_get([t for t, _ in pages]) == [d for _, d in pages]
        assert odd.batch_get([t for t, _ in odd_pages]) == [d for _, d in odd_pages]
        assert server.rejected == 1
    finally:
        odd.close()
        innocent.close()


def test_a_failing_page_write_does_not_stop_the_flush(tmp_path, monkeypatch):
    """On SIGTERM the flush used to stop at the first page it could not write (0 of 41
    saved)."""
    eng = StoreEngine(64 * PAGE, replica_fraction=0.0, ssd_dir=tmp_path / "ssd")
    pages = _pages("f", 41)
    eng.put_tensors(pages)
    real = os.replace
    failed = []

    def flaky(src, dst, *args, **kwargs):
        if not failed:
            failed.append(dst)
            raise OSError(28, "No space left on device")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", flaky)
    eng.flush_to_ssd()
    monkeypatch.setattr(os, "replace", real)
    assert failed and len(list((tmp_path / "ssd" / "pages").iterdir())) == 40
    restarted = StoreEngine(PAGE, replica_fraction=0.0, ssd_dir=tmp_path / "ssd")
    assert sum(d is not None for d in restarted.get_tensors([t for t, _ in pages])) == 40
    assert eng.stats["ssd_errors"] == 1
    assert not list((tmp_path / "ssd").rglob(".*.tmp"))  # the failed write left nothing


# ---- 8: the SSD tier and the object journal are bounded --------------------------------------
def test_the_ssd_tier_evicts_by_gdsf_and_keeps_later_spills(tmp_path):
    """A full SSD tier used to drop every later spill; now it evicts the lowest GDSF priority
    (L + frequency): the newest pages and the often-read ones stay."""
    probe = StoreEngine(PAGE, replica_fraction=0.0, ssd_dir=tmp_path / "probe")
    probe.put_tensors(_pages("p", 2))
    (spilled,) = _page_files(tmp_path / "probe")
    per_page = spilled.stat().st_size  # one spilled page, with whatever the tier adds to it
    root = tmp_path / "ssd"
    eng = StoreEngine(2 * PAGE, replica_fraction=0.0, ssd_dir=root, ssd_bytes=100 * per_page)
    eng.put_tensors([("hot", b"h" * PAGE)])
    for _ in range(50):
        eng.get_tensors(["hot"])  # read often while in memory: it keeps that value on SSD
    eng.flush_to_ssd()
    for k in range(0, 500, 10):
        eng.put_tensors(_pages(f"b{k}-", 10))
    # every page that left memory is on SSD: 501 pages, 2 still in memory; "hot" was written
    # by the flush (it aged out of memory later, already on SSD), the 498 others as evicted
    assert eng.owned.evictions == 499 and eng.stats["spills"] == 1 + 498
    files = _page_files(root)
    assert 95 <= len(files) <= 100 and sum(p.stat().st_size for p in files) <= 100 * per_page
    assert "hot" not in eng.owned and eng.has("hot")  # 51 reads: worth more than later spills
    kept = [k for k in range(0, 500, 10) for i in range(10) if eng.has(f"b{k}-{i}")]
    assert min(kept) >= 380  # the latest ~100 spilled pages
    assert eng.get_tensors(["hot"]) == [b"h" * PAGE]


def test_the_ssd_budget_is_finite_by_default_and_fits_the_filesystem(tmp_path):
    import shutil

    eng = StoreEngine(PAGE, ssd_dir=tmp_path / "ssd")
    usage = shutil.disk_usage(tmp_path)
    assert 0 < eng.ssd.budget <= min(64 << 30, usage.free)
    assert StoreEngine(PAGE, ssd_dir=tmp_path / "all", ssd_bytes=0).ssd.budget <= usage.free


def test_the_object_journal_is_compacted_and_recovers_the_live_objects(tmp_path):
    eng = StoreEngine(PAGE, ssd_dir=tmp_path)
    for i in range(1000):
        eng.put_object(f"doc{i % 5}", [f"t{i}"])
    lines = (tmp_path / "objects.jsonl").read_text().splitlines()
    assert len(lines) <= max(64, 2 * 5) + 1
    restarted = StoreEngine(PAGE, ssd_dir=tmp_path)
    assert restarted.objects == {f"doc{k}": [f"t{995 + k}"] for k in range(5)}
    capped = StoreEngine(PAGE, ssd_dir=tmp_path / "capped", max_objects=3)
    for i in range(10):
        capped.put_object(f"o{i}", [])
    assert list(capped.objects) == ["o7", "o8", "o9"]


def test_the_object_journal_is_bounded_in_bytes_within_the_ssd_budget(tmp_path):
    """Re-putting one large object used to append its whole record every time (compaction
    counted records, not bytes): 61 puts wrote 2.1 GB with ``--ssd-gb 0.01``. The journal now
    counts against the SSD budget (pages leave for it, and it takes at most a quarter), is
    rewritten by bytes, and an object whose record alone does not fit is refused, the file
    not grown."""
    root, budget, big = tmp_path / "ssd", 10 << 20, 64 << 10
    eng = StoreEngine(big, replica_fraction=0.0, ssd_dir=root, ssd_bytes=budget)
    eng.put_tensors(_pages("pg", 200, big))  # 12.5 MiB: the SSD tier is full of pages
    journal = root / "objects.jsonl"

    def disk() -> int:
        return sum(p.stat().st_size for p in _page_files(root)) + journal.stat().st_size

    ids = [f"{k:064x}" for k in range(14_000)]  # a record of ~0.95 MB
    for i in range(61):
        eng.put_object("doc", ids[: 13_000 + i])
        assert journal.stat().st_size <= budget // 4  # the journal's share of the budget
        assert disk() <= budget
    size = journal.stat().st_size
    with pytest.raises(ProtocolError, match="journal"):
        eng.put_object("huge", [f"{k:064x}" for k in range(50_000)])  # ~3.4 MB of record
    assert journal.stat().st_size == size and eng.get_object("huge") is None
    assert eng.get_object("doc") == ids[:13_060]
    restarted = StoreEngine(big, replica_fraction=0.0, ssd_dir=root, ssd_bytes=budget)
    assert restarted.objects == {"doc": ids[:13_060]}
    assert disk() <= budget


def test_an_object_too_large_for_the_journal_is_refused_over_the_wire(tmp_path):
    srv = StoreServer(StoreEngine(8 * PAGE, ssd_dir=tmp_path / "ssd", ssd_bytes=1 << 20),
                      f"ipc://{tmp_path}/j.sock", TOKEN).start()
    client = StoreClient([srv.endpoint], TOKEN)
    try:
        huge = {"op": "put_object", "key": "doc", "tids": [f"{k:064x}" for k in range(5000)]}
        reply = client.channels.call(srv.endpoint, huge)[0]  # ~340 KB of record: over 256 KiB
        assert not reply["ok"] and "journal" in reply["error"]
        small = {"op": "put_object", "key": "doc", "tids": ["a", "b"]}
        assert client.channels.call(srv.endpoint, small)[0]["ok"]
        got = client.channels.call(srv.endpoint, {"op": "get_object", "key": "doc"})[0]
        assert got["tids"] == ["a", "b"] and srv.rejected == 1
    finally:
        client.close()
        srv.stop()


def test_a_full_object_journal_is_not_rewritten_on_every_put(tmp_path, monkeypatch):
    """With the live objects' records up against the journal's share, every put_object
    rewrote the whole journal (a 16 MiB journal per put: 0.26 ms became 92 ms, with the
    server's control loop held). Live records now take at most half the share, so rewrites
    come once per half a share of appended records."""
    import sglang_pic.store.engine as engine_mod

    eng = StoreEngine(8 * PAGE, replica_fraction=0.0, ssd_dir=tmp_path / "ssd",
                      ssd_bytes=1 << 20)
    rewrites = []
    real = engine_mod.StoreEngine._compact_journal
    monkeypatch.setattr(engine_mod.StoreEngine, "_compact_journal",
                        lambda self: rewrites.append(self.journal_bytes) or real(self))
    tids = [f"{k:064x}" for k in range(14)]  # a record of ~1 KB
    appended = 0
    for i in range(2000):  # ~2 MB of records into a journal share of 256 KiB
        eng.put_object(f"doc{i}", tids)
        appended += len(engine_mod._record(f"doc{i}", tids))
        assert eng.journal_bytes <= eng.journal_limit
    assert eng.journal_live_bytes <= eng.journal_live_limit
    headroom = eng.journal_limit - eng.journal_live_limit
    assert len(rewrites) <= appended // headroom + 2, (len(rewrites), appended, headroom)
    assert eng.get_object("doc1999") == tids


def test_replies_a_client_never_reads_hold_a_bounded_share_of_memory(tmp_path):
    """A client that asks for pages and never reads its replies (they wait in the server's
    socket, each reply of pages read from SSD or copied for it new memory) used to grow the
    server without bound: three 1.5 KB gets made an 8 MiB server hold 1.4 GB. Now a tenant's
    waiting replies hold at most half the reply budget (a quarter of the memory budget, at
    least two of the largest pages), so its later gets are misses; another tenant still gets
    its pages meanwhile, and once the client goes, its tenant is served again."""
    page, n = 64 << 10, 8
    limits = Limits(max_tensor_bytes=page)
    srv = StoreServer(StoreEngine(64 * page, replica_fraction=0.0), f"ipc://{tmp_path}/r.sock",
                      {TOKEN: "alice", OTHER: "bob"}, limits).start()
    alice = StoreClient([srv.endpoint], TOKEN)
    bob = StoreClient([srv.endpoint], OTHER, server_key=srv.server_key)
    ctx = zmq.Context()
    greedy = ctx.socket(zmq.DEALER)
    try:
        pages = _pages("p", n, page)
        assert alice.batch_set(pages) == n * page and bob.batch_set(pages[:1]) == page
        assert srv.reply_budget == 2 * page * n  # a quarter of 64 pages; alice's half: 8 pages
        greedy.setsockopt(zmq.LINGER, 0)
        greedy.setsockopt(zmq.RCVHWM, 1)
        greedy.setsockopt(zmq.RCVBUF, 4096)
        secure_client(greedy, TOKEN)
        greedy.connect(srv.endpoint)
        ask = json.dumps({"op": "get", "tids": [t for t, _ in pages]}).encode()
        before = srv.requests
        for _ in range(200):
            greedy.send(ask)
        deadline = time.monotonic() + 20
        while srv.requests < before + 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = srv.status()["reply_bytes_held"]
        assert 0 < held <= srv.reply_budget // 2 + 1, held
        assert bob.batch_get(["p0"]) == [pages[0][1]]  # another tenant is served meanwhile
        found = 0
        for _ in range(200):
            assert greedy.poll(10_000)
            found += sum(json.loads(greedy.recv_multipart()[0])["found"])
        assert n <= found <= 200 * n // 10, found  # without the bound: all 1600 pages
        greedy.close(0)
        assert alice.batch_get(["p1"]) == [pages[1][1]]  # room again once they are gone
    finally:
        greedy.close(0)
        ctx.term()
        alice.close()
        bob.close()
        srv.stop()


def test_the_store_command_raises_its_open_file_limit():
    """Every connection holds a descriptor until its handshake times out: at a soft limit of
    1024, ~1,200 silent connections a second locked 9 of 12 new clients out (and the SSD
    tier out of its files). ``sglang-pic store`` raises its soft limit to the hard one."""
    code = ("import resource\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 4096))\n"
            "from sglang_pic.store.cli import _raise_open_files\n"
            "print(_raise_open_files(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["4096", "4096"]


def test_a_damaged_object_journal_is_skipped_line_by_line_at_start(tmp_path, caplog):
    """A byte of bad UTF-8, an integer of 5000 digits or nesting past the parser's stack in
    ``objects.jsonl`` used to stop the store from starting; now each damaged line is skipped,
    counted in one warning, and the journal is rewritten without them (a torn last line
    would otherwise swallow the next record appended)."""
    root = tmp_path / "ssd"
    root.mkdir()

    def record(key: str, tids: list[str]) -> bytes:
        return json.dumps({"object": key, "tids": tids}).encode() + b"\n"

    (root / "objects.jsonl").write_bytes(b"".join([
        record("a", ["t1"]),
        b'{"object": "bad-utf8", "tids": ["\xff\xfe"]}\n',
        b'{"object": "digits", "tids": [' + b"9" * 5000 + b"]}\n",
        b"[" * 100_000 + b"\n",
        b'{"object": 5, "tids": []}\n',
        b'"a string"\n',
        record("b", ["t2", "t3"]),
        b'{"object": "torn", "ti',
    ]))
    with caplog.at_level("WARNING", logger="sglang_pic.store.engine"):
        eng = StoreEngine(PAGE, ssd_dir=root)
    assert eng.objects == {"a": ["t1"], "b": ["t2", "t3"]}
    warnings = [r.getMessage() for r in caplog.records if "journal" in r.getMessage()]
    assert len(warnings) == 1 and "6 damaged" in warnings[0], warnings
    eng.put_object("c", ["t4"])
    restarted = StoreEngine(PAGE, ssd_dir=root)
    assert restarted.objects == {"a": ["t1"], "b": ["t2", "t3"], "c": ["t4"]}


def test_stalled_data_plane_uploads_are_bounded_by_the_memory_budget(tmp_path):
    """A store of 0.1 GB used to hold 3.1 GB of stalled uploads (a fixed 16 GiB for buffers
    of outstanding transfers): what they reserve is now at most a quarter of the memory
    budget, whether their tickets are never redeemed or their streams stall half-way."""
    memory, page = 1 << 20, 64 << 10
    srv = StoreServer(StoreEngine(memory), f"tcp://127.0.0.1:{free_port()}", TOKEN).start()
    client = StoreClient([srv.endpoint], TOKEN, data_plane="tcp")

    def ask(i: int) -> dict | None:
        reply = client.channels.call(srv.endpoint, {
            "op": "put", "tids": [f"u{i}-{k}" for k in range(4)], "sums": [0] * 4,
            "tcp": {"streams": 1, "lengths": [page] * 4}})[0]
        assert reply["ok"]
        return reply["tcp"]

    try:
        offers = [ask(i) for i in range(16)]  # 16 x 256 KiB, never sent
        assert sum(o is not None for o in offers) == 1
        assert srv.data._pending_bytes <= memory // 4
        with socket.create_connection(("127.0.0.1", srv.data.port), timeout=15) as raw:
            raw.sendall(bytes.fromhex(offers[0]["tickets"][0]) + b"x" * 1000)  # then stalls
            time.sleep(0.3)
            assert [ask(i) for i in range(16, 20)] == [None] * 4
            assert srv.data._pending_bytes <= memory // 4
    finally:
        client.close()
        srv.stop()


def test_a_tenant_writing_many_objects_drops_its_own_first(two_tenants):
    """The objects' count and memory budgets are the server's: past either, the tenant holding
    the most bytes of objects loses its oldest, so alice's flood of objects (or of ids in
    them) does not evict bob's index."""
    srv, alice, bob = two_tenants
    eng = srv.engine
    eng.max_objects, eng.max_object_bytes = 50, 100_000

    def put(client, key, tids):
        assert client.channels.call(srv.endpoint, {"op": "put_object", "key": key, "tids": tids})[0]["ok"]

    def get(client, key):
        return client.channels.call(srv.endpoint, {"op": "get_object", "key": key})[0]["tids"]

    put(bob, "index", ["b1", "b2"])
    for i in range(200):
        put(alice, f"doc{i}", [f"t{i}"])
    assert get(bob, "index") == ["b1", "b2"]
    assert len(eng.objects) == 50 and get(alice, "doc199") == ["t199"]
    assert get(alice, "doc0") is None  # alice's oldest went
    for i in range(3):  # objects of many ids: the bytes bound, again alice's own
        put(alice, f"big{i}", [f"{k:064d}" for k in range(400)])
    assert get(bob, "index") == ["b1", "b2"]
    assert eng.object_bytes <= eng.max_object_bytes


# ---- 9: secrets are compared in constant time ----------------------------------------------
def test_a_tenant_cannot_have_a_server_write_into_another_tenants_segment(two_tenants):
    """A staging segment's name is visible to anyone on the node (``/dev/shm``): a get into it
    must also carry the nonce in its first bytes, which only processes that can read the
    segment know; the server writes nothing for a get without it or with another."""
    from sglang_pic.store.shm import DATA_OFFSET, ClientSegment

    srv, alice, bob = two_tenants
    seg = ClientSegment(4 * PAGE)
    try:
        bob.batch_set([("evil", b"E" * PAGE)])
        get = {"op": "get", "tids": ["evil"],
               "shm": {"name": seg.name, "offsets": [DATA_OFFSET], "sizes": [PAGE]}}
        for shm, why in ((get["shm"], "nonce"),
                         ({**get["shm"], "nonce": "0" * 32}, "shm segment unavailable")):
            reply = bob.channels.call(srv.endpoint, {**get, "shm": shm})[0]
            assert not reply["ok"] and why in reply["error"]
        assert seg.mm[DATA_OFFSET:DATA_OFFSET + PAGE] == bytes(PAGE)  # nothing written
        # the owner's own get, with the nonce, is served
        reply = bob.channels.call(srv.endpoint, {**get, "shm": {**get["shm"],
                                                        "nonce": seg.nonce.hex()}})[0]
        assert reply["ok"] and reply["found"] == [True]
    finally:
        seg.close()


def test_a_second_name_of_a_segment_is_not_mapped(server):
    """Only a reader's own segment file: a hard link to it (another name, the same file) is
    refused, as is anything not a regular file of the server's user."""
    import uuid

    from sglang_pic.store.shm import PREFIX, SHM_DIR, ClientSegment

    seg = ClientSegment(4 * PAGE)
    alias = SHM_DIR / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    os.link(SHM_DIR / seg.name, alias)
    try:
        with pytest.raises(ValueError, match="user"):
            server.segments.mapping(alias.name)
        with pytest.raises(ValueError, match="user"):
            server.segments.mapping(seg.name)  # two links now: neither name is mapped
    finally:
        alias.unlink()
        seg.close()


def test_a_pool_is_not_mapped_for_a_request_without_its_proof(tmp_path):
    from sglang_pic.store.shm import pool_spec

    srv = StoreServer(StoreEngine(8 * PAGE), f"ipc://{tmp_path}/p.sock", TOKEN)
    fd = os.memfd_create("ptstore-test-pool")
    os.ftruncate(fd, 2 * PAGE)
    try:
        spec = pool_spec(fd)
        with pytest.raises(ValueError, match="proof"):
            srv.segments.mapping({**spec, "proof": "0" * 32})
        assert srv.segments.pools == {}  # nothing mapped, nothing kept
    finally:
        os.close(fd)
        srv.stop()


def test_the_shm_nonce_is_compared_in_constant_time(server, monkeypatch):
    import hmac

    from sglang_pic.store.shm import ClientSegment

    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(len(b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    seg = ClientSegment(4 * PAGE)
    client = StoreClient([server.endpoint], TOKEN)
    try:
        assert client.same_node.near([server.endpoint], seg) == {server.endpoint}
        assert calls == [16]
    finally:
        client.close()
        seg.close()


# ---- the same-node pool path stays closed without authentication --------------------------
def test_an_insecure_server_writes_into_no_pool(tmp_path):
    srv = StoreServer(StoreEngine(4 * PAGE), f"ipc://{tmp_path}/open.sock", None).start()
    client = StoreClient([srv.endpoint], None)
    try:
        fd = os.memfd_create("ptstore-test-pool")
        os.ftruncate(fd, PAGE)
        client.use_pool(fd, 0, PAGE)
        assert client.same_node.pool_ok == {srv.endpoint: False}
        os.close(fd)
    finally:
        client.close()
        srv.stop()


# ---- 10: the TCP data plane (issue 25) ---------------------------------------------------
def _tcp_server(tokens, **config) -> StoreServer:
    from sglang_pic.store.datapath import DataPlaneConfig

    return StoreServer(StoreEngine(64 * PAGE), f"tcp://127.0.0.1:{free_port()}", tokens,
                       data_plane=DataPlaneConfig(**config)).start()


def test_the_data_listener_binds_the_control_endpoints_host_only(tmp_path):
    """Loopback by default (as the control endpoint); a server on an ipc:// endpoint opens no
    TCP port at all."""
    srv = _tcp_server(TOKEN)
    ipc = StoreServer(StoreEngine(4 * PAGE), f"ipc://{tmp_path}/d.sock", TOKEN).start()
    try:
        assert srv.data.sock.getsockname()[0] == "127.0.0.1"
        assert ipc.data is None
    finally:
        srv.stop()
        ipc.stop()


def test_data_plane_tickets_need_the_token_and_the_tenant(tmp_path):
    """Tickets are handed out over CURVE only: a client of an unknown token gets no ticket, and
    a tenant's get names its own pages only, so its tickets open none of another tenant's."""
    srv = _tcp_server({TOKEN: "alice", OTHER: "bob"})
    alice = StoreClient([srv.endpoint], TOKEN, data_plane="tcp")
    bob = StoreClient([srv.endpoint], OTHER, data_plane="tcp", server_key=srv.server_key)
    stranger = StoreClient([srv.endpoint], "security-test-token-mallory-0", timeout_ms=300,
                           data_plane="tcp", server_key=srv.server_key)
    try:
        assert alice.batch_set([("x", b"A" * PAGE)]) == PAGE
        assert alice.batch_get(["x"]) == [b"A" * PAGE]
        offers = srv.data.stats["offers"]
        assert stranger.batch_get(["x"]) == [None]
        assert bob.batch_get(["x"]) == [None]
        assert srv.data.stats["offers"] == offers + 1  # bob's: an offer of no page
        deadline = time.monotonic() + 10  # counted by the server's thread once it has sent
        while srv.data.stats["stream_bytes"] < PAGE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.data.stats["stream_bytes"] == PAGE  # alice's page, once
    finally:
        for c in (alice, bob, stranger):
            c.close()
        srv.stop()


def test_a_data_connection_without_a_ticket_is_dropped_without_a_byte():
    srv = _tcp_server(TOKEN, io_timeout_s=1.0)
    try:
        with socket.create_connection(("127.0.0.1", srv.data.port), timeout=15) as raw:
            t0 = time.monotonic()
            assert raw.recv(4096) == b""  # nothing sent, then closed
            assert time.monotonic() - t0 < 10
        with socket.create_connection(("127.0.0.1", srv.data.port), timeout=15) as raw:
            raw.sendall(os.urandom(32))  # a guessed ticket
            assert raw.recv(4096) == b""
        deadline = time.monotonic() + 10  # the silent one is shut first, then counted
        while srv.data.stats["refused"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.data.stats["refused"] == 2 and srv.data.stats["streams"] == 0
    finally:
        srv.stop()


def test_a_data_connection_trickling_its_ticket_is_closed_at_the_deadline():
    """A byte every 0.3 s restarts no timeout: the handshake and the ticket share one deadline
    (io_timeout_s after the connection was accepted), so a trickling peer cannot hold one of
    the few connection slots."""
    srv = _tcp_server(TOKEN, io_timeout_s=1.0)
    try:
        with socket.create_connection(("127.0.0.1", srv.data.port), timeout=15) as raw:
            t0 = time.monotonic()
            closed = False
            for _ in range(20):  # 6 s of trickling if nothing stopped it
                try:
                    raw.sendall(b"x")
                except OSError:
                    closed = True
                    break
                ready, _, _ = select.select([raw], [], [], 0.3)
                if ready and raw.recv(4096) == b"":
                    closed = True
                    break
            assert closed and time.monotonic() - t0 < 3.0
        deadline = time.monotonic() + 10  # counted by the server's thread after it shut
        while srv.data.stats["refused"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.data.stats["refused"] == 1 and srv.data.stats["streams"] == 0
    finally:
        srv.stop()


def test_data_plane_tickets_are_compared_in_constant_time(monkeypatch):
    from sglang_pic.store import datapath

    calls = []
    real = datapath.hmac.compare_digest

    def counting(a, b):
        calls.append(len(b))
        return real(a, b)

    monkeypatch.setattr(datapath.hmac, "compare_digest", counting)
    srv = _tcp_server(TOKEN)
    client = StoreClient([srv.endpoint], TOKEN, data_plane="tcp", data_streams=1)
    try:
        client.batch_set([("p", b"p" * PAGE)])
        assert client.batch_get(["p"]) == [b"p" * PAGE]
        assert calls == [datapath.TICKET_BYTES - datapath.SLOT_BYTES]  # the secret part
    finally:
        client.close()
        srv.stop()


def test_a_refused_handshake_gives_misses_and_never_blocks_a_send(server):
    """A DEALER blocks a send while it has no peer, and a server refusing our CURVE key leaves
    the socket without one: the client bounds each send by its time-out (a miss), so a wrong
    key, or a server gone, never hangs the caller (it once hung this suite)."""

    wrong = StoreClient([server.endpoint], OTHER, timeout_ms=300, server_key=server.server_key)
    results: list = []

    def calls():
        wrong.channels.sock(server.endpoint)  # connect, and let the handshake fail before any send
        time.sleep(1.0)
        results.append(wrong.batch_set(_pages("w", 1)))
        results.append(wrong.batch_get(["p0"]))

    worker = threading.Thread(target=calls, daemon=True)
    worker.start()
    worker.join(timeout=20)
    # a blocked thread keeps its socket: closing it under the thread would abort the process
    assert not worker.is_alive(), "a send to a server refusing the key blocked"
    wrong.close()
    assert results == [0, [None]]


# ---- 11: the CLI refuses every bad value in one line ---------------------------------------
BAD_STORE_VALUES = [
    *[("--memory-gb", v) for v in ("-1", "0", "nan", "inf", "-inf", "1e30", "1e-12", "x", "")],
    *[("--replica-fraction", v) for v in ("-0.1", "1", "nan", "inf", "1e300", "x")],
    *[("--ssd-gb", v) for v in ("-1", "nan", "inf", "-inf", "1e300", "1e-12", "x")],
    *[("--max-tensor-mb", v) for v in ("0", "-1", "nan", "inf", "1e20", "x")],
    *[("--copy-threads", v) for v in ("0", "-1", "1e3", "2.5", "100000", "9" * 400, "x")],
    *[("--data-port", v) for v in ("-1", "65536", "nan", "1e9", "x")],
    *[("--endpoint", v) for v in ("garbage", "tcp://127.0.0.1:99999", "tcp://127.0.0.1:x",
                                  "tcp://:7400", "ipc://", "inproc://x")],
]


def test_every_bad_store_value_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """``sglang-pic store`` used to start with a negative memory or SSD budget or a page limit
    of 0, and to print a traceback for nan, inf, a huge number, a bad endpoint or SSD folder.
    Now every value is checked before anything starts, and a bad one is one line on stderr
    (``sglang-pic store: error: ...`` naming the flag), exit status 2."""
    from sglang_pic.store import cli, server

    real_server = server.StoreServer

    class Started(Exception):
        pass

    def fake_server(*args, **kwargs):
        raise Started

    monkeypatch.setattr(server, "StoreServer", fake_server)
    monkeypatch.setenv(STORE_TOKEN_ENV, TOKEN)

    def run(main, argv: list[str]) -> tuple[int, list[str]]:
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        return code, capsys.readouterr().err.strip().splitlines()

    not_pem = tmp_path / "not-pem"
    not_pem.write_text("not a certificate\n")
    cases = [[f"{flag}={value}"] for flag, value in BAD_STORE_VALUES] + [
        ["--ssd-dir", str(not_pem)],  # a file, not a folder
        ["--data-tls-cert", str(not_pem), "--data-tls-key", str(not_pem)],
        ["--data-tls-cert", str(tmp_path / "absent"), "--data-tls-key", str(not_pem)],
    ]
    for argv in cases:
        code, lines = run(cli.serve, ["--memory-gb", "0.01", *argv])
        assert code == 2 and len(lines) == 1, (argv, lines)
        assert lines[0].startswith("sglang-pic store: error: ") and argv[0].split("=")[0] \
            in lines[0], (argv, lines)
    with pytest.raises(Started):  # the edges of every range are accepted
        cli.serve(["--memory-gb", "0.001", "--ssd-gb", "0", "--replica-fraction", "0",
                   "--max-tensor-mb", "1024", "--copy-threads", "256", "--data-port", "65535",
                   "--endpoint", "tcp://127.0.0.1:*"])
    for argv in (["garbage"], ["tcp://127.0.0.1:*"], ["ipc://"],
                 ["tcp://127.0.0.1:1", "--server-key", "xyz"],
                 ["tcp://127.0.0.1:1", "--server-key", "~" * 40]):
        code, lines = run(cli.status, argv)
        assert code == 2 and len(lines) == 1, (argv, lines)
        assert lines[0].startswith("sglang-pic store-status: error: "), (argv, lines)

    monkeypatch.setattr(server, "StoreServer", real_server)
    holder = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        code, lines = run(cli.serve, ["--memory-gb", "0.01", "--endpoint",
                                      f"tcp://127.0.0.1:{port}"])
        assert code == 2 and len(lines) == 1 and "cannot serve" in lines[0], lines
    finally:
        holder.close(0)
    out = _store_cli(["--memory-gb", "nan"], env_token=TOKEN)  # the real command: no traceback
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("sglang-pic store: error: argument --memory-gb")
