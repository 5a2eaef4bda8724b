"""PTStore weak scaling (issue 7): one instance per GPU, one store server per instance, a shared
pool of long documents, requests spread round-robin over the instances.

For each instance count ``n`` (``--gpus 1 2 4 8``) and each variant:

* ``recompute``: vanilla SGLang 0.5.17 with its radix cache disabled - every prompt prefilled;
* ``prefix``: vanilla SGLang with its prefix cache - each instance reuses only what *it* computed;
* ``ptstore``: sglang-pic with HiCache and PTStore as L3 over the ``n`` store servers (each
  instance's own server named ``local``, so hot pages are replicated next to their readers).

Weak scaling: every instance gets the same number of requests (``--requests`` per instance), all
drawn from one pool of ``--documents`` documents whose lengths cycle through ``--lengths``
(default 1K/2K/4K/8K tokens) plus a fresh question; a document is computed once per instance with
``prefix`` and once in the whole cluster with ``ptstore``, so PTStore's advantage should grow with
``n``. Each request asks for one output token, so its latency is its TTFT.

Reports, per ``(n, variant)``: TTFT p50/p99 overall and per document length, the prefix hit rate
(cached / prompt tokens), the share served from storage, bytes the store servers sent and
received. Results are merged into ``benchmark/results/store_scaling_<machine>.json`` (so one
device call can run a subset: ``--gpus 8 --variants ptstore``) and plotted into
``docs/figures/store_scaling_<machine>.png``.

    # H200 x N (Llama-3-8B shape, dummy weights):
    python -m benchmark.store.bench_store_scaling --gpus 1 2
    # CPU smoke (SmolLM2, every instance on the CPU, short documents):
    python -m benchmark.store.bench_store_scaling --cpu --gpus 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmark import description
from benchmark.harness import (
    REPO,
    environment,
    free_port,
    plugin_site,
    save_figure,
    smoke_dir,
    start_store_servers,
    store_totals,
    variant_env,
)

VARIANTS = ("recompute", "prefix", "ptstore")
TOKEN = "bench-store-scaling-token"  # a throwaway token of loopback servers
GPU_ARGS = ["--model-path", str(REPO / "benchmark/models/llama3-8b"), "--load-format", "dummy",
            "--skip-tokenizer-init", "--attention-backend", "triton", "--dtype", "bfloat16",
            "--context-length", "16384", "--mem-fraction-static", "0.75", "--page-size", "64",
            "--disable-cuda-graph"]
HICACHE_ARGS = ["--hicache-size", "24", "--hicache-write-policy", "write_through",
                "--hicache-storage-prefetch-policy", "wait_complete"]
CPU_ARGS = ["--skip-tokenizer-init", "--max-total-tokens", "2048", "--page-size", "16"]
CPU_HICACHE_ARGS = ["--hicache-size", "1", "--hicache-write-policy", "write_through",
                    "--hicache-storage-prefetch-policy", "wait_complete"]


def _get(url: str, timeout: float = 2.0) -> int | None:
    import requests

    try:
        return requests.get(url, timeout=timeout).status_code
    except requests.RequestException:
        return None


class Cluster:
    """``n`` serving instances (and, for ``ptstore``, ``n`` store servers), started together."""

    def __init__(self, variant: str, n: int, cpu: bool, log_dir: Path, site: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.stores: list[str] = []
        self.urls: list[str] = []
        pic = variant == "ptstore" or cpu  # vanilla SGLang cannot run on a CPU (docs/cpu.md)
        env = variant_env("sglang-pic" if pic else "vanilla", site)
        # sglang-pic serve requires an API key: one for this cluster, handed over in the
        # environment (vanilla SGLang checks none and ignores the header)
        self.headers = {}
        if pic:
            key = secrets.token_urlsafe(32)
            env["SGLANG_PIC_API_KEY"] = key
            self.headers = {"Authorization": f"Bearer {key}"}
        if cpu:
            env["OMP_NUM_THREADS"] = "1"
        if variant == "ptstore":
            stores, self.stores = start_store_servers(n, TOKEN, 2 if cpu else 48, env, log_dir)
            env = dict(env, SGLANG_PIC_PTSTORE_TOKEN=TOKEN)  # what the instances' --ptstore uses
            self.procs += stores
            self.logs += [log_dir / f"store{i}.log" for i in range(n)]
        for i in range(n):
            port = free_port()
            args = ["--port", str(port), *(CPU_ARGS if cpu else GPU_ARGS)]
            if not cpu:
                args += ["--base-gpu-id", str(i)]
            if variant == "recompute":
                args.append("--disable-radix-cache")
            if variant == "ptstore":
                args += [*(CPU_HICACHE_ARGS if cpu else HICACHE_ARGS),
                         "--ptstore", ",".join(self.stores),
                         "--hicache-storage-backend-extra-config",
                         json.dumps({"local": self.stores[i]})]
            cmd = ([sys.executable, "-m", "sglang_pic", "serve"] if pic
                   else [sys.executable, "-m", "sglang.launch_server"]) + args
            self._spawn(cmd, env, log_dir / f"{variant}{i}.log")
            self.urls.append(f"http://127.0.0.1:{port}")

    def _spawn(self, cmd: list[str], env: dict, log: Path) -> None:
        out = open(log, "w")
        self.logs.append(log)
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        pending = list(self.urls)
        while pending:
            for proc, log in zip(self.procs, self.logs, strict=True):
                if proc.poll() is not None:
                    time.sleep(1)  # let its last lines reach the log
                    lines = log.read_text(errors="replace").splitlines()
                    errors = [x for x in lines if "Error" in x or "error:" in x][-5:]
                    raise RuntimeError(f"{log.stem} exited during start-up: "
                                       + " | ".join(errors or lines[-5:]))
            if time.time() > deadline:
                raise RuntimeError(f"not ready after {timeout_s:.0f} s: {pending}")
            pending = [u for u in pending if _get(u + "/health") != 200]
            time.sleep(2)

    def store_bytes(self) -> dict[str, int]:
        return store_totals(self.stores, TOKEN) if self.stores else {}

    def stop(self) -> None:
        import signal

        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def workload(args, n: int) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """Documents, and per instance its requests as ``(document, prompt ids)``."""
    import numpy as np

    rng = np.random.default_rng(0)
    docs = [[int(t) for t in rng.integers(1000, args.vocab, size=args.lengths[d % len(args.lengths)])]
            for d in range(args.documents)]
    per_instance = []
    for i in range(n):
        reqs = []
        for j in range(args.requests):
            d = (j * 7 + i * 3) % args.documents  # every instance sweeps the whole pool
            question = [int(t) for t in rng.integers(1000, args.vocab, size=args.question)]
            reqs.append((d, docs[d] + question))
        per_instance.append(reqs)
    return docs, per_instance


def run_case(args, variant: str, n: int, site: Path) -> dict:
    import requests

    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(variant, n, args.cpu, Path(tmp), site)
        try:
            t0 = time.perf_counter()
            cluster.wait_ready(args.start_timeout)
            start_s = time.perf_counter() - t0
            docs, per_instance = workload(args, n)
            body = {"sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            # warm-up: one prompt per length on every instance, on tokens no request uses
            for url in cluster.urls:
                for length in args.lengths:
                    requests.post(url + "/generate", json={"input_ids": [7] * length, **body},
                                  headers=cluster.headers, timeout=600)
            results: list[dict] = []
            lock = threading.Lock()

            def send(url: str, doc: int, ids: list[int]) -> None:
                t = time.perf_counter()
                r = requests.post(url + "/generate", json={"input_ids": ids, **body},
                                  headers=cluster.headers, timeout=600)
                dt = time.perf_counter() - t
                meta = r.json()["meta_info"] if r.status_code == 200 else {}
                details = meta.get("cached_tokens_details") or {}
                with lock:
                    results.append({"ok": r.status_code == 200, "ttft_s": dt,
                                    "length": len(docs[doc]), "prompt": len(ids),
                                    "cached": int(meta.get("cached_tokens", 0)),
                                    "storage": int(details.get("storage", 0))})

            t1 = time.perf_counter()
            with ThreadPoolExecutor(n * args.concurrency) as pool:
                # round-robin: the j-th request of every instance goes out before the (j+1)-th
                futures = [pool.submit(send, cluster.urls[i], d, ids)
                           for j in range(args.requests) for i, reqs in enumerate(per_instance)
                           for d, ids in [reqs[j]]]
                for f in futures:
                    f.result()
            wall = time.perf_counter() - t1
            moved = cluster.store_bytes()
        finally:
            cluster.stop()
    ok = [r for r in results if r["ok"]]
    ttft = sorted(1000 * r["ttft_s"] for r in ok)
    row = {"n": n, "variant": variant, "requests": len(results), "failed": len(results) - len(ok),
           "start_s": start_s, "wall_s": wall,
           "ttft_p50_ms": statistics.median(ttft) if ttft else None,
           "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
           "hit_rate": sum(r["cached"] for r in ok) / max(sum(r["prompt"] for r in ok), 1),
           "storage_share": sum(r["storage"] for r in ok) / max(sum(r["prompt"] for r in ok), 1),
           "store": moved, "by_length": {}}
    for length in args.lengths:
        times = [1000 * r["ttft_s"] for r in ok if r["length"] == length]
        if times:
            row["by_length"][str(length)] = statistics.median(times)
    return row


def _merge(path: Path, rows: list[dict], params: dict) -> dict:
    report = json.loads(path.read_text()) if path.exists() else {"benchmark": "store_scaling",
                                                                 "rows": []}
    keep = [r for r in report["rows"]
            if (r["n"], r["variant"]) not in {(x["n"], x["variant"]) for x in rows}]
    report.update(environment=environment(), params=params,
                  rows=sorted(keep + rows, key=lambda r: (r["n"], VARIANTS.index(r["variant"]))))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return report


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(11, 4))
    for color, variant in zip(("C0", "C1", "C2"), VARIANTS, strict=True):
        rows = [r for r in report["rows"] if r["variant"] == variant and r["ttft_p50_ms"]]
        if not rows:
            continue
        ns = [r["n"] for r in rows]
        ax_t.plot(ns, [r["ttft_p50_ms"] for r in rows], "o-", color=color, label=f"{variant} p50")
        ax_t.plot(ns, [r["ttft_p99_ms"] for r in rows], "o:", color=color, label=f"{variant} p99")
        ax_h.plot(ns, [r["hit_rate"] for r in rows], "o-", color=color,
                  label=f"{variant}: cached tokens")
        if variant == "ptstore":
            ax_h.plot(ns, [r["storage_share"] for r in rows], "s--", color=color,
                      label="ptstore: of which from L3")
    ax_t.set(xlabel="instances (one per GPU)", ylabel="TTFT (ms)", yscale="log")
    ax_h.set(xlabel="instances (one per GPU)", ylabel="share of prompt tokens", ylim=(0, 1))
    for ax in (ax_t, ax_h):
        ax.legend(fontsize=8)
        ax.set_xticks(sorted({r["n"] for r in report["rows"]}))
    fig.suptitle("PTStore weak scaling: shared documents, requests round-robin over instances")
    save_figure(fig, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cpu", action="store_true", help="CPU smoke: SmolLM2, short documents")
    ap.add_argument("--documents", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None, help="per instance")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight per instance")
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.cpu:  # SGLang prefetches storage hits of >= 256 tokens only: documents above that
        args.documents = args.documents or 2
        args.requests = args.requests or 4
        args.lengths = args.lengths or [320, 640]
        args.concurrency = min(args.concurrency, 1)
        args.vocab = 49000
    else:
        args.documents = args.documents or 16
        args.requests = args.requests or 32
        args.lengths = args.lengths or [1024, 2048, 4096, 8192]
        args.vocab = 120000
    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    machine = "cpu_smoke" if args.cpu else "h200"
    default_dir = Path(smoke_dir()) if args.cpu else REPO / "benchmark/results"
    out = Path(args.out) if args.out else default_dir / f"store_scaling_{machine}.json"
    params = {k: getattr(args, k) for k in ("documents", "requests", "lengths", "concurrency",
                                             "question", "cpu")}
    with tempfile.TemporaryDirectory() as tmp:
        site = plugin_site(Path(tmp) / "site")
        for n in args.gpus:
            for variant in variants:
                print(f"[scaling] n={n} {variant} ...", flush=True)
                try:
                    row = run_case(args, variant, n, site)
                except Exception as e:  # one failed case must not lose the others
                    row = {"n": n, "variant": variant, "error": f"{type(e).__name__}: {e}"[:500],
                           "ttft_p50_ms": None}
                report = _merge(out, [row], params)
                if row.get("error"):
                    print(f"  failed: {row['error']}", flush=True)
                else:
                    print(f"  TTFT p50 {row['ttft_p50_ms']:.1f} ms  p99 {row['ttft_p99_ms']:.1f} ms"
                          f"  hits {row['hit_rate']:.2f}  from L3 {row['storage_share']:.2f}"
                          f"  store out {row['store'].get('bytes_out', 0) / 1e9:.2f} GB"
                          f"  ({row['requests']} requests, {row['failed']} failed)", flush=True)
    print(f"\n{'n':>3} {'variant':>10} {'p50 ms':>9} {'p99 ms':>9} {'hits':>6} {'L3':>6}")
    for r in report["rows"]:
        if r.get("ttft_p50_ms"):
            print(f"{r['n']:>3} {r['variant']:>10} {r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>9.1f}"
                  f" {r['hit_rate']:>6.2f} {r['storage_share']:>6.2f}")
    print(f"wrote {out}")
    figures = out.parent if args.cpu else REPO / "docs/figures"
    plot(report, figures / f"store_scaling_{machine}.png")


if __name__ == "__main__":
    main()
