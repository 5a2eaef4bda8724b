"""How fast PTStore's page check (XXH3-64) runs on 1..N threads, hashed two ways.

A TCP load verifies every page it receives against the checksum the owner sent over CURVE
(``datapath._stream``). Its streams run in threads of SGLang's scheduler process, so whether the
hash lets go of the GIL decides whether the streams hash in parallel:

- ``whole_page_call``: one ``xxh3_64_intdigest`` per page; python-xxhash releases the GIL for
  the call (what a stream does now);
- ``chunks_64k_gil_held``: the page fed in 64 KiB ``update`` calls, each too small for
  python-xxhash to release the GIL (what a stream did before).

Each is timed on 1, 2, 4, 8 and 12 threads over ``--pages`` pages of ``--page-mb`` MiB, and again
with one more thread spinning in Python beside them (``busy_*``): SGLang's scheduler at its
worst, when every hand-off of the GIL can wait for the 5 ms switch interval. GB/s = 1e9 bytes/s.

    python -m benchmark.store.bench_checksum_threads [--pages 256] [--page-mb 4] [--samples 3]
        [--out PATH] [--smoke]

Writes ``benchmark/results/xxh3_threads_<host kind>.json`` (``--out`` names the file; ``--smoke``:
32 pages of 1 MiB, the temp smoke folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from benchmark import description

CHUNK = 64 << 10
THREADS = (1, 2, 4, 8, 12)
BUSY_THREADS = (1, 4, 12)


def whole_page_call(view: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(view)


def chunks_64k_gil_held(view: memoryview) -> int:
    h = xxhash.xxh3_64()
    for i in range(0, len(view), CHUNK):
        h.update(view[i:i + CHUNK])
    return h.intdigest()


MODES = {"whole_page_call": whole_page_call, "chunks_64k_gil_held": chunks_64k_gil_held}


def rate(fn, views: list[memoryview], threads: int) -> float:
    """GB/s hashing every view once on ``threads`` threads."""
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        sums = list(pool.map(fn, views))
        dt = time.perf_counter() - t0
    assert len(sums) == len(views)
    return sum(len(v) for v in views) / dt / 1e9


class Spinner:
    """A thread that holds the GIL whenever the interpreter lets it (a busy Python loop)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1

    def __enter__(self) -> Spinner:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-mb", type=float, default=4.0)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="32 x 1 MiB pages, temp folder")
    args = ap.parse_args()
    if args.smoke:
        args.pages, args.page_mb = 32, 1.0
    if args.samples < 3:
        ap.error("--samples must be at least 3 (the table reports a median and its range)")
    if args.pages < 1 or args.page_mb <= 0:
        ap.error("--pages and --page-mb must be positive")
    from benchmark.harness import RESULTS, environment, smoke_dir

    page = int(args.page_mb * (1 << 20))
    data = np.random.default_rng(1).integers(0, 255, size=args.pages * page, dtype=np.uint8)
    mv = memoryview(data).cast("B")
    views = [mv[i * page:(i + 1) * page] for i in range(args.pages)]
    assert {whole_page_call(v) for v in views[:4]} == {chunks_64k_gil_held(v) for v in views[:4]}

    results: dict[str, dict] = {}
    print(f"{'mode':<22} {'threads':>7} {'busy':>5}  GB/s median (min-max)")
    for busy, counts in ((False, THREADS), (True, BUSY_THREADS)):
        for name, fn in MODES.items():
            for k in counts:
                if busy:
                    with Spinner():
                        samples = [rate(fn, views, k) for _ in range(args.samples)]
                else:
                    samples = [rate(fn, views, k) for _ in range(args.samples)]
                key = f"{'busy_' if busy else ''}{name}_{k}"
                results[key] = {"threads": k, "busy_gil_thread": busy, "mode": name,
                                "gbps_median": statistics.median(samples),
                                "gbps_samples": samples}
                print(f"{name:<22} {k:>7} {str(busy):>5}  {statistics.median(samples):6.2f} "
                      f"({min(samples):.2f}-{max(samples):.2f})", flush=True)

    env = environment()
    env["cpus"] = os.cpu_count()
    env["xxhash"] = xxhash.VERSION
    report = {"benchmark": "checksum_threads", "environment": env,
              "params": {"pages": args.pages, "page_bytes": page, "samples": args.samples,
                         "chunk_bytes": CHUNK},
              "results": results}
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            out = out / "xxh3_threads.json"
    else:
        out = (Path(smoke_dir()) if args.smoke else RESULTS) / "xxh3_threads.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
