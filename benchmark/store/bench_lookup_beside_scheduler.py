"""Lookup latency of a PTStore client beside an idle SGLang scheduler loop: napping between
passes only, or also waiting for the lookup in flight (``store/idle_yield.py``).

SGLang's HiCache asks the store which pages it holds (``batch_exists``) from its prefetch thread,
and with ``wait_complete`` the request waits for the answer, hit or miss, before its prefill. The
scheduler meanwhile runs idle passes in Python in the same process; the lookup's few GIL
sections each wait for the pass to end. This benchmark runs store servers in their own
processes and, in one process, a thread that runs ``idle_yield.around_on_idle`` around a pass of
``--pass-us`` of Python work (HiCache storage I/O marked in flight, as during a prefetch) while
the main thread looks up ``--lookup-pages`` new pages every ``--gap-ms``. Variants, alternating
in ``--rounds``:

* ``alone``: no scheduler thread;
* ``nap``: the scheduler naps 100 us after each pass (the lookup is not announced);
* ``lookup watch``: the lookup runs inside ``idle_yield.LOOKUPS.running()``, as
  ``idle_yield.around_hit_query`` runs SGLang's storage hit query, and the idle pass waits for
  its end (with the switch interval at ``LOOKUP_SWITCH_S`` meanwhile);
* ``first page alone``: the same, the lookup asking the first page alone first
  (``client.leading_found``, what the HiCache backend's ``batch_exists`` runs): the pages are
  all misses, as a cold prompt's, so that is the whole lookup.

    python3 -m benchmark.store.bench_lookup_beside_scheduler [--out DIR] [--rounds 4]
    python3 -m benchmark.store.bench_lookup_beside_scheduler --smoke    # ~15 s, a temp folder

Prints a table and writes ``store_lookup_beside_scheduler.json`` (machine, versions, config,
every sample) and a plot (``docs/figures/store_lookup_beside_scheduler.png`` unless ``--smoke``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from types import SimpleNamespace

from benchmark.harness import environment, start_store_servers
from benchmark.store.bench_lookup_beside_writes import (
    alternate_rounds,
    lookup_args,
    page_ids,
    save_report,
    summarize,
)

TOKEN = "bench-lookup-beside-scheduler-token"
VARIANTS = ("alone", "nap", "lookup watch", "first page alone")
NAP_S = 100e-6  # --hicache-storage-idle-yield-us's default


class _Scheduler:
    """An idle SGLang scheduler as ``around_on_idle`` sees it: storage I/O in flight, and a
    pass of ``pass_s`` of Python work."""

    def __init__(self, pass_s: float) -> None:
        self.tree_cache = SimpleNamespace(ongoing_prefetch={"request": object()})
        self.pass_s = pass_s

    def on_idle(self) -> None:
        end, x = time.perf_counter() + self.pass_s, 0
        while time.perf_counter() < end:
            x += 1


def one_sample(endpoints: list[str], variant: str, args, tag: str) -> dict:
    """The lookups' latencies (ms) in ``variant``."""
    from sglang_pic.store import idle_yield
    from sglang_pic.store.client import StoreClient

    client = StoreClient(endpoints, TOKEN)
    stop = threading.Event()
    sched = _Scheduler(args.pass_us / 1e6)
    idle_yield._nap_s = NAP_S

    def scheduler() -> None:
        while not stop.is_set():
            idle_yield.around_on_idle(_Scheduler.on_idle, sched)

    th = threading.Thread(target=scheduler, daemon=True)
    try:
        client.batch_exists(page_ids(f"{tag}-warm", 4))  # connections up
        if variant != "alone":
            th.start()
        lat = []
        for i in range(args.lookups):
            ids = page_ids(f"{tag}-{i}", args.lookup_pages)
            watch = idle_yield.LOOKUPS.running() if variant in ("lookup watch",
                                                                "first page alone") \
                else contextlib.nullcontext()
            t = time.perf_counter()
            with watch:
                if variant == "first page alone":
                    client.leading_found(ids)
                else:
                    client.batch_exists(ids)
            lat.append(1000 * (time.perf_counter() - t))
            time.sleep(args.gap_ms / 1000)
        return {"lookup_ms": lat, "put_gbps": None}
    finally:
        stop.set()
        if th.is_alive():
            th.join()
        client.close()


def main() -> None:
    def own(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--pass-us", type=int, default=1000,
                        help="Python work of one idle scheduler pass, in microseconds")

    args = lookup_args(__doc__, servers=3, lookups=100, gap_ms=5.0, rounds=4, add=own)
    if args.smoke:
        args.lookups, args.rounds = 20, 1
    procs, endpoints = start_store_servers(args.servers, TOKEN, memory_gb=1.0)
    samples = alternate_rounds(list(VARIANTS), args.rounds, procs, lambda name, r: one_sample(
        endpoints, name, args, f"{r}-{name}"))
    report = {"benchmark": "store_lookup_beside_scheduler", "environment": environment(),
              "machine": {"cpus": os.cpu_count()},
              "config": {**{k: v for k, v in vars(args).items() if k != "out"},
                         "nap_us": NAP_S * 1e6},
              "samples": samples, "results": {v: summarize(s) for v, s in samples.items()}}
    print(f"\n{'variant':<16}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for v, r in report["results"].items():
        print(f"{v:<16}{r['lookup_p50_ms']:>9.2f}{r['lookup_p99_ms']:>9.2f}"
              f"{r['lookup_max_ms']:>9.2f}")
    save_report(report, args, title=f"PTStore lookups beside an idle scheduler ({args.pass_us} "
                                    f"us passes), {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
