"""PTStore transfer throughput vs a raw loopback socket copy of the same bytes.

For object sizes 64 KB - 64 MB (an object = a batch of 64 KB pages, as HiCache moves them), time
``batch_set`` and ``batch_get`` through one PTStore server (zmq over loopback TCP, CRC checks,
engine copy) and, as the floor, a plain zmq PUSH/PULL of the same bytes with no store behind it.
Reports GB/s (median) and p99 latency per size, writes ``benchmark/results/store_throughput.json``.

    python benchmark/store/bench_store.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

PAGE = 64 << 10
SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_copy_times(size: int, repeats: int) -> list[float]:
    """Round trip of `size` bytes over a zmq DEALER/ROUTER echo of a 1-byte ack (the floor)."""
    import threading

    import zmq

    ctx = zmq.Context.instance()
    ep = f"tcp://127.0.0.1:{_port()}"
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


def store_times(size: int, repeats: int) -> tuple[list[float], list[float]]:
    from sglang_pic.store.client import StoreClient
    from sglang_pic.store.engine import StoreEngine
    from sglang_pic.store.server import StoreServer

    server = StoreServer(StoreEngine(4 << 30), f"tcp://127.0.0.1:{_port()}", "t").start()
    client = StoreClient([server.endpoint], "t", timeout_ms=60000)
    n = max(size // PAGE, 1)
    put, get = [], []
    for r in range(repeats):
        items = [(f"r{r}p{i}", bytes([r % 251]) * PAGE) for i in range(n)]
        t0 = time.perf_counter()
        client.batch_set(items)
        put.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = client.batch_get([t for t, _ in items])
        get.append(time.perf_counter() - t0)
        assert all(g is not None for g in got)
    client.close()
    server.stop()
    return put, get


def _summ(times: list[float], size: int) -> dict:
    times = sorted(times)
    med = statistics.median(times)
    return {"gb_per_s": size / med / 1e9, "p50_ms": 1000 * med,
            "p99_ms": 1000 * times[min(len(times) - 1, int(0.99 * len(times)))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(REPO / "benchmark" / "results" / "store_throughput.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'size':>8} {'raw GB/s':>9} {'set GB/s':>9} {'get GB/s':>9} {'get/raw':>8} "
          f"{'raw p99':>9} {'set p99':>9} {'get p99':>9}")
    for size in SIZES:
        raw = _summ(raw_copy_times(size, args.repeats), size)
        put_t, get_t = store_times(size, args.repeats)
        put, get = _summ(put_t, size), _summ(get_t, size)
        rows.append({"size_bytes": size, "raw": raw, "set": put, "get": get})
        print(f"{size >> 10:>6}KB {raw['gb_per_s']:9.2f} {put['gb_per_s']:9.2f} "
              f"{get['gb_per_s']:9.2f} {get['gb_per_s'] / raw['gb_per_s']:8.2f} "
              f"{raw['p99_ms']:8.2f}ms {put['p99_ms']:8.2f}ms {get['p99_ms']:8.2f}ms", flush=True)
    out = Path(args.out)
    out.write_text(json.dumps({"benchmark": "store_throughput", "page_bytes": PAGE,
                               "environment": {"host": platform.node(),
                                               "python": platform.python_version(),
                                               "cpus": __import__("os").cpu_count()},
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
