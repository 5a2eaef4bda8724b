"""Data-plane candidates for PTStore (issue 25): N pages from one process to another, over loopback.

One command moves ``--pages`` pages of ``--page-mb`` MiB (default 256 x 1 MiB, the batched get of
docs/store.md) from a server process into a preallocated buffer of a client process, ``--samples``
times after one warm-up, for each transport below, and prints GB/s (10^9 bytes/s; median, min-max).
Every variant runs in two fresh processes (server and client), so a transport that crashes or
does not install costs one row (its error line), never the run. The first fetch of each variant is
verified against the server's XXH3 of its pages.

Variants (``--variants`` picks, comma-separated):

- ``tcp-1`` / ``tcp-4``: raw TCP, ``sendall`` of memoryview slices / ``recv_into`` the buffer, 1 or
  4 connections (a thread each on both sides), a 16-byte request per connection. The floor.
- ``tcp-4-xxh3``: the same, the client hashing every page (XXH3-64) in its receiving thread and
  comparing it to the server's checksum: integrity as PTStore checks it today.
- ``tls-1`` / ``tls-4``: TLS 1.3 (Python's ``ssl``, OpenSSL; self-signed server certificate pinned
  by its SHA-256, a 32-byte ticket sent first by the client and compared in constant time):
  authenticated and encrypted multi-stream TCP.
- ``zmq``: one zmq DEALER/ROUTER connection, the reply one multipart message of page frames
  (zero-copy send), each frame ``recv_into`` the buffer: PTStore's socket path with ``--insecure``.
- ``zmq-curve`` / ``zmq-curve-4``: the same with CurveZMQ (PTStore's path with a token), on one
  connection, and on 4 connections with 4 zmq I/O threads per side.
- ``mooncake-tcp``: Mooncake Transfer Engine (``mooncake.engine.TransferEngine``), ``tcp``
  protocol, ``P2PHANDSHAKE`` metadata (no etcd/HTTP metadata server), the client doing one
  ``batch_transfer_sync_read`` of the N pages from the server's registered buffer.
- ``nixl-ucx-tcp``: NIXL agents with the UCX backend restricted to TCP (``UCX_TLS=tcp``), metadata
  fetched from the server agent's listener, one ``READ`` transfer of the N pages (the client
  busy-polls ``check_xfer_state`` as NIXL's examples do; ``BENCH_NIXL_POLL_S`` sleeps between
  polls instead). ``nixl-ucx-tcp-8m``: the same with UCX's TCP socket buffers at 8 MiB.

The candidates are in no requirements file; for a measurement install them into the venv by hand:
``pip install --no-deps mooncake-transfer-engine-non-cuda nixl-cu13`` (``-cuda13`` builds on a
GPU host), and on Debian ``apt-get install libibverbs1`` (Mooncake's ``engine.so`` links it even
in the non-CUDA build). A candidate that is not installed, or fails, is recorded with the reason
(its error line) instead of a number. Writes
``benchmark/results/store_transport_cpu.json`` (``--smoke``: 16 pages, 3 samples, the temp smoke
folder).

    python -m benchmark.store.bench_transport [--pages 256] [--page-mb 1] [--samples 5]
        [--rounds 1] [--variants tcp-1,tcp-4,zmq,zmq-curve] [--out PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import importlib.metadata
import json
import os
import platform
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from sglang_pic.store.datapath import recv_exact  # the data plane's own receive loop

from benchmark import description

VARIANTS: dict[str, dict] = {
    "tcp-1": {"kind": "tcp", "streams": 1},
    "tcp-4": {"kind": "tcp", "streams": 4},
    "tcp-4-xxh3": {"kind": "tcp", "streams": 4, "verify": True},
    "tls-1": {"kind": "tls", "streams": 1},
    "tls-4": {"kind": "tls", "streams": 4},
    "zmq": {"kind": "zmq", "streams": 1},
    "zmq-curve": {"kind": "zmq", "streams": 1, "curve": True},
    "zmq-curve-4": {"kind": "zmq", "streams": 4, "curve": True},
    "mooncake-tcp": {"kind": "mooncake", "streams": 1},
    "nixl-ucx-tcp": {"kind": "nixl", "streams": 1},
    "nixl-ucx-tcp-8m": {"kind": "nixl", "streams": 1},
}
# Environment of both processes of a variant (what makes the candidate use TCP on loopback).
_UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
VARIANT_ENV = {
    "nixl-ucx-tcp": _UCX_TCP,
    # UCX's own socket buffers: 2-3x the default's throughput here (4 MiB rmem_max/wmem_max)
    "nixl-ucx-tcp-8m": {**_UCX_TCP, "UCX_TCP_SNDBUF": "8m", "UCX_TCP_RCVBUF": "8m"},
}
REQ = struct.Struct("<QQ")  # first page, page count
TICKET_BYTES = 32
READY, RESULT = "@@ready ", "@@result "  # line prefixes: the candidates' libraries print to stdout
DISTS = {
    "mooncake": ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine",
                 "mooncake-transfer-engine-cuda13"),
    "nixl": ("nixl-cu13", "nixl-cu12", "nixl"),
    "ucx": ("libucx-cu13", "libucx-cu12"),
}


# ---------------------------------------------------------------------------------------------
# shared helpers



def _mooncake_engine(buf):
    """A Mooncake TransferEngine on loopback TCP (P2P handshake, no metadata server) with
    ``buf`` registered: the same set-up on both sides of the transfer."""
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    rc = te.register_memory(buf.ctypes.data, buf.nbytes)
    if rc != 0:
        raise RuntimeError(f"TransferEngine.register_memory returned {rc}")
    return te

def _buffer(nbytes: int, fill: bool):
    """A numpy buffer, every page touched (so page faults are not timed)."""
    import numpy as np

    if fill:
        rng = np.random.default_rng(0)
        return np.frombuffer(rng.bytes(nbytes), dtype=np.uint8).copy()
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0)
    return buf


def _page_sums(buf, pages: int, page: int) -> list[int]:
    import xxhash

    mv = memoryview(buf)
    return [xxhash.xxh3_64_intdigest(mv[i * page:(i + 1) * page]) for i in range(pages)]


def _ranges(pages: int, streams: int) -> list[tuple[int, int]]:
    """Split pages into `streams` contiguous (first, count) ranges."""
    base, extra = divmod(pages, streams)
    out, first = [], 0
    for i in range(streams):
        n = base + (1 if i < extra else 0)
        out.append((first, n))
        first += n
    return out


def _dist_version(names) -> str | None:
    for name in names:
        try:
            return f"{name}=={importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _tls_material(folder: Path) -> tuple[str, str]:
    """A throwaway self-signed P-256 certificate (openssl CLI; the venv has no `cryptography`)."""
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-subj", "/CN=ptstore-bench", "-days", "1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True)
    return str(key), str(cert)


# ---------------------------------------------------------------------------------------------
# servers (child process: `--serve VARIANT`): print the READY line, serve until stdin closes


def serve(variant: str, pages: int, page: int, tls_key: str | None, tls_cert: str | None) -> None:
    spec = VARIANTS[variant]
    kind = spec["kind"]
    buf = _buffer(pages * page, fill=True)
    sums = _page_sums(buf, pages, page)
    info: dict = {"sums": sums}
    keep: list = []  # objects that must stay alive while serving

    if kind in ("tcp", "tls"):
        mv = memoryview(buf)
        ctx = None
        ticket = os.urandom(TICKET_BYTES)
        if kind == "tls":
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            ctx.load_cert_chain(tls_cert, tls_key)
            info["cert_sha256"] = hashlib.sha256(
                ssl.PEM_cert_to_DER_cert(Path(tls_cert).read_text())).hexdigest()
            info["ticket"] = ticket.hex()  # in PTStore: handed out over the CURVE control plane
        lsock = socket.create_server(("127.0.0.1", 0))
        info["port"] = lsock.getsockname()[1]

        def handle(conn: socket.socket) -> None:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                if ctx is not None:
                    conn = ctx.wrap_socket(conn, server_side=True)
                    got = bytearray(TICKET_BYTES)
                    if not recv_exact(conn, memoryview(got)) or not hmac.compare_digest(
                            bytes(got), ticket):
                        conn.close()
                        return
                hdr = bytearray(REQ.size)
                while recv_exact(conn, memoryview(hdr)):
                    first, count = REQ.unpack(hdr)
                    conn.sendall(mv[first * page:(first + count) * page])
            except OSError:
                pass
            finally:
                conn.close()

        def accept() -> None:
            while True:
                conn, _ = lsock.accept()
                threading.Thread(target=handle, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()

    elif kind == "zmq":
        import zmq

        zctx = zmq.Context(io_threads=spec["streams"])
        sock = zctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if spec.get("curve"):
            public, secret = zmq.curve_keypair()
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = public, secret
            info["server_key"] = public.decode()
        info["port"] = sock.bind_to_random_port("tcp://127.0.0.1")
        mv = memoryview(buf)

        def loop() -> None:
            while True:
                ident, req = sock.recv_multipart()
                first, count = REQ.unpack(req)
                frames = [mv[i * page:(i + 1) * page] for i in range(first, first + count)]
                sock.send_multipart([ident, *frames], copy=False)

        threading.Thread(target=loop, daemon=True).start()
        keep += [zctx, sock]

    elif kind == "mooncake":
        te = _mooncake_engine(buf)
        info["session"] = f"127.0.0.1:{te.get_rpc_port()}"
        info["addr"] = buf.ctypes.data
        keep.append(te)

    elif kind == "nixl":
        nixl_agent, nixl_agent_config = _nixl()
        port = _free_port()
        cfg = nixl_agent_config(enable_prog_thread=True, enable_listen_thread=True,
                                listen_port=port, backends=["UCX"])
        agent = nixl_agent("ptstore-bench-server", cfg)
        descs = agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        if agent.register_memory(descs) is None:
            raise RuntimeError("nixl register_memory failed")
        info["port"] = port
        info["addr"] = buf.ctypes.data
        keep += [agent, descs]

    print(READY + json.dumps(info), flush=True)
    sys.stdin.read()  # the orchestrator closes stdin when the client is done
    os._exit(0)


def _nixl():
    """NIXL's agent classes: `nixl-cu13` installs the module `nixl_cu13`, the `nixl` meta package
    the module `nixl`."""
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def _free_port() -> int:
    from benchmark.harness import free_port

    return free_port()


# ---------------------------------------------------------------------------------------------
# clients (child process: `--client VARIANT`, the server's READY line on stdin): print RESULT


def client(variant: str, pages: int, page: int, samples: int, info: dict) -> None:
    spec = VARIANTS[variant]
    kind, streams = spec["kind"], spec["streams"]
    buf = _buffer(pages * page, fill=False)
    mv = memoryview(buf)
    extra: dict = {}
    fetch = None  # a function that moves all pages into buf once
    cleanup = []

    if kind in ("tcp", "tls"):
        import xxhash

        verify = bool(spec.get("verify"))
        sums = info["sums"]
        socks = []
        ctx = None
        if kind == "tls":
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE  # pinned below by the certificate's SHA-256
        for _ in range(streams):
            s = socket.create_connection(("127.0.0.1", info["port"]))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ctx is not None:
                s = ctx.wrap_socket(s)
                if hashlib.sha256(s.getpeercert(binary_form=True)).hexdigest() != info[
                        "cert_sha256"]:
                    raise RuntimeError("server certificate does not match the pinned digest")
                s.sendall(bytes.fromhex(info["ticket"]))
                extra["cipher"] = s.cipher()[0]
                extra["tls_version"] = s.version()
            socks.append(s)
        ranges = _ranges(pages, streams)
        bad = [0]

        def one(i: int) -> None:
            s, (first, count) = socks[i], ranges[i]
            s.sendall(REQ.pack(first, count))
            if verify:
                for p in range(first, first + count):
                    part = mv[p * page:(p + 1) * page]
                    if not recv_exact(s, part):
                        raise RuntimeError("connection closed")
                    if xxhash.xxh3_64_intdigest(part) != sums[p]:
                        bad[0] += 1
            elif not recv_exact(s, mv[first * page:(first + count) * page]):
                raise RuntimeError("connection closed")

        fetch = _threaded(one, streams)
        cleanup += [s.close for s in socks]

    elif kind == "zmq":
        import zmq

        zctx = zmq.Context(io_threads=streams)
        socks = []
        for _ in range(streams):
            s = zctx.socket(zmq.DEALER)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            if spec.get("curve"):
                s.curve_serverkey = info["server_key"].encode()
                s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
            s.connect(f"tcp://127.0.0.1:{info['port']}")
            socks.append(s)
        ranges = _ranges(pages, streams)

        def one(i: int) -> None:
            s, (first, count) = socks[i], ranges[i]
            s.send(REQ.pack(first, count))
            for p in range(first, first + count):
                n = s.recv_into(mv[p * page:(p + 1) * page])
                if n != page:
                    raise RuntimeError(f"frame of {n} bytes, expected {page}")
            if s.get(zmq.RCVMORE):
                raise RuntimeError("more frames than pages")

        fetch = _threaded(one, streams)
        cleanup += [lambda: [s.close(0) for s in socks], zctx.term]

    elif kind == "mooncake":
        te = _mooncake_engine(buf)
        local = [buf.ctypes.data + i * page for i in range(pages)]
        remote = [info["addr"] + i * page for i in range(pages)]
        lengths = [page] * pages

        def fetch() -> None:
            rc = te.batch_transfer_sync_read(info["session"], local, remote, lengths)
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_read returned {rc}")

        cleanup.append(lambda: te.unregister_memory(buf.ctypes.data))

    elif kind == "nixl":
        nixl_agent, nixl_agent_config = _nixl()
        # the listener thread also runs this agent's side of the metadata exchange
        cfg = nixl_agent_config(enable_prog_thread=True, enable_listen_thread=True,
                                listen_port=_free_port(), backends=["UCX"])
        agent = nixl_agent("ptstore-bench-client", cfg)
        reg = agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        if agent.register_memory(reg) is None:
            raise RuntimeError("nixl register_memory failed")
        peer = "ptstore-bench-server"
        agent.fetch_remote_metadata(peer, "127.0.0.1", info["port"])
        deadline = time.monotonic() + 30
        while not agent.check_remote_metadata(peer):
            if time.monotonic() > deadline:
                raise RuntimeError("no metadata from the server agent within 30 s")
            time.sleep(0.01)
        local = agent.get_xfer_descs(
            [(buf.ctypes.data + i * page, page, 0) for i in range(pages)], "DRAM")
        remote = agent.get_xfer_descs(
            [(info["addr"] + i * page, page, 0) for i in range(pages)], "DRAM")
        handle = agent.initialize_xfer("READ", local, remote, peer, b"bench")
        # 0: busy-poll as NIXL's examples do; on 2 cores that takes a core from UCX's threads
        poll_sleep = float(os.environ.get("BENCH_NIXL_POLL_S", "0"))
        extra["poll_sleep_s"] = poll_sleep
        if not handle:
            raise RuntimeError("nixl initialize_xfer failed")

        def fetch() -> None:
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                if poll_sleep:
                    time.sleep(poll_sleep)
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError("nixl transfer ended in ERR")

        cleanup.append(lambda: agent.release_xfer_handle(handle))

    # warm-up, verified against the server's checksums
    fetch()
    got = _page_sums(buf, pages, page)
    verified = got == info["sums"]
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fetch()
        times.append(time.perf_counter() - t0)
    if kind in ("tcp", "tls") and spec.get("verify"):
        extra["pages_failing_checksum"] = bad[0]
    for fn in cleanup:
        try:
            fn()
        except Exception:  # teardown only: the numbers are already taken
            pass
    print(RESULT + json.dumps({"samples_s": times, "verified": verified, **extra}), flush=True)
    os._exit(0)


def _threaded(one, streams: int):
    """fetch(): run one(i) for every stream, on a persistent pool of threads (stream 0 inline)."""
    if streams == 1:
        return lambda: one(0)
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(streams - 1)

    def fetch() -> None:
        futs = [pool.submit(one, i) for i in range(1, streams)]
        one(0)
        for f in futs:
            f.result()

    return fetch


# ---------------------------------------------------------------------------------------------
# orchestrator


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln or "ERROR" in ln]
    return (errs or lines or ["(no output)"])[-1][:400]


def run_variant(variant: str, args, tls: tuple[str, str] | None) -> dict:
    spec = VARIANTS[variant]
    env = dict(os.environ, **VARIANT_ENV.get(variant, {}))
    me = [sys.executable, "-m", "benchmark.store.bench_transport"]  # from the repository root
    common = ["--pages", str(args.pages), "--page-bytes", str(args.page_bytes)]
    srv_cmd = [*me, "--serve", variant, *common]
    if tls:
        srv_cmd += ["--tls-key", tls[0], "--tls-cert", tls[1]]
    srv_err = tempfile.TemporaryFile(mode="w+")  # a pipe could fill with a library's logging
    srv = subprocess.Popen(srv_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=srv_err, text=True, env=env)
    try:
        ready = ""
        for line in srv.stdout:
            if line.startswith(READY):
                ready = line[len(READY):]
                break
        if not ready:
            srv.wait(timeout=30)
            srv_err.seek(0)
            return {"error": f"server: {_last_line(srv_err.read())}"}
        cli = subprocess.run(
            [*me, "--client", variant, *common, "--samples", str(args.samples)],
            input=ready, capture_output=True, text=True, env=env, timeout=args.timeout)
        found = [ln[len(RESULT):] for ln in cli.stdout.splitlines() if ln.startswith(RESULT)]
        if cli.returncode != 0 or not found:
            return {"error": f"client (rc {cli.returncode}): {_last_line(cli.stderr)}"}
        res = json.loads(found[-1])
    except subprocess.TimeoutExpired:
        return {"error": f"client did not finish within {args.timeout} s"}
    finally:
        try:
            srv.stdin.close()
            srv.wait(timeout=10)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            srv.kill()
            srv.wait()
        srv_err.close()
    nbytes = args.pages * args.page_bytes
    rates = [nbytes / t / 1e9 for t in res["samples_s"]]
    return {
        "streams": spec["streams"],
        "gbps_median": statistics.median(rates),
        "gbps_min": min(rates),
        "gbps_max": max(rates),
        "gbps_samples": rates,
        **res,
    }


def _merge(rounds: list[dict]) -> dict:
    """One variant's rounds: every sample pooled (median, min-max), each round kept."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {"error": rounds[-1]["error"], "rounds": rounds}
    rates = [x for r in ok for x in r["gbps_samples"]]
    return {
        "streams": ok[0]["streams"],
        "gbps_median": statistics.median(rates),
        "gbps_min": min(rates),
        "gbps_max": max(rates),
        "round_medians": [r["gbps_median"] for r in ok],
        "verified": all(r["verified"] for r in ok),
        "failed_rounds": len(rounds) - len(ok),
        "rounds": rounds,
    }


def cipher_speed() -> dict:
    """One core's AEAD speed on 16 KiB blocks (``openssl speed``): the ceiling of an encrypted
    stream per core. TLS 1.3 here negotiates AES-256-GCM; ChaCha20-Poly1305 is the closest
    OpenSSL has to CurveZMQ's XSalsa20-Poly1305 (libsodium)."""
    out = {}
    for cipher in ("aes-256-gcm", "chacha20-poly1305"):
        try:
            text = subprocess.run(
                ["openssl", "speed", "-evp", cipher, "-bytes", "16384", "-seconds", "2"],
                capture_output=True, text=True, timeout=60).stdout
            last = text.strip().splitlines()[-1].split()
            out[cipher] = float(last[-1].rstrip("k")) * 1e3 / 1e9
        except (OSError, IndexError, ValueError, subprocess.TimeoutExpired) as e:
            out[cipher] = f"not measured: {e}"
    return out


def machine() -> dict:
    from benchmark.harness import environment

    info = environment()
    info["cpus"] = os.cpu_count()
    info["platform"] = platform.platform()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines()
                           if ln.startswith("model name"))
        flags = next(ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines()
                     if ln.startswith("flags"))
        info["cpu_crypto_flags"] = sorted({"aes", "vaes", "avx2", "avx512f", "sha_ni"} & set(flags))
    except (OSError, StopIteration):
        pass
    for key in ("net/core/rmem_max", "net/core/wmem_max", "net/ipv4/tcp_rmem", "net/ipv4/tcp_wmem"):
        try:
            info[key.replace("/", ".")] = Path("/proc/sys", key).read_text().split()
        except OSError:
            pass
    return info


def versions() -> dict:
    import xxhash
    import zmq

    out = {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "xxhash": xxhash.VERSION,
           "openssl": ssl.OPENSSL_VERSION}
    for key, names in DISTS.items():
        out[key] = _dist_version(names)
    try:  # Mooncake's engine.so links libibverbs even in its non-CUDA TCP build (Debian: libibverbs1)
        out["libibverbs1"] = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", "libibverbs1"],
            capture_output=True, text=True).stdout or None
    except OSError:
        out["libibverbs1"] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-mb", type=float, default=1.0)
    ap.add_argument("--page-bytes", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variant list this many times, alternating; samples pooled")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--timeout", type=float, default=300.0, help="per variant client, seconds")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="16 pages, 3 samples, temp folder")
    ap.add_argument("--serve", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--client", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--tls-key", help=argparse.SUPPRESS)
    ap.add_argument("--tls-cert", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.page_bytes is None:
        args.page_bytes = int(args.page_mb * (1 << 20))

    if args.serve:
        serve(args.serve, args.pages, args.page_bytes, args.tls_key, args.tls_cert)
        return
    if args.client:
        client(args.client, args.pages, args.page_bytes, args.samples,
               json.loads(sys.stdin.readline()))
        return

    if args.smoke:
        args.pages, args.samples = 16, 3
    if args.samples < 3:
        ap.error("--samples must be at least 3 (the table reports a median and its range)")
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.out:
        out = Path(args.out)
    else:
        from benchmark.harness import RESULTS, smoke_dir

        folder = Path(smoke_dir()) if args.smoke else RESULTS
        out = folder / "store_transport_cpu.json"

    runs: dict[str, list[dict]] = {v: [] for v in chosen}
    with tempfile.TemporaryDirectory(prefix="ptstore-bench-tls-") as tmp:
        tls = _tls_material(Path(tmp)) if any(VARIANTS[v]["kind"] == "tls" for v in chosen) \
            else None
        for rnd in range(args.rounds):  # rounds alternate the variants (this VM drifts)
            for v in chosen:
                t0 = time.time()
                load = os.getloadavg()[0]
                r = run_variant(v, args, tls)
                r["loadavg_1min_before"] = load  # other work on the machine shows here
                runs[v].append(r)
                took = time.time() - t0
                tag = f"{v:<16} round {rnd + 1}/{args.rounds}"
                if "error" in r:
                    print(f"{tag} error: {r['error']}  ({took:.0f} s)", flush=True)
                else:
                    print(f"{tag} {r['gbps_median']:.2f} GB/s ({r['gbps_min']:.2f}-"
                          f"{r['gbps_max']:.2f}) verified={r['verified']}  ({took:.0f} s)",
                          flush=True)
    results = {v: _merge(rs) for v, rs in runs.items()}

    report = {
        "benchmark": "store_transport",
        "what": f"{args.pages} pages of {args.page_bytes} bytes, server process -> preallocated "
                "buffer of a client process over loopback; GB/s = 1e9 bytes/s; one warm-up "
                "(verified) then the samples",
        "machine": machine(),
        "versions": versions(),
        "cipher_gbps_one_core_16k": cipher_speed(),
        "config": {"pages": args.pages, "page_bytes": args.page_bytes, "samples": args.samples,
                   "rounds": args.rounds, "variants": chosen, "variant_env": VARIANT_ENV,
                   "smoke": args.smoke},
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"\n{args.pages} x {args.page_bytes / (1 << 20):g} MiB, {args.rounds} x {args.samples} "
          f"samples, {os.cpu_count()} CPUs, loopback")
    print(f"| {'variant':<16} | streams | GB/s median | min-max | round medians | verified |")
    print(f"|{'-' * 18}|--------:|------------:|---------|---------------|----------|")
    for v, r in results.items():
        if "error" in r:
            print(f"| {v:<16} | - | - | - | - | {r['error'][:120]} |")
        else:
            meds = " / ".join(f"{m:.2f}" for m in r["round_medians"])
            print(f"| {v:<16} | {r['streams']} | {r['gbps_median']:.2f} | "
                  f"{r['gbps_min']:.2f}-{r['gbps_max']:.2f} | {meds} | {r['verified']} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
