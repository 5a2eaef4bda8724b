"""The flags of ``sglang-pic fleet`` and every check made before anything starts.

A fleet start costs minutes of model loads, so a mistake must cost a second: the fleet's own
flags, the instances' serve flags (through the checks ``sglang-pic serve`` makes, without
importing SGLang or torch), the router's extra flags (through the router's own parser) and every
port are checked first, and the first problem is one line, ``sglang-pic fleet: error: ...``,
exit status 2, with nothing started.

Flags the fleet owns are refused among the serve flags rather than passed on: each instance's
port, its store endpoints and token, and its key are the fleet's to give, the same to all.
"""

from __future__ import annotations

import argparse
import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path

from sglang_pic import environment
from sglang_pic.launcher.server_flags import UsageError
from sglang_pic.security import api_key

PROG = "sglang-pic fleet"
DEFAULT_PORT = api_key.DEFAULT_PORT
"""The router's port: the port ``sglang-pic serve`` uses, so a client of one server (the README's
examples, the key file ``api-keys/30000``) talks to the fleet unchanged."""
DEFAULT_HOST = api_key.DEFAULT_HOST
"""The router binds loopback unless told otherwise (the router's own default is 0.0.0.0)."""
MAX_INSTANCES = 64
MAX_STORES = 64
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")
"""The router's ``--policy`` choices outside prefill/decode disaggregation (a test checks them
against the router's parser); ``cache_aware`` is the router's default and ours."""
DEFAULT_START_TIMEOUT_S = 900.0
"""How long an instance may take to answer ``/health``: a large model's load on a GPU takes
minutes; the embedded model on 2 CPU cores about half a minute."""

FLEET_OWNED = {
    "--ptstore": "the fleet starts the stores (--stores M) and points every instance at them",
    "--ptstore-token-file": "the fleet makes the store token and gives it to stores and instances",
    "--ptstore-server-key": "the fleet's stores derive their key from the fleet's token",
    "--api-key": "a key on the command line is seen by every user (ps); give the fleet's key "
                 f"with --api-key-file PATH or ${api_key.ENV}",
    "--insecure": "a fleet always has an API key (the router checks it and forwards it)",
    "--admin-api-key": "a key on the command line is seen by every user (ps); use "
                       f"--admin-api-key-file PATH or ${api_key.ADMIN_ENV}",
}
"""Serve flags the fleet refuses, with the reason the error gives."""

ROUTER_OWNED = {
    "--host": "use the fleet's --host",
    "--port": "use the fleet's --port",
    "--worker-urls": "the fleet gives the router its instances",
    "--policy": "use the fleet's --policy",
    "--api-key": "the fleet gives the router its key (never on a command line)",
    "--control-plane-api-keys": "keys on the command line are seen by every user (ps)",
    "--pd-disaggregation": "the fleet runs regular instances, not prefill/decode pairs",
    "--prefill": "the fleet runs regular instances, not prefill/decode pairs",
    "--decode": "the fleet runs regular instances, not prefill/decode pairs",
    "--service-discovery": "the fleet gives the router its instances",
    "--mini-lb": "the fleet runs SGLang's Rust router, not its debugging balancer",
    "--enable-igw": "one model per fleet",
}
"""Router flags the fleet sets itself (refused in ``--router-args``), and why."""


@dataclass
class FleetConfig:
    """What the command line asked for, checked."""

    instances: int
    stores: int
    host: str
    port: int
    policy: str
    instance_ports: list[int]
    store_ports: list[int]
    metrics_port: int
    store_memory_gb: float | None
    api_key_file: str | None
    log_dir: str | None
    router_args: list[str]
    start_timeout_s: float
    serve_args: list[str] = field(default_factory=list)
    gpu_per_instance: bool = False


class _Parser(argparse.ArgumentParser):
    """argparse reporting an error as one ``UsageError`` line (no usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message.removeprefix("argument "))


def _count(lo: int, hi: int):
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range ({lo}-{hi})")
        return value
    return parse


def _port(raw: str) -> int:
    return _count(1, 65535)(raw)


def _ports(raw: str) -> list[int]:
    return [_port(p.strip()) for p in raw.split(",") if p.strip()]


def _positive(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{raw!r} must be a positive number")
    return value


def _store_memory(raw: str) -> float:
    """A store's memory budget: what ``sglang-pic store --memory-gb`` takes, checked here so
    that a bad one fails before the instances load, not when the stores start."""
    from sglang_pic.store.cli import MIN_GB, _host_memory_gb

    value = _positive(raw)
    if not MIN_GB <= value <= _host_memory_gb():
        raise argparse.ArgumentTypeError(f"{value:g} GB is not in {MIN_GB}-"
                                         f"{_host_memory_gb():.1f} (this host's memory)")
    return value


def parser() -> _Parser:
    p = _Parser(prog=PROG, add_help=False, allow_abbrev=False,
                usage=f"{PROG} [--instances N] [--stores M] [fleet flags] [serve flags]",
                description="Start M PTStore servers, N `sglang-pic serve` instances using them "
                            "(HiCache's L3 tier, or the span store with --enable-span-cache) and "
                            "SGLang's router in front, with one API key. Every flag not listed "
                            "here goes to each instance (see sglang-pic serve --help). SIGTERM or "
                            "Ctrl-C drains the requests in flight and stops everything.",
                epilog="Docs: docs/fleet.md.")
    p.add_argument("-h", "--help", action="store_true", help="this help")
    p.add_argument("--instances", type=_count(1, MAX_INSTANCES), default=2, metavar="N",
                   help=f"sglang-pic serve instances (default 2; 1-{MAX_INSTANCES})")
    p.add_argument("--stores", type=_count(0, MAX_STORES), default=1, metavar="M",
                   help="PTStore servers on this machine (default 1; 0: instances without a "
                        "store)")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"the router's address (default {DEFAULT_HOST}: this machine only); "
                        "instances and stores always bind loopback")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT,
                   help=f"the router's port (default {DEFAULT_PORT})")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware",
                   help="the router's policy (default cache_aware: the instance whose cache "
                        "holds the longest text prefix, unless the load is unbalanced)")
    p.add_argument("--instance-ports", type=_ports, default=None, metavar="P,P,...",
                   help="the instances' ports, one each (default: free ports)")
    p.add_argument("--store-ports", type=_ports, default=None, metavar="P,P,...",
                   help="the store servers' ports, one each (default: free ports)")
    p.add_argument("--metrics-port", type=_port, default=None, metavar="P",
                   help="the router's Prometheus port, on loopback (default: a free port)")
    p.add_argument("--store-memory-gb", type=_store_memory, default=None, metavar="GB",
                   help="host memory of each store server (default: sglang-pic store's, 4)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help=f"the fleet's API key (mode 600); else ${api_key.ENV}; else a new key "
                        "at each start in the key file of the router's port")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="where each child's log goes (default: a new folder in $TMPDIR)")
    p.add_argument("--router-args", default="", metavar="'FLAGS'",
                   help="more flags for the router, in one quoted string (e.g. "
                        "'--health-check-interval-secs 10'); see python -m "
                        "sglang_router.launch_router --help")
    p.add_argument("--gpu-per-instance", action="store_true",
                   help="instance i runs on GPU i with the whole of it (SGLang's "
                        "--base-gpu-id); default: the instances share GPU 0")
    p.add_argument("--start-timeout", type=_positive, default=DEFAULT_START_TIMEOUT_S,
                   metavar="S", help="seconds an instance may take to start (default "
                                     f"{DEFAULT_START_TIMEOUT_S:.0f})")
    return p


def help_text() -> str:
    return parser().format_help()


def parse(argv: list[str]) -> FleetConfig | None:
    """The checked configuration of ``argv``; None for ``--help``. Raises ``UsageError``.
    Nothing is started or written, and neither SGLang nor torch is imported."""
    args, rest = parser().parse_known_args(argv)
    if args.help:
        return None
    _refuse_fleet_owned(rest)
    router_args = _check_router_args(args.router_args)
    instance_ports = _ports_for("--instance-ports", args.instance_ports, args.instances)
    store_ports = _ports_for("--store-ports", args.store_ports, args.stores)
    if args.api_key_file is not None:
        api_key.read_key_file(args.api_key_file)  # private, readable, a good key
    elif environment.read(api_key.ENV):
        api_key.check_key(environment.read(api_key.ENV), f"${api_key.ENV}")
    check_serve_args(rest)
    if args.log_dir is not None and Path(args.log_dir).exists() and not Path(args.log_dir).is_dir():
        raise UsageError(f"--log-dir {args.log_dir}: not a folder")
    config = FleetConfig(
        instances=args.instances, stores=args.stores, host=args.host, port=args.port,
        policy=args.policy, instance_ports=instance_ports, store_ports=store_ports,
        metrics_port=args.metrics_port or 0, store_memory_gb=args.store_memory_gb,
        api_key_file=args.api_key_file, log_dir=args.log_dir, router_args=router_args,
        start_timeout_s=args.start_timeout, serve_args=rest,
        gpu_per_instance=args.gpu_per_instance)
    if args.gpu_per_instance and any(a.split("=", 1)[0] == "--base-gpu-id" for a in rest):
        raise UsageError("--base-gpu-id: with --gpu-per-instance the fleet gives instance i "
                         "GPU i")
    assign_ports(config)
    return config


def _refuse_fleet_owned(serve_args: list[str]) -> None:
    for a in serve_args:
        name = a.split("=", 1)[0]
        if name in FLEET_OWNED:
            raise UsageError(f"{name}: {FLEET_OWNED[name]}")


def _ports_for(flag: str, given: list[int] | None, count: int) -> list[int]:
    """The ports ``flag`` gave (one per child), or zeros: free ports, picked by ``assign_ports``."""
    if given is None:
        return [0] * count
    if len(given) != count:
        raise UsageError(f"{flag}: {len(given)} ports for {count} "
                         f"{'instances' if 'instance' in flag else 'stores'}")
    return given


def check_serve_args(argv: list[str]) -> None:
    """The checks ``sglang-pic serve`` makes before it starts (``launch_server.check``), except
    the key's, which the fleet makes once for all instances: our flags and their combinations,
    SGLang's flag names (a typo names the nearest) and the values checked before a load, and
    what SGLang would serve without checking the key. Raises ``UsageError``."""
    from sglang_pic.launcher import serve_conflicts, server_flags, sglang_flags

    given, rest = server_flags.parse(argv, PROG)
    sglang_flags.refuse_unknown(rest)
    sglang_flags.refuse_bad_values(rest)
    server_flags.handed_over(given)
    serve_conflicts.refuse(given, rest)
    api_key.refuse_unchecked(api_key.Choice(key=None, source=None, insecure=False), rest)


def _check_router_args(raw: str) -> list[str]:
    """``--router-args`` split as a shell would, without the flags the fleet sets, and parsed by
    the router's own parser (``RouterArgs.add_cli_args``), so a typo fails here."""
    try:
        extra = shlex.split(raw)
    except ValueError as e:
        raise UsageError(f"--router-args: {e}") from None
    for a in extra:
        name = a.split("=", 1)[0]
        if name in ROUTER_OWNED:
            raise UsageError(f"--router-args {name}: {ROUTER_OWNED[name]}")
    if extra:
        from sglang_pic.fleet.router import parse_router_args

        parse_router_args(extra)
    return extra


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS's pick). Another process may take it before the
    child binds it: the child then fails to start, and the fleet says so and stops."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def assign_ports(config: FleetConfig) -> None:
    """Pick free ports where none was given; refuse a port given twice or already in use
    (``UsageError``), before anything starts."""
    taken: dict[int, str] = {}

    def claim(port: int, what: str, host: str = "127.0.0.1") -> int:
        while port == 0:
            port = free_port()
            if port in taken:
                port = 0
        if port in taken:
            raise UsageError(f"port {port} is given twice ({taken[port]} and {what})")
        if api_key.port_taken(host, port):
            raise UsageError(f"{what}: port {port} is in use (another server?)")
        taken[port] = what
        return port

    config.port = claim(config.port, "--port (the router)", config.host)
    config.instance_ports = [claim(p, f"instance {i}") for i, p in enumerate(config.instance_ports)]
    config.store_ports = [claim(p, f"store {i}") for i, p in enumerate(config.store_ports)]
    config.metrics_port = claim(config.metrics_port, "--metrics-port (the router's metrics)")
