"""RAG through a fleet behind SGLang's router: vanilla SGLang instances with the router's
cache-aware policy against an sglang-pic fleet (span caching, PTStore) with the same router.

Sides, each started and stopped by this script, vanilla first (it sets the stream's rate):

* ``vanilla``: N ``python3 -m sglang.launch_server`` on FlashInfer and
  ``sglang_router.launch_router --policy cache_aware`` (loopback, no key); a request's documents
  sorted, no markers, as a careful user would send them to share prefixes. On the CPU smoke run
  its stand-in is ``sglang-pic fleet`` without spans or stores (SGLang needs our CPU support).
* ``sglang-pic``: ``sglang-pic fleet --instances N --stores M --policy cache_aware
  --enable-span-cache``: each document a span.
* ``sglang-pic-nostore``: the same fleet without stores (``--stores 0``): what the span tier's
  saves and loads cost or gain.
* ``sglang-pic-rr``: the same fleet with ``--policy round_robin`` (the router's prefix match
  does not see spans: how does spreading requests evenly compare).
* ``sglang-pic-span``: the same fleet with ``--policy manual``, each request carrying its span
  routing key (``sglang_pic.fleet.routing``: a MinHash of its documents) in
  ``X-SMG-Routing-Key``: requests sharing documents meet on one instance.
* ``sglang-pic-group``: the same with the group key (``span_routing_key(..., buckets=N)``): the
  documents partitioned over the N instances, a request sent where most of its tokens live.

On one GPU the N instances share it (each 0.8/N of its memory); ``--gpus G`` runs one instance
per GPU on G GPUs (``--gpu-per-instance``), for weak scaling on 2-8 GPU hosts.

Workload: the cells of ``bench_rag_grid.py``. Per cell and side: ``samples`` closed bursts over
fresh pools, then a Poisson stream over the last burst's documents at ``stream_load`` x
vanilla's burst throughput. Recorded: requests/s, TTFT p50/p99 of each burst (the first
streamed chunk), the stream's TTFT, the prompt tokens found cached per source (device, host,
storage) from each response, the share of requests each instance served (the router's
per-worker counts), the instances' prefill rate (``prefill_rate``: from their logs), failed
requests.

    python3 -m benchmark.bench_fleet_rag --out $OUT --cells aligned,varlen_k6_p256_z07_t4
    python3 -m benchmark.bench_fleet_rag --out $OUT --gpus 4 --instances 4    # one per GPU
    .venv/bin/python -m benchmark.bench_fleet_rag --smoke   # CPU: SmolLM2, tiny sizes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from sglang_pic.fleet import gpu_share
from sglang_pic.fleet.cli import GPU_MEMORY_SHARE
from sglang_pic.fleet.routing import ROUTING_KEY_HEADER, span_routing_key

from benchmark import description
from benchmark.bench_rag_grid import (
    CELLS,
    PARAMS,
    SMOKE,
    draw_requests,
    ideal,
    print_summary,
    prompt,
)
from benchmark.bench_rag_grid import summarize as grid_summary
from benchmark.harness import LLAMA3_8B_DUMMY, environment, free_port, percentile, smoke_dir

REPO = Path(__file__).resolve().parent.parent
SIDES = {  # side -> (fleet policy, span cache, stores); vanilla is plain SGLang
    "vanilla": ("cache_aware", False, False),
    "sglang-pic": ("cache_aware", True, True),
    "sglang-pic-nostore": ("cache_aware", True, False),
    "sglang-pic-rr": ("round_robin", True, True),
    "sglang-pic-span": ("manual", True, True),
    "sglang-pic-group": ("manual", True, True),
}
MODEL_FLAGS = {  # the device run: Llama-3-8B's shape with dummy weights, as bench_rag_grid's
    "model_path": LLAMA3_8B_DUMMY["model_path"], "load_format": "dummy",
    "skip_tokenizer_init": True, "dtype": "bfloat16", "context_length": 65536,
}
HEALTHY = re.compile(r'smg_worker_cb_state\{worker="[^"]+"\}\s+0\b')
WORKER_COUNT = re.compile(r'smg_worker_cb_outcomes_total\{worker="([^"]+)",outcome="success"\}'
                          r"\s+([0-9.e+]+)")


def flags(kwargs: dict) -> list[str]:
    """Engine keyword arguments as command-line flags."""
    out = []
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False and v is not None:
            out += [flag, str(v)]
    return out


class Side:
    """One side's processes (their own process group each), its router URL and API key."""

    def __init__(self, name: str, args, smoke: bool, log_dir: Path, key_dir: Path) -> None:
        self.name, self.args, self.smoke, self.log_dir = name, args, smoke, log_dir
        self.procs: list[subprocess.Popen] = []
        self.ports = _distinct_ports(2 + 2 * args.instances + args.stores)
        self.port, self.metrics_port = self.ports[0], self.ports[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = "sk-" + secrets.token_hex(16)
        self.key_file = key_dir / f"{name}.key"  # never beside the logs that come back
        self.key_file.write_text(self.key)
        self.key_file.chmod(0o600)
        self.instance_urls: list[str] = []

    def _spawn(self, cmd: list[str], log: str, env: dict | None = None) -> None:
        out = open(self.log_dir / log, "w")  # the child writes it until stop()
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                           env={**os.environ, **(env or {})}, cwd=REPO,
                                           start_new_session=True))

    def start(self) -> float:
        """Start the side; return the seconds until its router answered."""
        t0 = time.perf_counter()
        policy, spans, with_stores = SIDES.get(self.name, ("cache_aware", False, False))
        n, model = self.args.instances, [] if self.smoke else flags(MODEL_FLAGS)
        if self.name == "vanilla" and not self.smoke:
            ports = self.ports[2:2 + n]
            for i, p in enumerate(ports):
                share = ["--base-gpu-id", str(i)] if self.args.gpus > 1 else \
                    ["--mem-fraction-static", f"{_equal_share_fraction(n):.3f}"]
                self._spawn([sys.executable, "-m", "sglang.launch_server", *model,
                             "--attention-backend", "flashinfer", "--host", "127.0.0.1",
                             "--port", str(p), *share],
                            f"vanilla-{i}.log")
                self.instance_urls.append(f"http://127.0.0.1:{p}")
                if self.args.gpus == 1:  # one GPU shared: one after another, as the fleet does
                    url = self.instance_urls[-1]
                    self._wait(lambda url=url: _get(url + "/health", self.key)[0] == 200)
            self._wait(lambda: all(_get(u + "/health", self.key)[0] == 200
                                   for u in self.instance_urls))
            self._spawn([sys.executable, "-m", "sglang_router.launch_router", "--host",
                         "127.0.0.1", "--port", str(self.port), "--policy", policy,
                         "--prometheus-host", "127.0.0.1", "--prometheus-port",
                         str(self.metrics_port), "--worker-urls",
                         *self.instance_urls], "vanilla-router.log")
        else:  # our fleet; on the CPU smoke run also vanilla's stand-in (no spans, no store)
            stores = self.args.stores if with_stores else 0
            fleet_dir = self.log_dir / f"{self.name}-fleet"
            instance_ports, store_ports = self.ports[2:2 + n], self.ports[2 + n:2 + n + stores]
            cmd = [sys.executable, "-m", "sglang_pic", "fleet", "--instances", str(n),
                   "--stores", str(stores), "--policy", policy, "--port", str(self.port),
                   "--metrics-port", str(self.metrics_port), "--instance-ports",
                   ",".join(map(str, instance_ports)), "--api-key-file", str(self.key_file),
                   "--log-dir", str(fleet_dir), *model,
                   *(["--store-ports", ",".join(map(str, store_ports))] if stores else []),
                   *(["--enable-span-cache"] if spans else []),
                   *(["--enable-metrics"] if with_stores else [])]
            if self.args.gpus > 1:
                cmd.append("--gpu-per-instance")
            if self.smoke:
                cmd += flags(SMOKE["engine_kwargs"])
            self._spawn(cmd, f"{self.name}-fleet.log",
                        env={"PYTHONPATH": os.pathsep.join(
                            [str(REPO / "python"), os.environ.get("PYTHONPATH", "")])})
            self._wait(lambda: (fleet_dir / "fleet.json").exists())  # written once all are up
            self.instance_urls = [f"http://127.0.0.1:{p}" for p in instance_ports]
        self._wait(lambda: self.healthy_workers() >= n)
        return time.perf_counter() - t0

    def _wait(self, ready) -> None:
        t0 = time.monotonic()
        deadline, said = t0 + self.args.start_timeout, t0
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"{self.name}: a process exited while starting; logs in "
                                   f"{self.log_dir}")
            if ready():
                return
            if time.monotonic() - said >= 30:  # progress: the newest log's last line
                said = time.monotonic()
                print(f"[fleet-rag] {self.name} starting ({said - t0:.0f} s): "
                      f"{_last_line(self.log_dir)}", flush=True)
            time.sleep(2)
        raise RuntimeError(f"{self.name}: not up after {self.args.start_timeout:.0f} s; logs in "
                           f"{self.log_dir}")

    def _metrics(self) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=5) as r:
                return r.read().decode()
        except OSError:
            return ""

    def worker_counts(self) -> dict[str, float]:
        """Requests each instance served so far (the router's count per worker)."""
        return {w: float(c) for w, c in WORKER_COUNT.findall(self._metrics())}

    def healthy_workers(self) -> int:
        """Workers the router takes requests for (its circuit breaker closed)."""
        return len(HEALTHY.findall(self._metrics()))

    def span_store_counts(self) -> dict[str, float]:
        """The span store tier's counters (``sglang_pic:span_store_*_total``) summed over the
        instances, read from their /metrics (sides with stores run with ``--enable-metrics``);
        empty on the others."""
        total: dict[str, float] = {}
        if not SIDES.get(self.name, ("", False, False))[2]:
            return total
        for url in self.instance_urls:
            for name, value in span_store_counters(_get(url + "/metrics", self.key)[1]).items():
                total[name] = total.get(name, 0.0) + value
        return total

    def instance_logs(self) -> list[Path]:
        """The instances' SGLang logs (vanilla's beside the side's, the fleet's in its folder)."""
        if self.name == "vanilla" and not self.smoke:
            return sorted(self.log_dir.glob("vanilla-[0-9]*.log"))
        return sorted((self.log_dir / f"{self.name}-fleet").glob("instance-*.log"))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 90
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for secret in [*self.log_dir.rglob("*.token"), *self.log_dir.rglob("*.key")]:
            secret.unlink()  # the fleet removes its store token when it stops; a killed one not


def _equal_share_fraction(n: int) -> float:
    """Vanilla's ``--mem-fraction-static`` for the next of ``n`` instances on one GPU: the same
    equal share of the whole GPU as ``sglang-pic fleet`` gives each of its instances."""
    free, total = gpu_share.gpu_memory()
    return gpu_share.static_fraction(GPU_MEMORY_SHARE / n, free, total)


def _last_line(folder: Path) -> str:
    """The last line of the most recently written log under ``folder`` (the router's, which
    logs every health probe, only when there is no other)."""
    logs = sorted(folder.rglob("*.log"), key=lambda p: (p.name != "router.log", p.stat().st_mtime))
    if not logs:
        return ""
    lines = logs[-1].read_text(errors="replace").replace("\r", "\n").strip().splitlines()
    return f"{logs[-1].name}: {lines[-1][:160]}" if lines else logs[-1].name


def _distinct_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def _get(url: str, key: str) -> tuple[int, str]:
    """``GET url`` with the key: the status and the body (0 and "" when it does not answer)."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def headers(side: Side, ids: list[int]) -> dict[str, str]:
    """The request's headers: the key, and on the span-routed side the span routing key."""
    out = {"Authorization": f"Bearer {side.key}"}
    if SIDES.get(side.name, ("",))[0] == "manual":
        groups = side.args.instances if side.name == "sglang-pic-group" else None
        key = span_routing_key(ids, buckets=groups)
        if key is not None:
            out[ROUTING_KEY_HEADER] = key
    return out


async def one_request(session, side: Side, ids: list[int], sp: dict) -> dict:
    """One streamed ``/generate`` through the router: TTFT, latency, cached tokens by source."""
    body = {"input_ids": ids, "sampling_params": sp, "stream": True}
    t0 = time.perf_counter()
    out = {"ttft": None, "latency": None, "cached": {}, "error": None}
    try:
        async with session.post(side.url + "/generate", json=body,
                                headers=headers(side, ids)) as r:
            if r.status != 200:
                out["error"] = f"HTTP {r.status}: {(await r.text())[:200]}"
                return out
            last = None
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                if out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - t0
                last = line
            if last is not None:
                meta = json.loads(last[6:]).get("meta_info", {})
                out["cached"] = meta.get("cached_tokens_details") or {
                    "device": meta.get("cached_tokens", 0)}
    except Exception as e:  # a failed request is recorded, the run goes on
        out["error"] = repr(e)
    out["latency"] = time.perf_counter() - t0
    return out


async def burst(side: Side, prompts: list[list[int]], sp: dict) -> tuple[list[dict], float]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one_request(s, side, p, sp) for p in prompts))
        return outs, time.perf_counter() - t0


async def stream(side: Side, prompts: list[list[int]], sp: dict, rate: float, rng) -> list:
    import aiohttp

    async def later(s, delay: float, p: list[int]) -> dict:
        await asyncio.sleep(delay)
        return await one_request(s, side, p, sp)

    delays, at = [], 0.0
    for _ in prompts:
        at += float(rng.exponential(1.0 / rate))
        delays.append(at)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        return await asyncio.gather(*(later(s, d, p) for d, p in zip(delays, prompts,
                                                                      strict=True)))


PREFILL_LINE = re.compile(r"Prefill batch.*?#new-token: (\d+).*?input throughput \(token/s\): "
                          r"([0-9.]+)")
FULL_CHUNK_TOKENS = 4096
"""Prefill batches of at least this many new tokens count for the prefill rate (a lone short
prompt's batch measures the idle gap before it, not the prefill)."""


POOL_LINE = re.compile(r"max_total_num_tokens=(\d+)")
BACKEND_LINE = re.compile(r"\battention_backend='([^']+)'")


def from_logs(logs: list[Path], line: re.Pattern) -> list[str | None]:
    """``line``'s first group in each instance's SGLang log; None where the log does not say."""
    found = [line.search(log.read_text(errors="replace")) if log.exists() else None
             for log in logs]
    return [m.group(1) if m else None for m in found]


def kv_pool_tokens(logs: list[Path]) -> list[int | None]:
    """Each instance's KV pool (tokens): instances sharing a GPU should get equal pools
    (``sglang_pic.fleet.gpu_share``)."""
    return [int(v) if v else None for v in from_logs(logs, POOL_LINE)]


def attention_backend(logs: list[Path]) -> str | None:
    """The attention backend the side's instances ran (their server_args), where they agree."""
    backends = set(from_logs(logs, BACKEND_LINE))
    return backends.pop() if len(backends) == 1 else None


STORE_COUNTER = re.compile(r"^sglang_pic:span_store_(\w+)_total(?:\{[^}]*\})?\s+(\S+)$", re.M)


def span_store_counters(metrics: str) -> dict[str, float]:
    """``{counter: value}`` of the span store tier's counters in a Prometheus text page
    (``saved_blocks``, ``dropped_units``, ``loaded_tokens``, ...; docs/store.md)."""
    return {name: float(value) for name, value in STORE_COUNTER.findall(metrics)}


def log_sizes(logs: list[Path]) -> dict[Path, int]:
    """Each log's size now: where the next burst's lines start."""
    return {log: log.stat().st_size if log.exists() else 0 for log in logs}


def prefill_rate(since: dict[Path, int]) -> float | None:
    """The median input throughput (tokens/s) SGLang logged for prefill batches of at least
    ``FULL_CHUNK_TOKENS`` new tokens, over every instance's lines written after ``since`` (None:
    no such batch). Where the instances' time goes, beside the requests/s seen by clients."""
    rates = []
    for log, offset in since.items():
        if not log.exists():
            continue
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        rates += [float(r) for n, r in PREFILL_LINE.findall(text) if int(n) >= FULL_CHUNK_TOKENS]
    return statistics.median(rates) if rates else None


def _summed(outs: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for o in outs:
        for source, n in (o["cached"] or {}).items():
            if isinstance(n, int):
                total[source] = total.get(source, 0) + n
    return total


def _store_line(counts: dict[str, float]) -> str:
    """The burst's span store counters a person reads first."""
    keys = ("saved_blocks", "dropped_units", "loaded_units", "loaded_tokens", "missed_units")
    return ", ".join(f"{k} {counts.get(k, 0):.0f}" for k in keys)


def run_side(side: Side, params: dict, rates: dict, progress, cells: dict, save) -> None:
    """Every cell of ``params`` that ``cells`` lacks on a started side, each into ``cells`` and
    then ``save``d (a call cut off keeps the cells it finished)."""
    import numpy as np

    spans = side.name != "vanilla"
    sp = {"max_new_tokens": params["output_tokens"], "temperature": 0, "ignore_eos": True}
    for name in (c for c in params["cells"] if c not in cells):
        cell = CELLS[name]
        rng = np.random.default_rng([params["seed"], sorted(CELLS).index(name)])
        out: dict = {"ideal": [], "requests_per_s": [], "ttft_p50_ms": [], "ttft_p99_ms": [],
                     "cached_tokens": [], "prompt_tokens": [], "per_instance": [],
                     "prefill_tokens_per_s": [], "span_store": [], "errors": 0}
        draw = None
        for _ in range(params["samples"]):
            draw = draw_requests(rng, cell, params["burst"], params)
            before, logs = side.worker_counts(), log_sizes(side.instance_logs())
            store_before = side.span_store_counts()
            outs, elapsed = asyncio.run(burst(side, [prompt(draw, r, spans)
                                                     for r in draw["requests"]], sp))
            after = side.worker_counts()
            ok = [o for o in outs if o["error"] is None and o["ttft"] is not None]
            out["errors"] += len(outs) - len(ok)
            out["ideal"].append(ideal(draw))
            out["requests_per_s"].append(len(ok) / elapsed)
            ttfts = [o["ttft"] for o in ok] or [float("nan")]
            out["ttft_p50_ms"].append(1000 * percentile(ttfts, 50))
            out["ttft_p99_ms"].append(1000 * percentile(ttfts, 99))
            out["cached_tokens"].append(_summed(ok))
            out["prompt_tokens"].append(sum(len(prompt(draw, r, False))
                                            for r in draw["requests"]))
            out["per_instance"].append({w: after.get(w, 0) - before.get(w, 0) for w in after})
            out["prefill_tokens_per_s"].append(prefill_rate(logs))
            store_after = side.span_store_counts()
            out["span_store"].append({k: v - store_before.get(k, 0.0)
                                      for k, v in store_after.items()})
            out["first_errors"] = [o["error"] for o in outs if o["error"]][:3]
        capacity = statistics.median(out["requests_per_s"])
        if side.name == "vanilla":
            rates[name] = params["stream_load"] * capacity
        if rates.get(name) and params["stream"] and draw is not None:
            later = draw_requests(rng, cell, params["stream"], params, over=draw)
            outs = asyncio.run(stream(side, [prompt(later, r, spans)
                                             for r in later["requests"]], sp, rates[name],
                                      rng))
            ok = [o["ttft"] for o in outs if o["error"] is None and o["ttft"] is not None]
            out["errors"] += len(outs) - len(ok)
            out["stream_errors"] = [o["error"] for o in outs if o["error"]][:3]
            out["stream_rate"] = rates[name]
            out["stream_ttft_ms_all"] = [round(1000 * t, 2) for t in ok]
            if ok:
                out["stream_ttft_p50_ms"] = 1000 * percentile(ok, 50)
                out["stream_ttft_p99_ms"] = 1000 * percentile(ok, 99)
        for key in ("requests_per_s", "ttft_p50_ms", "ideal"):
            out[f"{key}_median"] = statistics.median(out[key])
        cells[name] = out
        save()
        progress(f"[fleet-rag] {side.name} {name}: {capacity:.2f} req/s, TTFT p50 "
                 f"{out['ttft_p50_ms_median']:.0f} ms, stream p50 "
                 f"{out.get('stream_ttft_p50_ms', float('nan')):.0f} ms, per instance "
                 f"{out['per_instance'][-1]}, cached {out['cached_tokens'][-1]}, prefill "
                 f"{out['prefill_tokens_per_s'][-1] or float('nan'):.0f} tokens/s per "
                 f"instance, errors {out['errors']}"
                 + (f", span store {_store_line(out['span_store'][-1])}"
                    if out["span_store"] and out["span_store"][-1] else ""))


def summarize(report: dict) -> list[dict]:
    """``bench_rag_grid``'s rows per side and cell, with each side's failed requests."""
    return grid_summary(report, counts=("errors",))


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--out", default=None, help="results folder (default benchmark/results)")
    ap.add_argument("--name", default="fleet_rag", help="the report's file name")
    ap.add_argument("--sides", default="vanilla,sglang-pic",
                    help=f"any of {', '.join(SIDES)}; vanilla runs first (the stream's rate)")
    ap.add_argument("--cells", default="aligned,varlen_k6_p256_z07_t4",
                    help=f"cells of bench_rag_grid.py: {', '.join(CELLS)}")
    ap.add_argument("--instances", type=int, default=2, help="instances per side")
    ap.add_argument("--stores", type=int, default=2, help="store servers of our fleet")
    ap.add_argument("--gpus", type=int, default=1,
                    help="1: the instances share GPU 0; G > 1: one instance per GPU")
    ap.add_argument("--samples", type=int, default=PARAMS["samples"])
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--stream", type=int, default=64)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--log-dir", default=None,
                    help="the processes' logs (default: NAME-logs beside the report with --out, "
                         "else a temporary folder)")
    ap.add_argument("--resume-from", default=None,
                    help="an earlier report of this machine: its sides are kept (vanilla's sets "
                         "the stream's rate) and the sides it lacks run")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run with SmolLM2")
    args = ap.parse_args()
    sides = args.sides.split(",")
    cells = args.cells.split(",")
    if set(sides) - set(SIDES) or set(cells) - set(CELLS):
        ap.error(f"unknown sides or cells: {sorted(set(sides) - set(SIDES))} "
                 f"{sorted(set(cells) - set(CELLS))}")
    if args.gpus > 1 and args.instances != args.gpus:
        ap.error("--gpus G runs one instance per GPU: give --instances G")
    params = {**PARAMS, "samples": args.samples, "burst": args.burst, "stream": args.stream,
              "cells": cells}
    if args.smoke:
        params = {**PARAMS, **SMOKE["params"], "cells": ["smoke"]}
        args.out = args.out or smoke_dir()
    out_dir = Path(args.out) if args.out else REPO / "benchmark" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name}{'_cpu_smoke' if args.smoke else ''}.json"
    report = {"benchmark": "bench_fleet_rag", "environment": environment(),
              "config": {"instances": args.instances, "stores": args.stores,
                         "gpus": args.gpus, "sides": sides, "smoke": args.smoke,
                         "model": "SmolLM2-135M (CPU)" if args.smoke else MODEL_FLAGS},
              "params": params, "results": {}}
    rates: dict = {}
    if args.resume_from:
        earlier = json.loads(Path(args.resume_from).read_text())
        if earlier["params"] != params or earlier["config"]["instances"] != args.instances:
            ap.error(f"--resume-from {args.resume_from}: another workload or fleet size")
        report["results"] = {k: v for k, v in earlier["results"].items() if "cells" in v}
        report["resumed_environment"] = earlier["environment"]
        for name, c in report["results"].get("vanilla", {}).get("cells", {}).items():
            rates[name] = params["stream_load"] * statistics.median(c["requests_per_s"])
    # a SIGTERM (the device call's limit, a user's kill) stops the sides started and keeps the
    # report of what finished
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def save() -> None:
        report["summary"] = summarize(report)
        path.write_text(json.dumps(report, indent=1))

    with tempfile.TemporaryDirectory(prefix="fleet-rag-") as tmp:
        log_dir = Path(args.log_dir) if args.log_dir else \
            out_dir / f"{args.name}-logs" if args.out and not args.smoke else Path(tmp)
        # a side runs where it lacks a cell (one cut off while it started or ran keeps the
        # cells it finished)
        for name in (s for s in sides if set(params["cells"])
                     - set(report["results"].get(s, {}).get("cells", {}))):
            done = report["results"].get(name, {}).get("cells", {})
            side = Side(name, args, args.smoke, log_dir / name, Path(tmp))
            side.log_dir.mkdir(parents=True, exist_ok=True)
            try:
                start_s = side.start()
                pools = kv_pool_tokens(side.instance_logs())
                print(f"[fleet-rag] {name} up in {start_s:.0f} s; KV pools {pools} tokens",
                      flush=True)
                report["results"][name] = {
                    "start_s": start_s, "kv_pool_tokens": pools,
                    "attention_backend": attention_backend(side.instance_logs()), "cells": done}
                run_side(side, params, rates, lambda m: print(m, flush=True),
                         report["results"][name]["cells"], save)
            except Exception as e:
                report["results"][name] = {"error": repr(e)}
                for log in sorted(side.log_dir.rglob("*.log")):
                    print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}",
                          flush=True)
                raise
            finally:
                side.stop()
                save()
    print_summary(summarize(report), count="errors", label="errors")
    print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
