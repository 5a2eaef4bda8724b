"""PTStore transfer throughput vs a raw loopback socket copy of the same bytes.

For object sizes 64 KB - 64 MB (an object = a batch of 64 KB pages, as HiCache moves them), time
through one PTStore server (its own process, as deployed; zmq over loopback TCP, checksums,
engine copy): ``batch_set``, ``batch_get``, and ``batch_get_into`` preallocated pages (what the
HiCache backend does) over the socket, over the same-node shared-memory staging segment, and
into a shared-memory "host pool" the server writes into (``get_into_pool``: SGLang's host pool
with ``"allocator": "shm"``, what ``--ptstore`` sets); as the floor, a plain zmq round trip of the
same bytes with no store behind it. Reports GB/s (median) and p99
latency per size, writes ``benchmark/results/store_throughput.json``.

The server authenticates with a token, so every message is CurveZMQ-encrypted; ``--insecure``
runs it without (no encryption: what CURVE costs; the server then writes into no pool, so
``get_into_pool`` goes through the staging segment).

    python -m benchmark.store.bench_store [--repeats 20] [--insecure]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from benchmark import description
from benchmark.harness import free_port, start_store_servers

REPO = Path(__file__).resolve().parents[2]

TOKEN = "bench-store-token-loopback"  # a throwaway token of loopback servers
PAGE = 64 << 10
SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]


def raw_copy_times(size: int, repeats: int) -> list[float]:
    """Round trip of `size` bytes over a zmq DEALER/ROUTER echo of a 1-byte ack (the floor)."""
    import threading

    import zmq

    ctx = zmq.Context.instance()
    ep = f"tcp://127.0.0.1:{free_port()}"
    srv = ctx.socket(zmq.ROUTER)
    srv.bind(ep)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            if srv.poll(50):
                frames = srv.recv_multipart(copy=False)
                srv.send_multipart([frames[0], b"k"])

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    cli = ctx.socket(zmq.DEALER)
    cli.connect(ep)
    payload = [b"x" * PAGE] * max(size // PAGE, 1)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        cli.send_multipart(payload, copy=False)
        cli.recv_multipart()
        times.append(time.perf_counter() - t0)
    stop.set()
    t.join()
    cli.close(0)
    srv.close(0)
    return times


def store_times(endpoint: str, size: int, repeats: int,
                token: str | None = TOKEN) -> dict[str, list[float]]:
    import mmap
    import os

    from sglang_pic.store.client import StoreClient
    from sglang_pic.store.shm import address_of

    # the socket columns: pages inside the zmq replies (not the TCP data plane)
    plain = StoreClient([endpoint], token, timeout_ms=60000, shm=False, data_plane="zmq")
    shm = StoreClient([endpoint], token, timeout_ms=60000, shm=True)
    pool = StoreClient([endpoint], token, timeout_ms=60000, shm=True)
    n = max(size // PAGE, 1)
    times: dict[str, list[float]] = {"set": [], "get": [], "get_into": [], "get_into_shm": [],
                                     "get_into_pool": []}
    dests = [memoryview(bytearray(PAGE)) for _ in range(n)]
    fd = os.memfd_create("bench-pool")
    os.ftruncate(fd, n * PAGE)
    pool_mm = mmap.mmap(fd, n * PAGE)
    base = address_of(pool_mm)
    pool_dests = [memoryview(pool_mm)[i * PAGE:(i + 1) * PAGE] for i in range(n)]
    pool_addrs = [base + i * PAGE for i in range(n)]
    pool.use_pool(fd, base, n * PAGE)
    plain.batch_set([("warm", bytes(PAGE))])
    for client in (plain, shm):  # one-time setup off the clock: connections, probe, segment
        assert client.batch_get_into(["warm"], dests[:1]) == [True]
    assert pool.batch_get_into(["warm"], pool_dests[:1], pool_addrs[:1]) == [True]
    time.sleep(0.5)  # the server builds its page tables of the pool in the background
    for r in range(repeats):
        items = [(f"s{size}r{r}p{i}", bytes([r % 251]) * PAGE) for i in range(n)]
        tids = [t for t, _ in items]
        t0 = time.perf_counter()
        plain.batch_set(items)
        times["set"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = plain.batch_get(tids)
        times["get"].append(time.perf_counter() - t0)
        assert all(g is not None for g in got)
        for name, client in (("get_into", plain), ("get_into_shm", shm)):
            t0 = time.perf_counter()
            ok = client.batch_get_into(tids, dests)
            times[name].append(time.perf_counter() - t0)
            assert all(ok) and bytes(dests[-1]) == items[-1][1]
        t0 = time.perf_counter()
        ok = pool.batch_get_into(tids, pool_dests, pool_addrs)
        times["get_into_pool"].append(time.perf_counter() - t0)
        assert all(ok) and bytes(pool_dests[-1]) == items[-1][1]
    assert shm.stats["shm_pages"] == repeats * n + 1  # the shared-memory path was taken
    # the servers wrote into the pool (an insecure server does not: staging instead)
    assert pool.stats["pool_pages"] == (repeats * n + 1 if token else 0)
    del pool_dests
    for c in (plain, shm, pool):
        c.close()
    pool_mm.close()
    os.close(fd)
    return times


def _summ(times: list[float], size: int) -> dict:
    times = sorted(times)
    med = statistics.median(times)
    return {"gb_per_s": size / med / 1e9, "p50_ms": 1000 * med,
            "p99_ms": 1000 * times[min(len(times) - 1, int(0.99 * len(times)))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(REPO / "benchmark" / "results" / "store_throughput.json"))
    ap.add_argument("--insecure", action="store_true",
                    help="no token: no CurveZMQ encryption (and no writes into the pool)")
    args = ap.parse_args()
    token = None if args.insecure else TOKEN
    rows = []
    kinds = ("raw", "set", "get", "get_into", "get_into_shm", "get_into_pool")
    print(f"{'size':>8}" + "".join(f"{k + ' GB/s':>20}" for k in kinds)
          + "".join(f"{k + ' p99':>20}" for k in kinds))
    procs, (endpoint,) = start_store_servers(1, token, memory_gb=8)
    try:
        for size in SIZES:
            times = {"raw": raw_copy_times(size, args.repeats),
                     **store_times(endpoint, size, args.repeats, token)}
            row = {"size_bytes": size, **{k: _summ(times[k], size) for k in kinds}}
            rows.append(row)
            print(f"{size >> 10:>6}KB" + "".join(f"{row[k]['gb_per_s']:20.2f}" for k in kinds)
                  + "".join(f"{row[k]['p99_ms']:18.2f}ms" for k in kinds), flush=True)
    finally:
        procs[0].terminate()
    out = Path(args.out)
    out.write_text(json.dumps({"benchmark": "store_throughput", "page_bytes": PAGE,
                               "curve": token is not None,
                               "environment": {"host": platform.node(),
                                               "python": platform.python_version(),
                                               "cpus": __import__("os").cpu_count()},
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
