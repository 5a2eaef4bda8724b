"""`sglang-pic store ...` (run a PTStore server) and `sglang-pic store-status ...`.

Tokens never go on the command line (any user sees it in ``ps``): a server reads them from
``--token-file`` (one per line, ``TOKEN`` or ``NAME TOKEN``, mode 600) or ``$SGLANG_PIC_STORE_TOKEN``
(one token); ``store-status`` reads its one token the same way. A server without a token refuses
to start unless ``--insecure`` says it is meant to serve anyone who reaches it.

Every value is checked before anything starts: numbers within their ranges (finite; a budget
neither negative nor zero where zero means nothing, the memory budget no larger than the host's
memory), the endpoint's form, the TLS files, the SSD folder and the bind. A bad one is refused in
one line (``sglang-pic store: error: ...``, exit status 2), never with a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn, TypeVar

from .auth import STORE_TOKEN_ENV

T = TypeVar("T")
N = TypeVar("N", int, float)

MIN_GB = 0.001
"""The smallest memory or SSD budget (about 1 MiB): a smaller positive value would round to 0
bytes, and an SSD budget of 0 means "the filesystem's room" - a typo must not lift the bound."""
MAX_SSD_GB = float(1 << 20)
"""1 PiB: far past any disk (the budget is capped by the filesystem's room anyway), and small
enough that the byte count is an exact integer."""
MIN_TENSOR_MB, MAX_TENSOR_MB = 0.001, 1024.0
"""A page of at least about 1 KB, and at most the protocol's 1 GiB message limit (a larger
page could never be put)."""
MAX_COPY_THREADS = 256
"""Copy threads are started as pages come; thousands would only contend for the cores."""
_TCP_PORT = re.compile(r"[0-9]{1,5}")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``PROG: error: MESSAGE`` (exit status 2):
    argparse prints its usage first otherwise, a dozen lines that bury the one that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _in_range(parse: Callable[[str], N], ok: Callable[[N], bool], what: str
              ) -> Callable[[str], N]:
    """An argparse ``type``: ``parse(text)`` if it is finite and ``ok``; otherwise an error
    naming ``what`` the flag takes (argparse prefixes the flag's name)."""

    def check(text: str) -> N:
        try:
            value = parse(text)
            good = math.isfinite(value) and ok(value)
        except (ValueError, OverflowError):  # not a number; past a float (or 4300 digits)
            good = False
        if not good:
            shown = text if len(text) <= 40 else text[:37] + "..."
            raise argparse.ArgumentTypeError(f"must be {what}, not {shown!r}")
        return value

    return check


def _host_memory_gb() -> float:
    """This host's physical memory in GB; a budget past it would never make the store evict
    (the kernel would kill it first). ``MAX_SSD_GB`` where the host does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError, AttributeError):
        return MAX_SSD_GB


def _endpoint_error(endpoint: str, what: str = "--endpoint", bind: bool = True) -> str | None:
    """Why ``endpoint`` cannot be bound (``bind``) or connected to as given (None: it can):
    ``tcp://HOST:PORT`` with a port of 1..65535 (or ``*``, any, to bind), or ``ipc://PATH``.
    zmq takes a port past 65535 modulo 65536, silently binding another."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return None
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if endpoint.startswith("tcp://") and sep and host and (
            (bind and port == "*") or (_TCP_PORT.fullmatch(port) and 1 <= int(port) <= 65535)):
        return None
    return f"{what} must be tcp://HOST:PORT (port 1..65535) or ipc://PATH, not {endpoint!r}"


def _server_key_error(key: str) -> str | None:
    """Why ``key`` is not a server's public key as ``sglang-pic store`` prints it (None: it
    is): 40 characters of z85."""
    from zmq.utils.z85 import Z85CHARS

    if len(key) == 40 and all(c.isascii() and ord(c) in Z85CHARS for c in key):
        return None
    return "--server-key must be 40 characters of z85, as `sglang-pic store` prints it"


def _tls_error(cert: str, key: str) -> str | None:
    """Why the data plane's certificate and key cannot be used (None: they can). Checked
    here: the server itself would start without a data plane, naming only a listening error."""
    import ssl

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        return f"--data-tls-cert / --data-tls-key: {e}"
    return None

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


OPEN_FILES_WANTED = 1 << 16


def _raise_open_files() -> int:
    """Raise this process's open-file limit towards its hard limit (``OPEN_FILES_WANTED`` at
    most), and return the limit. Every connection holds a descriptor until it authenticates
    or its handshake times out (``auth.HANDSHAKE_MS``): at the usual soft limit of 1024, a peer
    opening silent connections faster than they time out would lock every new client out,
    and the SSD tier out of its files."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):  # the kernel's own cap (fs.nr_open) is lower
            pass
    return soft


def serve(argv: list[str]) -> int:
    import zmq

    from .auth import server_tokens
    from .datapath import DataPlaneConfig
    from .engine import StoreEngine
    from .protocol import Limits
    from .server import StoreServer

    prog = "sglang-pic store"
    ap = _Parser(prog=prog, description="Run a PTStore server.")
    ram = _host_memory_gb()
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:7400",
                    help="zmq endpoint to bind (default: loopback only; tcp://0.0.0.0:7400 for "
                         "every interface)")
    ap.add_argument("--memory-gb", default=4.0,
                    help="host memory for tensors (data-plane transfers in flight hold at most "
                         "a quarter more)",
                    type=_in_range(float, lambda v: MIN_GB <= v <= ram,
                                   f"a number of GB from {MIN_GB} to {ram:.1f} (this host's "
                                   "memory)"))
    ap.add_argument("--replica-fraction", default=0.3,
                    help="share of memory for replicas of tensors owned by other servers",
                    type=_in_range(float, lambda v: 0 <= v < 1, "a fraction, at least 0 and "
                                                               "below 1"))
    ap.add_argument("--ssd-dir", default=None, help="SSD tier for owned tensors (survives restart)")
    ap.add_argument("--ssd-gb", default=64.0,
                    help="SSD tier budget, pages and object journal, capped by the filesystem's "
                         "free space less 5%% of its size (0: that cap alone)",
                    type=_in_range(float, lambda v: v == 0 or MIN_GB <= v <= MAX_SSD_GB,
                                   f"0 (the filesystem's room) or a number of GB from {MIN_GB} "
                                   f"to {MAX_SSD_GB:.0f}"))
    ap.add_argument("--token-file", default=None,
                    help=f"accepted tokens, one per line: TOKEN or NAME TOKEN (a tenant each); "
                         f"default: ${STORE_TOKEN_ENV}")
    ap.add_argument("--token", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--insecure", action="store_true",
                    help="serve without authentication or encryption (loopback / private "
                         "testing only: anyone who reaches the port reads and writes every page)")
    ap.add_argument("--max-tensor-mb", default=64.0, help="the largest page a put may hold",
                    type=_in_range(float, lambda v: MIN_TENSOR_MB <= v <= MAX_TENSOR_MB,
                                   f"a number of MB from {MIN_TENSOR_MB} to {MAX_TENSOR_MB:.0f}"))
    ap.add_argument("--copy-threads", default=4,
                    help="threads copying pages into same-node readers' memory",
                    type=_in_range(int, lambda v: 1 <= v <= MAX_COPY_THREADS,
                                   f"a whole number from 1 to {MAX_COPY_THREADS}"))
    ap.add_argument("--data-port", default=0,
                    help="port of the TCP data plane, on the endpoint's host (default: any free "
                         "port; readers learn it over the control channel)",
                    type=_in_range(int, lambda v: 0 <= v < 65536,
                                   "a port from 0 (any free one) to 65535"))
    ap.add_argument("--no-data-plane", action="store_true",
                    help="no TCP data plane: remote readers get pages inside the CURVE replies")
    ap.add_argument("--data-tls-cert", default=None,
                    help="PEM certificate: data-plane streams are TLS 1.3, the certificate "
                         "pinned by readers through the control channel (with --data-tls-key)")
    ap.add_argument("--data-tls-key", default=None, help="PEM private key of --data-tls-cert")
    args = ap.parse_args(argv)
    if bool(args.data_tls_cert) != bool(args.data_tls_key):
        ap.error("--data-tls-cert and --data-tls-key go together")
    problem = _endpoint_error(args.endpoint) or (
        _tls_error(args.data_tls_cert, args.data_tls_key)
        if args.data_tls_cert and not args.no_data_plane else None)
    if problem:
        return _fail(prog, problem)
    tokens, failed = _secret(prog, args, server_tokens)
    if failed:
        return failed
    if tokens is None and not args.insecure:
        return _fail(prog, f"no token: give --token-file PATH or {STORE_TOKEN_ENV}, or "
                           "--insecure to serve anyone who reaches the endpoint")
    if tokens is not None and args.insecure:
        return _fail(prog, "--insecure and a token exclude each other")
    open_files = _raise_open_files()
    try:
        engine = StoreEngine(int(args.memory_gb * (1 << 30)), args.replica_fraction,
                             args.ssd_dir, int(args.ssd_gb * (1 << 30)))
    except OSError as e:  # the SSD folder cannot be made, read or written
        return _fail(prog, f"--ssd-dir {args.ssd_dir}: {e}")
    try:
        server = StoreServer(engine, args.endpoint, tokens,
                             Limits(max_tensor_bytes=int(args.max_tensor_mb * (1 << 20))),
                             copy_threads=args.copy_threads,
                             data_plane=None if args.no_data_plane else DataPlaneConfig(
                                 port=args.data_port, tls_cert=args.data_tls_cert,
                                 tls_key=args.data_tls_key))
    except (zmq.ZMQError, OSError) as e:  # in use, no such interface, no such folder
        return _fail(prog, f"cannot serve on {args.endpoint}: {e}")
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
          f"{len(engine.objects)} objects recovered; {auth}; {data}; "
          f"{open_files} open files)", flush=True)
    done.wait()
    engine.flush_to_ssd()
    server.stop()
    return 0


def status(argv: list[str]) -> int:
    import zmq

    from .auth import client_token
    from .client import StoreClient

    prog = "sglang-pic store-status"
    ap = _Parser(prog=prog)
    ap.add_argument("endpoints", nargs="+")
    ap.add_argument("--token-file", default=None,
                    help=f"the token (first of the file); default: ${STORE_TOKEN_ENV}; none: "
                         "only --insecure servers answer")
    ap.add_argument("--token", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--server-key", default=None,
                    help="the servers' public key, when it is not derived from this token")
    args = ap.parse_args(argv)
    problem = next((e for e in (_endpoint_error(ep, "an endpoint", bind=False)
                                for ep in args.endpoints) if e), None)
    if problem is None and args.server_key is not None:
        problem = _server_key_error(args.server_key)
    if problem:
        return _fail(prog, problem)
    token, failed = _secret(prog, args, client_token)
    if failed:
        return failed
    client = StoreClient(args.endpoints, token, timeout_ms=2000, server_key=args.server_key)
    code = 0
    try:
        for ep in args.endpoints:
            st = client.status(ep)
            if st is None:
                hint = "" if token else " (no token: a server with tokens answers no one without)"
                print(f"{ep}: no answer{hint}")
                code = 1
            else:
                print(f"{ep}: {json.dumps(st)}")
    except (zmq.ZMQError, ValueError) as e:  # what the checks above cannot foresee
        return _fail(prog, f"{ep}: {e}")
    finally:
        client.close()
    return code
