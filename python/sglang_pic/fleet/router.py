"""SGLang's router in front of the fleet: its command line, and the HTTP calls the fleet makes.

The router is PyPI's ``sglang-router`` (a Rust load balancer with a Python launcher), used as it
ships: ``router_process`` runs its launcher, and this module only builds the arguments. Three of
the router's defaults do not suit a fleet on one machine, so the fleet sets them:

* ``--host``: the router binds 0.0.0.0 by default; the fleet binds loopback unless ``--host``
  says otherwise, like ``sglang-pic serve``;
* ``--prometheus-host`` / ``--prometheus-port``: its metrics listener binds 0.0.0.0:29000 by
  default, beyond this machine and on one port for every fleet; the fleet puts it on loopback,
  on a port of its own;
* ``--worker-startup-check-interval``: 30 s between checks of a worker that is not healthy yet;
  the fleet starts the router beside the instances, and a 1 s interval registers each within a
  second of its first answer (``--worker-startup-timeout-secs`` follows the fleet's
  ``--start-timeout``).

The keys are not among the arguments: ``router_process`` gets them from the environment (the
clients' API key, and the router's admin key for its control plane, which the fleet alone uses:
``workers`` and ``remove_worker`` take it).

The router re-serialises each request from its own typed schema: it adds ``model`` and
``background`` to ``/generate`` bodies (the front door accepts both, ``frontdoor/schemas.py``),
and it refuses chat messages that carry ``spans`` instead of ``content`` (a span request through
the router uses the text markers, docs/spans.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from sglang_pic.launcher.server_flags import UsageError

MODULE = "sglang_pic.fleet.router_process"
STARTUP_CHECK_INTERVAL_S = 1


def router_argv(host: str, port: int, policy: str, worker_urls: list[str], metrics_port: int,
                extra: list[str], start_timeout_s: float = 1800.0, max_request_mb: int = 16,
                max_connections: int = 1024) -> list[str]:
    """The argv of ``python -m sglang_pic.fleet.router_process`` (the router launcher's flags):
    ours first, then the user's ``extra`` (checked not to repeat ours, ``config.ROUTER_OWNED``).

    The front door's bounds hold at the router too, unless ``extra`` sets them: its largest
    body is the instances' (``max_request_mb``: their ``--max-request-mb``; the router's own
    default is 512 MB, read whole before it is forwarded), and it runs at most as many requests
    at once as the instances admit connections together (``max_connections`` each: their
    ``--max-connections``; the router's default is no bound)."""
    given = {a.split("=", 1)[0] for a in extra}
    argv = ["--host", host, "--port", str(port), "--policy", policy,
            "--worker-urls", *worker_urls,
            "--worker-startup-check-interval", str(STARTUP_CHECK_INTERVAL_S),
            "--worker-startup-timeout-secs", str(int(start_timeout_s))]
    if "--prometheus-host" not in given:
        argv += ["--prometheus-host", "127.0.0.1"]
    if "--prometheus-port" not in given:
        argv += ["--prometheus-port", str(metrics_port)]
    if "--max-payload-size" not in given:
        argv += ["--max-payload-size", str(max_request_mb << 20)]
    if "--max-concurrent-requests" not in given:
        argv += ["--max-concurrent-requests", str(max_connections * len(worker_urls))]
    if policy == "manual" and "--assignment-mode" not in given:
        # a new routing key goes to the instance with the fewest keys in flight (the router's
        # default is a random one): span group keys (fleet.routing) spread under load
        argv += ["--assignment-mode", "min_group"]
    return [*argv, *extra]


def command(argv: list[str]) -> list[str]:
    """The router's process: this interpreter running ``router_process`` on ``argv``."""
    return [sys.executable, "-m", MODULE, *argv]


class _OneLine(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"--router-args: {message.removeprefix('argument ')}")


def parser() -> argparse.ArgumentParser:
    """The router launcher's parser (``RouterArgs.add_cli_args``, as
    ``python -m sglang_router.launch_router`` builds it), reporting errors in one line."""
    try:
        from sglang_router.router_args import RouterArgs
    except ImportError:
        raise UsageError("SGLang's router is not installed: pip install sglang-router==0.3.2 "
                         "(make env installs it)") from None
    p = _OneLine(prog="sglang-router", add_help=False, allow_abbrev=False)
    RouterArgs.add_cli_args(p, use_router_prefix=False)
    return p


def parse_router_args(argv: list[str]) -> Any:
    """``RouterArgs`` of ``argv``, as the router's launcher makes them; ``UsageError`` for a
    flag it does not know or a bad value."""
    from sglang_router.router_args import RouterArgs

    return RouterArgs.from_cli_args(parser().parse_args(argv), use_router_prefix=False)


def _call(url: str, key: str, method: str = "GET", timeout: float = 5.0) -> Any:
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body.strip().startswith((b"{", b"[")) else body.decode()


def workers(router_url: str, key: str) -> list[dict[str, Any]]:
    """The router's workers (``GET /workers``: ``url``, ``id``, ``is_healthy``, ...); empty when
    the router does not answer."""
    try:
        return list(_call(f"{router_url}/workers", key).get("workers", []))
    except (OSError, ValueError, AttributeError):
        return []


def healthy_workers(router_url: str, key: str) -> set[str]:
    """URLs of the workers the router has registered and holds healthy."""
    return {w["url"] for w in workers(router_url, key) if w.get("is_healthy")}


def remove_worker(router_url: str, key: str, worker_url: str) -> bool:
    """Take ``worker_url`` out of the router's rotation (``DELETE /workers/{id}``), so new
    requests stop going to an instance the fleet knows is dead. Without this the router finds
    out itself: requests sent there fail and are retried on another worker, and its health
    checks mark it unhealthy after a few intervals (60 s each by default)."""
    for w in workers(router_url, key):
        if w.get("url") == worker_url and w.get("id"):
            try:
                _call(f"{router_url}/workers/{urllib.parse.quote(str(w['id']))}", key,
                      method="DELETE")
                return True
            except (OSError, ValueError):
                return False
    return False
