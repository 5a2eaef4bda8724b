"""Shared fixtures: one real sglang-pic server (SmolLM2-135M on CPU) for the whole suite.

Starting a server costs ~25 s on 2 cores, so the suite shares one (session scope); modules that
need other server flags start their own with `start_server`. Every wait is bounded, so a dead
scheduler fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from sglang_pic.cpu_support import has_cuda

REPO = Path(__file__).resolve().parent.parent
if not has_cuda():
    # Triton kernels bind the interpreter when first decorated, which may happen while any test
    # module is collected (store and HiCache modules import SGLang's kernels): set it before all
    # of them. The CPU engine sets the same for its servers (sglang_pic.cpu_support).
    os.environ.setdefault("TRITON_INTERPRET", "1")
START_TIMEOUT_S = 240
# HiCache on the CPU engine (see docs/cpu.md): a host tier of 4x the device pool (tens of MB, not
# a fixed GB a busy machine may not have free), direct I/O, layer-first layout
HICACHE_CPU_FLAGS = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct",
                     "--hicache-mem-layout", "layer_first", "--hicache-ratio", "4"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU machines)")


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def wait_for_host_memory(gb: float, wait_s: float = 180.0) -> None:
    """Skip (with the numbers) unless SGLang's HiCache can allocate a ``gb`` host tier here.

    SGLang refuses a host tier unless the host keeps 10 GiB available beside it
    (``HICACHE_HOST_MEMORY_RESERVE_BYTES``); with both test workers' servers up, a 24 GiB machine
    can dip below that for a while, so wait for the other worker's servers to go first."""
    import psutil
    from sglang.srt.mem_cache.pool_host.base import HICACHE_HOST_MEMORY_RESERVE_BYTES

    need = HICACHE_HOST_MEMORY_RESERVE_BYTES + int(gb * (1 << 30))
    deadline = time.time() + wait_s
    while (avail := psutil.virtual_memory().available) < need:
        if time.time() > deadline:
            pytest.skip(f"HiCache needs {need / (1 << 30):.1f} GiB available (SGLang's 10 GiB "
                        f"reserve + the tier); this host has {avail / (1 << 30):.1f} GiB")
        time.sleep(2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def post(self, path: str, timeout: float = 120, **kwargs) -> requests.Response:
        return requests.post(self.url + path, timeout=timeout, **kwargs)

    def generate_text(self, text: str, max_new_tokens: int = 8) -> dict:
        """Greedy ``/generate`` of ``text``; asserts HTTP 200 and returns the JSON answer."""
        r = self.post("/generate", json={"text": text, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0}})
        assert r.status_code == 200, r.text
        return r.json()

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=30).status_code == 200
        except requests.RequestException:
            return False


def start_server(args: list[str], log: Path, attempts: int = 3,
                 timeout_s: float = START_TIMEOUT_S) -> Server:
    """Start `sglang-pic serve` on a free port and wait until /health answers; retried on a new
    port when another process took the chosen one in between (free_port cannot reserve it)."""
    for attempt in range(attempts):
        try:
            return _start_server_once(args, log, timeout_s)
        except RuntimeError as e:
            if "address already in use" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def start_servers(specs: dict[str, tuple[list[str], Path]],
                  timeout_s: float = START_TIMEOUT_S) -> dict[str, Server]:
    """Start several servers at once (``name -> (args, log)``): most of a start is waiting on
    the model load and the warm-up request, so starts overlap well even on 2 cores. A failed
    start stops the others and raises its error."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(start_server, args, log, timeout_s=timeout_s)
                   for name, (args, log) in specs.items()}
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    if len(started) < len(specs):
        for srv in started.values():
            stop_server(srv)
        next(f for f in futures.values() if f.exception() is not None).result()
    return started


def _start_server_once(args: list[str], log: Path, timeout_s: float) -> Server:
    """Start `sglang-pic serve` on a free port and wait until /health answers.

    Test servers run torch with one thread: the suite keeps two or three servers up at once on a
    2-core machine, and SGLang's CPU scheduler polls a core while idle, so multi-threaded torch
    ops would fight them for cores (measured: ~15 s per short request instead of ~1 s).
    """
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_pic", "serve", "--port", str(port), *args]
    out = open(log, "w")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("SGLANG_PIC_TEST_THREADS", "1"))
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:]
            if "Not enough host memory available" in tail:  # SGLang's HiCache reserve check
                pytest.skip("HiCache host tier refused by SGLang's 10 GiB host reserve (the other "
                            "test worker's servers hold the memory): "
                            + tail[tail.index("Not enough host memory"):].splitlines()[0])
            raise RuntimeError(f"server exited with {proc.returncode}; log:\n{tail}")
        if "address already in use" in log.read_text(errors="replace")[-2000:]:
            stop_server(server)
            raise RuntimeError(f"port {port}: address already in use")
        if server.healthy():
            return server
        time.sleep(2)
    stop_server(server)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; log:\n{log.read_text()[-4000:]}")


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server(["--max-total-tokens", "16384"], log)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from sglang_pic.default_model import ensure_default_model

    return ensure_default_model()
