"""Lookup latency of one PTStore reader while another client writes back: one put per owner
against puts cut into chunks (``client.PUT_CHUNK_BYTES``), both inside CURVE messages, and puts
whose pages go over the TCP data plane (``datapath.upload``).

A store server handles one request at a time. SGLang's HiCache asks the store which pages it
holds (``batch_exists``) before every prefetch, and with ``wait_complete`` the request waits for
that answer before its prefill: a lookup queued behind a write-back of another instance delays
the first token of a prompt the store may not even hold. This benchmark runs store servers in
their own processes, a writer that stores ``--put-mb`` per call in a loop, and a reader that asks
for ``--lookup-pages`` pages (all misses, as a cold prompt's) every ``--gap-ms``; per variant it
reports the lookups' p50 / p99 / max and the writer's rate, variants alternating in ``--rounds``.

    python3 -m benchmark.store.bench_lookup_beside_writes [--out DIR] [--rounds 3]
    python3 -m benchmark.store.bench_lookup_beside_writes --smoke      # ~20 s, a temp folder

Prints a table and writes ``store_lookup_beside_writes.json`` (machine, versions, config, every
sample) and a plot (``docs/figures/store_lookup_beside_writes.png`` unless ``--smoke``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchmark import description
from benchmark.harness import environment, save_figure, start_store_servers

HERE = Path(__file__).resolve().parent

REPO = HERE.parent.parent
TOKEN = "bench-lookup-beside-writes-token"
NEVER = 1 << 62
VARIANTS = {"one put per owner": (NEVER, NEVER), "8 MiB puts": (8 << 20, NEVER),
            "data-plane puts": (8 << 20, 1 << 20)}
"""Variant name -> (``client.PUT_CHUNK_BYTES``, ``client.TCP_PUT_MIN_BYTES``): the first two
put inside CURVE messages (a whole write-back in one put per owner, or in 8 MiB puts), the third
over the data plane (the client's defaults)."""


def page_ids(tag: str, n: int) -> list[str]:
    """``n`` page ids no other sample uses (``tag`` names the sample)."""
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def one_sample(endpoints: list[str], puts: tuple[int, int], args, tag: str) -> dict:
    """The reader's lookup latencies (ms) while the writer stores, and the writer's GB/s;
    ``puts``: ``(PUT_CHUNK_BYTES, TCP_PUT_MIN_BYTES)`` for the writer."""
    import sglang_pic.store.client as client_mod

    client_mod.PUT_CHUNK_BYTES, client_mod.TCP_PUT_MIN_BYTES = puts
    reader = client_mod.StoreClient(endpoints, TOKEN, data_plane="tcp")
    writer = client_mod.StoreClient(endpoints, TOKEN, data_plane="tcp")
    page = os.urandom(args.page_mb << 20)
    pages = max(1, args.put_mb // args.page_mb)
    stop, written, busy = threading.Event(), [0], [0.0]

    def write() -> None:
        n = 0
        while not stop.is_set():
            items = [(k, page) for k in page_ids(f"{tag}-w{n}", pages)]
            t = time.perf_counter()
            written[0] += writer.batch_set(items)
            busy[0] += time.perf_counter() - t
            n += 1

    try:
        writer.batch_set([(k, page) for k in page_ids(f"{tag}-warm", 2)])  # connections up
        reader.batch_exists(page_ids(f"{tag}-warm-r", 4))
        th = threading.Thread(target=write, daemon=True)
        th.start()
        time.sleep(0.2)  # the first put under way
        lat = []
        for i in range(args.lookups):
            t = time.perf_counter()
            reader.batch_exists(page_ids(f"{tag}-r{i}", args.lookup_pages))
            lat.append(1000 * (time.perf_counter() - t))
            time.sleep(args.gap_ms / 1000)
        stop.set()
        th.join(timeout=120)
        return {"lookup_ms": lat, "put_gbps": written[0] / busy[0] / 1e9 if busy[0] else None}
    finally:
        reader.close()
        writer.close()


def summarize(samples: list[dict]) -> dict:
    """Per variant: the pooled lookups' p50 / p99 / max, each sample's p50 and p99, the put
    rate."""
    lat = sorted(x for s in samples for x in s["lookup_ms"])
    p50s = [statistics.median(s["lookup_ms"]) for s in samples]
    p99s = [sorted(s["lookup_ms"])[int(0.99 * (len(s["lookup_ms"]) - 1))] for s in samples]
    rates = [s["put_gbps"] for s in samples if s["put_gbps"]]
    return {"lookup_p50_ms": statistics.median(lat), "lookup_p99_ms": lat[int(0.99 * (len(lat) - 1))],
            "lookup_max_ms": lat[-1], "lookup_p50_ms_all": p50s, "lookup_p99_ms_all": p99s,
            "put_gbps": statistics.median(rates) if rates else None, "put_gbps_all": rates}


def plot(report: dict, out: Path, title: str | None = None) -> Path:
    """Each variant's lookup latencies as a CDF (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, samples in report["samples"].items():
        lat = sorted(x for s in samples for x in s["lookup_ms"])
        ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel(f"lookup of {report['config']['lookup_pages']} pages (ms)")
    ax.set_ylabel("share of lookups")
    cfg = report["config"]
    ax.set_title(title or f"PTStore lookups beside {cfg['put_mb']} MB write-backs, "
                 f"{report['machine'].get('cpus')} CPUs", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def alternate_rounds(variants: list[str], rounds: int, procs: list,
                     sample: Callable[[str, int], dict]) -> dict[str, list[dict]]:
    """``sample(variant, round)`` for every variant once per round, the order alternating, with
    a progress line each; the store servers ``procs`` are stopped at the end."""
    samples: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for r in range(rounds):
            for name in variants if r % 2 == 0 else variants[::-1]:
                s = sample(name, r)
                samples[name].append(s)
                puts = f", puts {s['put_gbps']:.2f} GB/s" if s.get("put_gbps") else ""
                print(f"[bench] round {r + 1}/{rounds}, {name}: lookup p50 "
                      f"{statistics.median(s['lookup_ms']):.2f} ms, max {max(s['lookup_ms']):.1f} "
                      f"ms{puts}", flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    return samples


def save_report(report: dict, args, title: str | None = None) -> None:
    """``<benchmark>.json`` in ``--out`` (default benchmark/results) and its plot (in
    docs/figures, or beside the JSON with ``--smoke``)."""
    name = report["benchmark"]
    out = Path(args.out) if args.out else REPO / "benchmark" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"[bench] wrote {path}")
    plot(report, (out if args.smoke else REPO / "docs" / "figures") / f"{name}.png", title)


def lookup_args(doc: str, servers: int, lookups: int, gap_ms: float, rounds: int,
                add: Callable[[argparse.ArgumentParser], None]) -> argparse.Namespace:
    """The lookup benchmarks' flags (``add`` adds a benchmark's own), parsed and checked: every
    integer at least 1, ``--gap-ms`` at least 0; ``--smoke`` puts its results in a temp folder."""
    ap = argparse.ArgumentParser(description=description(doc))
    ap.add_argument("--servers", type=int, default=servers)
    ap.add_argument("--lookup-pages", type=int, default=128)
    ap.add_argument("--lookups", type=int, default=lookups, help="per sample")
    ap.add_argument("--gap-ms", type=float, default=gap_ms)
    ap.add_argument("--rounds", type=int, default=rounds,
                    help="samples per variant, alternating")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="small sizes, 1 round, a temp folder")
    add(ap)
    args = ap.parse_args()
    if args.smoke:
        args.out = args.out or tempfile.mkdtemp(prefix="sglang-pic-bench-")
    for name, value in vars(args).items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.gap_ms < 0:
        ap.error("--gap-ms must be 0 or more")
    return args


def main() -> None:
    def own(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--put-mb", type=int, default=256, help="bytes of one write-back")
        ap.add_argument("--page-mb", type=int, default=4)

    args = lookup_args(__doc__, servers=1, lookups=60, gap_ms=20.0, rounds=3, add=own)
    if args.smoke:
        args.put_mb, args.lookups, args.rounds = 32, 15, 1
    procs, endpoints = start_store_servers(args.servers, TOKEN,
                                           memory_gb=max(1.0, 4 * args.put_mb / 1024))
    samples = alternate_rounds(list(VARIANTS), args.rounds, procs, lambda name, r: one_sample(
        endpoints, VARIANTS[name], args, f"{r}-{name}"))
    env = environment()
    report = {"benchmark": "store_lookup_beside_writes", "environment": env,
              "machine": {"cpus": os.cpu_count()},
              "config": {k: v for k, v in vars(args).items() if k != "out"},
              "put_chunk_bytes": {k: v[0] for k, v in VARIANTS.items()},
              "tcp_put_min_bytes": {k: v[1] for k, v in VARIANTS.items()}, "samples": samples,
              "results": {v: summarize(s) for v, s in samples.items()}}
    print(f"\n{'variant':<20}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'puts GB/s':>11}")
    for v, r in report["results"].items():
        print(f"{v:<20}{r['lookup_p50_ms']:>9.2f}{r['lookup_p99_ms']:>9.1f}"
              f"{r['lookup_max_ms']:>9.1f}{r['put_gbps'] or 0:>11.2f}")
    save_report(report, args)


if __name__ == "__main__":
    main()
