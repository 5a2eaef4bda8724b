"""``sglang-pic fleet`` on CPU: 2 PTStore servers, 2 instances and SGLang's router in front.

One fleet is started for the module (the command as a user runs it, in a process of its own)
with the router's ``round_robin`` policy, so that two requests in a row go to the two instances.
The tests run in file order against it, each leaving the fleet as the next one needs it:

1. a document computed through one instance is a store hit through the other, same tokens;
2. a store killed: the instances recompute what it held, same tokens;
3. an instance killed mid-load: every request succeeds (the router retries those in flight on the
   other instance), and the other keeps serving;
4. SIGTERM: the fleet drains and stops, and no process of it is left.

Bad flags are refused in one line before anything starts (no fleet needed).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests
from conftest import START_TIMEOUT_S, free_port, start_slot, wait_for_host_memory
from sglang_pic.fleet import config, router
from sglang_pic.security import api_key

INSTANCE_ARGS = ["--max-total-tokens", "2048", "--page-size", "16", "--hicache-ratio", "4",
                 "--hicache-storage-prefetch-policy", "wait_complete"]
"""Small KV pools (a small HiCache host pool too), pages of 16 tokens; a request waits for its
storage prefetch, so a store hit shows in its own answer."""
LONG = "The history of the Roman Empire spans many centuries of conquest. " * 32
"""~390 tokens: SGLang prefetches storage hits of at least 256 tokens only."""
OTHER_LONG = "A survey of medieval trade routes across the Mediterranean sea. " * 32
TENSORS_PER_PAGE = 2 * 30
"""K and V of each of SmolLM2's 30 layers: what a page of HiCache's layer-first host pool puts."""


@dataclass
class Fleet:
    proc: subprocess.Popen
    output: Path
    state: dict
    key: str

    @property
    def admin_key(self) -> str:
        """The router's admin key (its control plane), which the fleet keeps for itself."""
        return Path(self.state["router_admin_key_file"]).read_text().strip()

    @property
    def url(self) -> str:
        return self.state["router"]["address"]

    def generate(self, text: str, max_new_tokens: int = 8) -> requests.Response:
        return requests.post(self.url + "/generate", timeout=120,
                             headers={"Authorization": f"Bearer {self.key}"},
                             json={"text": text, "sampling_params": {
                                 "max_new_tokens": max_new_tokens, "temperature": 0}})

    def printed(self) -> str:
        return self.output.read_text(errors="replace")


def _fleet_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sglang_pic", "fleet", *args]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Fleet:
    wait_for_host_memory(1.0)  # SGLang's HiCache reserve check, once per instance
    logs = tmp_path_factory.mktemp("fleet")
    output = logs / "fleet.out"
    cmd = _fleet_cmd(
        "--instances", "2", "--stores", "2", "--policy", "round_robin",
        "--port", str(free_port()),
        "--instance-ports", f"{free_port()},{free_port()}",
        "--store-ports", f"{free_port()},{free_port()}",
        "--store-memory-gb", "0.25", "--log-dir", str(logs / "children"), *INSTANCE_ARGS)
    # two servers start: two of the run's start slots (conftest.start_slot)
    with start_slot(), start_slot(), open(output, "w") as out:
        env = {k: v for k, v in os.environ.items() if k != api_key.ENV}  # a generated key
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
        deadline = time.time() + START_TIMEOUT_S
        while "ready in" not in output.read_text(errors="replace"):
            assert proc.poll() is None, f"fleet exited {proc.returncode}:\n{output.read_text()}"
            assert time.time() < deadline, f"fleet not ready:\n{output.read_text()}"
            time.sleep(0.5)
    state = json.loads((logs / "children" / "fleet.json").read_text())
    key = Path(state["api_key"]).read_text().strip()
    yield Fleet(proc, output, state, key)
    if proc.poll() is None:  # a test failed before the SIGTERM test
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _owned_tensors(fleet: Fleet) -> int:
    """Tensors the fleet's live store servers own, from their status (with the fleet's token)."""
    from sglang_pic.store.auth import client_token
    from sglang_pic.store.client import StoreClient

    endpoints = [s["address"] for s in fleet.state["stores"]]
    client = StoreClient(endpoints, client_token(fleet.state["store_token_file"], ""),
                         timeout_ms=2000)
    try:
        return sum((client.status(ep) or {}).get("owned_tensors", 0) for ep in endpoints)
    finally:
        client.close()


def _printed_soon(fleet: Fleet, pattern: str, within_s: float = 10.0) -> bool:
    """Whether the fleet prints a line matching ``pattern`` within ``within_s`` (it checks its
    children twice a second)."""
    deadline = time.time() + within_s
    while not re.search(pattern, fleet.printed()):
        if time.time() > deadline:
            return False
        time.sleep(0.2)
    return True


def _storage_tokens(answer: dict) -> int:
    return (answer["meta_info"].get("cached_tokens_details") or {}).get("storage", 0)


def test_a_document_computed_through_one_instance_is_a_store_hit_through_the_other(fleet):
    # the summary names every port, the key file and each child's log
    printed = fleet.printed()
    for child in [fleet.state["router"], *fleet.state["instances"], *fleet.state["stores"]]:
        assert child["address"] in printed and child["log"] in printed
    assert fleet.state["api_key"] in printed
    assert requests.post(fleet.url + "/generate", json={"text": "hi"}, timeout=30).status_code \
        == 401  # the router checks the key

    r = fleet.generate(LONG)  # round robin: instance A computes it
    assert r.status_code == 200, r.text
    first = r.json()
    assert _storage_tokens(first) == 0
    pages = first["meta_info"]["prompt_tokens"] // 16
    deadline = time.time() + 60  # A's write-through to the stores is asynchronous
    while time.time() < deadline and _owned_tensors(fleet) < pages * TENSORS_PER_PAGE:
        time.sleep(0.5)
    assert _owned_tensors(fleet) >= pages * TENSORS_PER_PAGE

    r = fleet.generate(LONG)  # round robin: instance B, which has never seen it
    assert r.status_code == 200, r.text
    second = r.json()
    assert _storage_tokens(second) >= 256, second["meta_info"]
    assert second["output_ids"] == first["output_ids"]


def test_a_dead_store_means_recompute_with_the_same_tokens(fleet):
    store = fleet.state["stores"][0]
    os.kill(store["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    r = fleet.generate(OTHER_LONG)  # one instance computes it (its lookups miss)
    assert r.status_code == 200, r.text
    first = r.json()
    r = fleet.generate(OTHER_LONG)  # the other: what the dead store owned is recomputed
    assert r.status_code == 200, r.text
    second = r.json()
    assert second["output_ids"] == first["output_ids"]
    assert _storage_tokens(second) < second["meta_info"]["prompt_tokens"] - 16
    assert time.monotonic() - t0 < 90  # a dead store costs time-outs, not a hang
    assert _printed_soon(fleet, r"WARNING: store 0 .* exited \(killed by SIGKILL\)")
    assert fleet.proc.poll() is None


def test_killing_an_instance_mid_load_loses_no_request(fleet):
    victim = fleet.state["instances"][0]
    root = psutil.Process(victim["pid"])
    tree = [root, *root.children(recursive=True)]  # launcher, server, scheduler, detokenizer
    with ThreadPoolExecutor(14) as pool:
        first = [pool.submit(fleet.generate, f"Request {i}: tell a story about the number {i}.",
                             32) for i in range(8)]
        time.sleep(1.0)  # both instances busy (round robin)
        assert not all(f.done() for f in first), "the load ended before the kill"
        for p in tree:
            p.kill()
        then = [pool.submit(fleet.generate, f"Request {i}: count to {i}.", 8)
                for i in range(6)]
        answers = [f.result() for f in first + then]
    assert [a.status_code for a in answers] == [200] * len(answers), \
        [a.text for a in answers if a.status_code != 200]
    assert _printed_soon(fleet, r"WARNING: instance 0 .* exited")
    assert fleet.proc.poll() is None
    # the other instance keeps serving, alone in the router's rotation
    assert fleet.generate("One more question: what is two plus two?").status_code == 200
    survivor = fleet.state["instances"][1]["address"]
    assert router.healthy_workers(fleet.url, fleet.admin_key) == {survivor}


def test_the_router_control_plane_takes_its_admin_key_only(fleet):
    """The clients' key does not manage the router's workers: with it a client could add a
    worker of its own (and receive other clients' prompts) or remove the fleet's instances."""
    url, client = fleet.url + "/workers", {"Authorization": f"Bearer {fleet.key}"}
    for method, body in (("GET", None), ("POST", {"url": "http://127.0.0.1:9"})):
        r = requests.request(method, url, headers=client, json=body, timeout=10)
        assert r.status_code in (401, 403), (method, r.status_code, r.text)
    # the survivor of the test before, and not the worker the client tried to add
    assert [w["url"] for w in router.workers(fleet.url, fleet.admin_key)] == [
        fleet.state["instances"][1]["address"]]
    assert Path(fleet.state["router_admin_key_file"]).stat().st_mode & 0o077 == 0
    # the instances' body limit holds at the router (its own default is 512 MB)
    big = requests.post(fleet.url + "/generate", headers=client, timeout=30,
                        data=b'{"text": "' + b"a" * (17 << 20) + b'"}')
    assert big.status_code == 413, big.status_code


def test_sigterm_drains_and_stops_everything(fleet):
    tree = psutil.Process(fleet.proc.pid).children(recursive=True)
    assert len(tree) >= 4  # router, an instance's launcher, server and scheduler, a store
    fleet.proc.send_signal(signal.SIGTERM)
    assert fleet.proc.wait(timeout=120) == 0, fleet.printed()[-3000:]
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, [p.info for p in alive]
    assert "[fleet] stopped" in fleet.printed()
    assert not Path(fleet.state["store_token_file"]).exists()
    assert not Path(fleet.state["router_admin_key_file"]).exists()
    port = int(fleet.url.rsplit(":", 1)[1])
    assert not api_key.port_taken("127.0.0.1", port)


# ---- refusals: one line, exit status 2, nothing started -------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["--instances", "0"], "--instances: 0 is out of range"),
    (["--policy", "fastest"], "--policy: invalid choice"),
    (["--ptstore", "tcp://127.0.0.1:7400"], "--ptstore: the fleet starts the stores"),
    (["--api-key", "k" * 32], "--api-key: a key on the command line"),
    (["--insecure"], "--insecure: a fleet always has an API key"),
    (["--max-total-tokenz", "5"], "did you mean --max-total-tokens?"),
    (["--page-size", "0"], "--page-size: 0 is below 1"),
    (["--instance-ports", "40001"], "--instance-ports: 1 ports for 2 instances"),
    (["--router-args", "--port 1 "], "--router-args --port: use the fleet's --port"),
    (["--router-args=--health-check-interval-secs=x"], "--router-args: "
                                                       "--health-check-interval-secs: invalid"),
    (["--store-memory-gb", "100000"], "--store-memory-gb: 100000 GB is not in"),
    (["--gpu-per-instance", "--base-gpu-id", "1"], "--base-gpu-id: with --gpu-per-instance"),
    (["--gpu-per-instance"], "--gpu-per-instance: no GPU in this process"),
])
def test_bad_flags_are_refused_in_one_line_before_anything_starts(args, needle, tmp_path):
    out = subprocess.run(_fleet_cmd("--log-dir", str(tmp_path / "logs"), *args),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert out.stderr.count("\n") == 1 and needle in out.stderr, out.stderr
    assert out.stderr.startswith("sglang-pic fleet: error: ")
    assert not (tmp_path / "logs").exists()


def test_a_port_in_use_is_refused(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(_fleet_cmd("--port", str(port), "--log-dir", str(tmp_path / "l")),
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"port {port} is in use" in out.stderr, out.stderr


def test_the_router_command_line():
    """Loopback binds (the router's defaults are 0.0.0.0), the policies the router takes, and
    no key among the arguments."""
    argv = router.router_argv("127.0.0.1", 30000, "cache_aware", ["http://127.0.0.1:1"], 29001,
                              ["--health-check-interval-secs", "5"])
    args = router.parse_router_args(argv)
    assert (args.host, args.port, args.policy) == ("127.0.0.1", 30000, "cache_aware")
    assert (args.prometheus_host, args.prometheus_port) == ("127.0.0.1", 29001)
    assert args.worker_urls == ["http://127.0.0.1:1"] and args.api_key is None
    assert args.health_check_interval_secs == 5
    # the front door's default bounds: 16 MB bodies, 1024 connections an instance
    assert (args.max_payload_size, args.max_concurrent_requests) == (16 << 20, 1024)
    argv = router.router_argv("127.0.0.1", 30000, "cache_aware", ["http://127.0.0.1:1"] * 2,
                              29001, ["--max-payload-size", "1000"], max_request_mb=2,
                              max_connections=64)
    args = router.parse_router_args(argv)
    assert (args.max_payload_size, args.max_concurrent_requests) == (1000, 128)
    policy = next(a for a in router.parser()._actions if "--policy" in a.option_strings)
    assert set(config.POLICIES) == set(policy.choices)


def test_instances_sharing_a_gpu_start_one_after_another_and_the_router_knows_them_all():
    """On one GPU SGLang sizes an instance's pool from the memory free around its weight load, so
    the instances start one by one; the router, started beside the first, is given every
    instance's URL, not only those already started."""
    from sglang_pic.fleet.cli import Fleet

    fleet = Fleet(config.parse(["--instances", "3", "--stores", "0"]))
    assert not fleet.shares_one_gpu  # on CPU: all at once
    fleet.on_gpu = True
    assert fleet.shares_one_gpu
    fleet.config = config.parse(["--instances", "3", "--stores", "0", "--gpu-per-instance"])
    assert not fleet.shares_one_gpu
    child = fleet.router_child()
    urls = [f"http://127.0.0.1:{p}" for p in fleet.config.instance_ports]
    assert len(urls) == 3 and all(u in child.cmd for u in urls), child.cmd


def test_the_manual_policy_assigns_new_keys_to_the_instance_with_fewest():
    argv = router.router_argv("127.0.0.1", 30000, "manual", ["http://127.0.0.1:1"], 29001, [])
    assert router.parse_router_args(argv).assignment_mode == "min_group"
    argv = router.router_argv("127.0.0.1", 30000, "manual", ["http://127.0.0.1:1"], 29001,
                              ["--assignment-mode", "random"])
    assert router.parse_router_args(argv).assignment_mode == "random"
    argv = router.router_argv("127.0.0.1", 30000, "cache_aware", ["http://127.0.0.1:1"], 29001,
                              [])
    assert "--assignment-mode" not in argv
