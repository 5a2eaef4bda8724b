"""`sglang-pic store ...` (run a PTStore server) and `sglang-pic store-status ...`."""

from __future__ import annotations

import argparse
import json
import signal
import threading


def serve(argv: list[str]) -> int:
    from .engine import StoreEngine
    from .protocol import Limits
    from .server import StoreServer

    ap = argparse.ArgumentParser(prog="sglang-pic store", description="Run a PTStore server.")
    ap.add_argument("--endpoint", default="tcp://0.0.0.0:7400", help="zmq endpoint to bind")
    ap.add_argument("--memory-gb", type=float, default=4.0, help="host memory for tensors")
    ap.add_argument("--replica-fraction", type=float, default=0.3,
                    help="share of memory for replicas of tensors owned by other servers")
    ap.add_argument("--ssd-dir", default=None, help="SSD tier for owned tensors (survives restart)")
    ap.add_argument("--ssd-gb", type=float, default=0.0, help="SSD tier budget (0: unbounded)")
    ap.add_argument("--token", default=None, help="shared secret clients must send")
    ap.add_argument("--max-tensor-mb", type=float, default=64.0)
    ap.add_argument("--copy-threads", type=int, default=4,
                    help="threads copying pages into same-node readers' memory")
    args = ap.parse_args(argv)
    if args.copy_threads < 1:
        ap.error("--copy-threads must be >= 1")
    engine = StoreEngine(int(args.memory_gb * (1 << 30)), args.replica_fraction, args.ssd_dir,
                         int(args.ssd_gb * (1 << 30)))
    server = StoreServer(engine, args.endpoint, args.token,
                         Limits(max_tensor_bytes=int(args.max_tensor_mb * (1 << 20))),
                         copy_threads=args.copy_threads)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    server.start()
    print(f"PTStore server on {args.endpoint} ({args.memory_gb} GB, "
          f"{len(engine.objects)} objects recovered)", flush=True)
    done.wait()
    engine.flush_to_ssd()
    server.stop()
    return 0


def status(argv: list[str]) -> int:
    from .client import StoreClient

    ap = argparse.ArgumentParser(prog="sglang-pic store-status")
    ap.add_argument("endpoints", nargs="+")
    ap.add_argument("--token", default=None)
    args = ap.parse_args(argv)
    client = StoreClient(args.endpoints, args.token, timeout_ms=2000)
    code = 0
    for ep in args.endpoints:
        st = client.status(ep)
        if st is None:
            print(f"{ep}: no answer")
            code = 1
        else:
            print(f"{ep}: {json.dumps(st)}")
    client.close()
    return code
