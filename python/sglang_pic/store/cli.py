"""`sglang-pic store ...` (run a PTStore server) and `sglang-pic store-status ...`.

Tokens never go on the command line (any user sees it in ``ps``): a server reads them from
``--token-file`` (one per line, ``TOKEN`` or ``NAME TOKEN``, mode 600) or ``$SGLANG_PIC_STORE_TOKEN``
(one token); ``store-status`` reads its one token the same way. A server without a token refuses
to start unless ``--insecure`` says it is meant to serve anyone who reaches it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from .auth import STORE_TOKEN_ENV

T = TypeVar("T")

_NO_ARGV_TOKEN = (f"tokens are not taken on the command line (visible in ps): use --token-file "
                  f"PATH or {STORE_TOKEN_ENV}")


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def _secret(prog: str, args: argparse.Namespace, read: Callable[[str | None, str], T]
            ) -> tuple[T | None, int]:
    """The token(s) from ``--token-file`` or the environment, through ``read``; a token on argv
    (visible in ``ps``) or an unreadable file is refused: ``(None, exit status)``."""
    if args.token is not None:
        return None, _fail(prog, _NO_ARGV_TOKEN)
    try:
        return read(args.token_file, STORE_TOKEN_ENV), 0
    except (OSError, ValueError) as e:
        return None, _fail(prog, str(e))


def serve(argv: list[str]) -> int:
    from .auth import server_tokens
    from .datapath import DataPlaneConfig
    from .engine import StoreEngine
    from .protocol import Limits
    from .server import StoreServer

    prog = "sglang-pic store"
    ap = argparse.ArgumentParser(prog=prog, description="Run a PTStore server.")
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:7400",
                    help="zmq endpoint to bind (default: loopback only; tcp://0.0.0.0:7400 for "
                         "every interface)")
    ap.add_argument("--memory-gb", type=float, default=4.0, help="host memory for tensors")
    ap.add_argument("--replica-fraction", type=float, default=0.3,
                    help="share of memory for replicas of tensors owned by other servers")
    ap.add_argument("--ssd-dir", default=None, help="SSD tier for owned tensors (survives restart)")
    ap.add_argument("--ssd-gb", type=float, default=64.0,
                    help="SSD tier budget, capped by the filesystem's free space less 5%% of its "
                         "size (0: that cap alone)")
    ap.add_argument("--token-file", default=None,
                    help=f"accepted tokens, one per line: TOKEN or NAME TOKEN (a tenant each); "
                         f"default: ${STORE_TOKEN_ENV}")
    ap.add_argument("--token", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--insecure", action="store_true",
                    help="serve without authentication or encryption (loopback / private "
                         "testing only: anyone who reaches the port reads and writes every page)")
    ap.add_argument("--max-tensor-mb", type=float, default=64.0)
    ap.add_argument("--copy-threads", type=int, default=4,
                    help="threads copying pages into same-node readers' memory")
    ap.add_argument("--data-port", type=int, default=0,
                    help="port of the TCP data plane, on the endpoint's host (default: any free "
                         "port; readers learn it over the control channel)")
    ap.add_argument("--no-data-plane", action="store_true",
                    help="no TCP data plane: remote readers get pages inside the CURVE replies")
    ap.add_argument("--data-tls-cert", default=None,
                    help="PEM certificate: data-plane streams are TLS 1.3, the certificate "
                         "pinned by readers through the control channel (with --data-tls-key)")
    ap.add_argument("--data-tls-key", default=None, help="PEM private key of --data-tls-cert")
    args = ap.parse_args(argv)
    if args.copy_threads < 1:
        ap.error("--copy-threads must be >= 1")
    if bool(args.data_tls_cert) != bool(args.data_tls_key):
        ap.error("--data-tls-cert and --data-tls-key go together")
    if not 0 <= args.data_port < 65536:
        ap.error("--data-port must be within 0..65535")
    tokens, failed = _secret(prog, args, server_tokens)
    if failed:
        return failed
    if tokens is None and not args.insecure:
        return _fail(prog, f"no token: give --token-file PATH or {STORE_TOKEN_ENV}, or "
                           "--insecure to serve anyone who reaches the endpoint")
    if tokens is not None and args.insecure:
        return _fail(prog, "--insecure and a token exclude each other")
    engine = StoreEngine(int(args.memory_gb * (1 << 30)), args.replica_fraction, args.ssd_dir,
                         int(args.ssd_gb * (1 << 30)))
    server = StoreServer(engine, args.endpoint, tokens,
                         Limits(max_tensor_bytes=int(args.max_tensor_mb * (1 << 20))),
                         copy_threads=args.copy_threads,
                         data_plane=None if args.no_data_plane else DataPlaneConfig(
                             port=args.data_port, tls_cert=args.data_tls_cert,
                             tls_key=args.data_tls_key))
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    server.start()
    auth = (f"{len(tokens)} token(s), server key {server.server_key}" if tokens
            else "INSECURE: no authentication")
    ssd = f", SSD {engine.ssd.budget / (1 << 30):.1f} GB" if engine.ssd is not None else ""
    data = "no data plane" if server.data is None else (
        f"data plane on port {server.data.port}, "
        + ("TLS" if server.data.tls is not None else "plain TCP"))
    print(f"PTStore server on {args.endpoint} ({args.memory_gb} GB{ssd}, "
          f"{len(engine.objects)} objects recovered; {auth}; {data})", flush=True)
    done.wait()
    engine.flush_to_ssd()
    server.stop()
    return 0


def status(argv: list[str]) -> int:
    from .auth import client_token
    from .client import StoreClient

    prog = "sglang-pic store-status"
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("endpoints", nargs="+")
    ap.add_argument("--token-file", default=None,
                    help=f"the token (first of the file); default: ${STORE_TOKEN_ENV}; none: "
                         "only --insecure servers answer")
    ap.add_argument("--token", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--server-key", default=None,
                    help="the servers' public key, when it is not derived from this token")
    args = ap.parse_args(argv)
    token, failed = _secret(prog, args, client_token)
    if failed:
        return failed
    client = StoreClient(args.endpoints, token, timeout_ms=2000, server_key=args.server_key)
    code = 0
    for ep in args.endpoints:
        st = client.status(ep)
        if st is None:
            hint = "" if token else " (no token: a server with tokens answers no one without)"
            print(f"{ep}: no answer{hint}")
            code = 1
        else:
            print(f"{ep}: {json.dumps(st)}")
    client.close()
    return code
