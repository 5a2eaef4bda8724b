"""``sglang-pic fleet``: the command. The order of the starts, progress, the summary, signals.

Order, each step only once the one before it is done:

1. every flag checked (``config``): a mistake is one line, exit 2, nothing started;
2. the log folder, the API key (``--api-key-file``, ``$SGLANG_PIC_API_KEY``, else a new one in
   the key file of the router's port, where ``sglang-pic serve`` on that port would put it, so a
   client finds it the same way), a new store token (a private file in the log folder), the
   embedded model converted once (not by every instance at the same time);
3. the store servers, until each prints that it serves: an instance's store client probes its
   servers as it starts (a same-node server gets pages through shared memory), so the stores
   come first;
4. the instances, until each answers ``/health``: all at once, except instances sharing one GPU,
   which start one after another (SGLang sizes an instance's KV pool from the GPU memory free
   around its weight load, so a neighbour allocating its pool in between leaves it none), each
   with the ``--mem-fraction-static`` that gives it an equal share of the whole GPU from the
   memory free as it starts (``gpu_share``);
5. the router, started beside the instances (it checks a worker that is not up yet every
   second), until it holds every instance healthy;
6. the summary: ports, the key file, each child's log, and ``fleet.json`` in the log folder with
   the same as JSON (for scripts and tests).

Then it watches: an instance that exits is reported and taken out of the router's rotation (the
router retries its requests in flight on the others); a store that exits is reported (its pages
are misses: the instances recompute them); the router's exit, or the last instance's, stops the
fleet (exit status 1). SIGTERM, SIGINT or SIGHUP stops it in order (``supervisor``) and exits 0;
a second one during the stop SIGKILLs what is left.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from sglang_pic import environment
from sglang_pic.fleet import gpu_share, router
from sglang_pic.fleet.config import PROG, FleetConfig, help_text, parse
from sglang_pic.fleet.router_process import CONTROL_ENV
from sglang_pic.fleet.supervisor import Child, Supervisor, exit_text
from sglang_pic.launcher.serve_conflicts import value_of
from sglang_pic.launcher.server_flags import UsageError, setting
from sglang_pic.security import api_key

STORE_READY = "PTStore server on"
"""The line ``sglang-pic store`` prints once it serves."""
POLL_S = 0.5
PROGRESS_EVERY_S = 10.0
ROUTER_READY_TIMEOUT_S = 120.0
ROUTER_STOP_S = 200.0
"""The router waits up to its shutdown grace period (180 s by default) for requests in flight."""
INSTANCE_STOP_S = 60.0
STORE_STOP_S = 30.0
GPU_MEMORY_SHARE = 0.8
"""Of one GPU's memory, what the instances' static shares (weights and KV) may add up to when
the fleet divides it: each instance also needs room of its own beyond its share (activations,
graphs, workspaces). Not measured in this work (no GPU run)."""
GPU_MEMORY_MAX = 0.9
"""Shares a user gives (``--mem-fraction-static``) may add up to at most this."""


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _say(message: str) -> None:
    print(f"[fleet] {message}", flush=True)


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def _get_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


class Fleet:
    """One run of ``sglang-pic fleet``."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.supervisor = Supervisor()
        self.key = ""
        self.key_source = ""
        self.token_file: Path | None = None
        self.control_key = ""
        self.control_key_file: Path | None = None
        self.log_dir = Path()
        self.stop_signal: int | None = None
        self.share_of_gpu: float | None = None
        self.on_gpu = False
        self.threads: dict[str, str] = {}
        self.stopping = False
        self.started = time.monotonic()

    # ---- preparation -------------------------------------------------------------------------

    def instance_gpu_share(self, on_gpu: bool) -> float | None:
        """On a GPU the instances share it (GPU 0 of those visible): each gets an equal share of
        its whole memory, ``GPU_MEMORY_SHARE / N`` unless ``--mem-fraction-static`` gives the
        share; shares that cannot fit together are refused (``UsageError``). None when the
        instances do not share a GPU."""
        n = self.config.instances
        given = value_of(self.config.serve_args, "--mem-fraction-static")
        if self.config.gpu_per_instance:
            if not on_gpu:
                raise UsageError("--gpu-per-instance: no GPU in this process")
            import torch

            if n > torch.cuda.device_count():
                raise UsageError(f"--gpu-per-instance: {n} instances need {n} GPUs, "
                                 f"{torch.cuda.device_count()} are visible")
            return None
        if not on_gpu or n == 1:
            return None
        if given is None:
            return GPU_MEMORY_SHARE / n
        if n * float(given) > GPU_MEMORY_MAX:
            raise UsageError(f"--mem-fraction-static {given}: {n} instances on one GPU "
                             f"would hold {n * float(given):.2f} of its memory (at most "
                             f"{GPU_MEMORY_MAX}; each also needs room beyond its share)")
        return float(given)

    def instance_gpu_args(self, i: int) -> list[str]:
        """Instance ``i``'s ``--mem-fraction-static`` on a shared GPU, from the memory free now
        (``UsageError`` when its share no longer fits); nothing otherwise."""
        if self.share_of_gpu is None:
            return []
        try:
            free, total = gpu_share.gpu_memory()
        except OSError as e:
            _say(f"WARNING: the GPU's free memory is unknown ({e}); instance {i} gets "
                 f"--mem-fraction-static {self.share_of_gpu:.3f} of the memory free at its start")
            return ["--mem-fraction-static", f"{self.share_of_gpu:.3f}"]
        try:
            fraction = gpu_share.static_fraction(self.share_of_gpu, free, total)
        except ValueError as e:
            raise UsageError(f"instance {i}: {e}") from None
        _say(f"instance {i}: {self.share_of_gpu:.3f} of the GPU is --mem-fraction-static "
             f"{fraction:.3f} of the {free / (1 << 30):.1f} GiB free now")
        return ["--mem-fraction-static", f"{fraction:.3f}"]

    @property
    def shares_one_gpu(self) -> bool:
        """Several instances on one GPU (``plan`` found one, and no ``--gpu-per-instance``)."""
        return self.on_gpu and not self.config.gpu_per_instance and self.config.instances > 1

    def instance_threads(self, on_gpu: bool) -> dict[str, str]:
        """On CPU, the cores split between the instances (torch's default, every core for each
        instance, makes their OpenMP threads fight for the cores), unless the user set
        ``OMP_NUM_THREADS``."""
        if on_gpu or environment.read("OMP_NUM_THREADS"):
            return {}
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // self.config.instances))}

    def prepare(self) -> None:
        """Log folder, API key, store token and the default model (``UsageError`` for what the
        flags could not show, e.g. a log folder that cannot be made)."""
        c = self.config
        try:
            if c.log_dir is None:
                self.log_dir = Path(tempfile.mkdtemp(prefix=f"sglang-pic-fleet-{c.port}-"))
            else:
                self.log_dir = Path(c.log_dir)
                self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--log-dir: {e}") from None
        if c.api_key_file is not None:
            self.key = api_key.read_key_file(c.api_key_file)
            self.key_source = c.api_key_file
        elif environment.read(api_key.ENV):
            self.key = api_key.check_key(environment.read(api_key.ENV), f"${api_key.ENV}")
            self.key_source = f"${api_key.ENV}"
        else:
            self.key, path = api_key.generate(c.port)
            self.key_source = str(path)
        from sglang_pic.security.secret_files import write_private

        # the router's admin key: its control plane (workers, tokenizers) is not the clients'
        self.control_key = secrets.token_urlsafe(32)
        self.control_key_file = write_private(self.log_dir, "router-admin.key",
                                              self.control_key + "\n")
        if c.stores:
            self.token_file = write_private(self.log_dir, "ptstore.token",
                                            secrets.token_urlsafe(32) + "\n")

    # ---- children ----------------------------------------------------------------------------

    def _env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in (api_key.ENV, CONTROL_ENV, "SGLANG_PIC_STORE_TOKEN",
                            "SGLANG_PIC_PTSTORE_TOKEN")}
        return env | extra

    def store_child(self, i: int) -> Child:
        c = self.config
        endpoint = f"tcp://127.0.0.1:{c.store_ports[i]}"
        cmd = [sys.executable, "-m", "sglang_pic", "store", "--endpoint", endpoint,
               "--token-file", str(self.token_file)]
        if c.store_memory_gb is not None:
            cmd += ["--memory-gb", str(c.store_memory_gb)]

        def ready(child: Child) -> bool:
            try:
                return STORE_READY in child.log.read_text(errors="replace")
            except OSError:
                return False

        return Child(f"store {i}", "store", cmd, self._env(), self.log_dir / f"store-{i}.log",
                     endpoint, ready)

    def instance_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.config.instance_ports[i]}"

    def instance_child(self, i: int, gpu_args: list[str], threads: dict[str, str]) -> Child:
        """Instance ``i``'s command; ``gpu_args`` come after the serve flags (the last value of
        a flag is the one SGLang takes), so a share computed for it replaces one given."""
        c = self.config
        url = self.instance_url(i)
        cmd = [sys.executable, "-m", "sglang_pic", "serve", "--port", str(c.instance_ports[i])]
        if c.stores:
            endpoints = ",".join(f"tcp://127.0.0.1:{p}" for p in c.store_ports)
            cmd += ["--ptstore", endpoints, "--ptstore-token-file", str(self.token_file)]
        cmd += [*c.serve_args, *gpu_args]
        if c.gpu_per_instance:
            cmd += ["--base-gpu-id", str(i)]
        return Child(f"instance {i}", "instance", cmd,
                     self._env(**{api_key.ENV: self.key}, **threads),
                     self.log_dir / f"instance-{i}.log", url,
                     lambda child: _get_ok(child.address + "/health"))

    def router_child(self) -> Child:
        c = self.config
        url = _url(c.host, c.port)
        # every instance, also those that start after the router (on a shared GPU)
        instances = [self.instance_url(i) for i in range(c.instances)]
        argv = router.router_argv(
            c.host, c.port, c.policy, instances, c.metrics_port, c.router_args,
            c.start_timeout_s, *(int(value_of(c.serve_args, flag) or setting(flag))
                                 for flag in ("--max-request-mb", "--max-connections")))

        def ready(child: Child) -> bool:
            alive = {i.address for i in self.supervisor.of_kind("instance") if i.alive()}
            return bool(alive) and alive <= router.healthy_workers(child.address,
                                                                   self.control_key)

        return Child("router", "router", router.command(argv),
                     self._env(**{api_key.ENV: self.key, CONTROL_ENV: self.control_key}),
                     self.log_dir / "router.log", url, ready)

    def wait_ready(self, children: list[Child], timeout_s: float) -> bool:
        """Poll until every child serves; progress lines while they start. False (the reason
        printed, with the log's tail) when one exits or runs past ``timeout_s``, or when a stop
        was asked for."""
        pending = list(children)
        last_progress = time.monotonic()
        while pending:
            if self.stop_signal is not None:
                return False
            for child in list(pending):
                if child.ready(child):
                    child.ready_after_s = time.monotonic() - child.started_at
                    pending.remove(child)
                    _say(f"{child.name} ready: {child.address} ({child.ready_after_s:.1f} s)")
                elif not child.alive():
                    _error(f"{child.name} exited while starting ({exit_text(child.returncode())}); "
                           f"its log {child.log} ends:\n{child.log_tail()}")
                    return False
                elif time.monotonic() - child.started_at > timeout_s:
                    _error(f"{child.name} did not start within {timeout_s:.0f} s; its log "
                           f"{child.log} ends:\n{child.log_tail()}")
                    return False
            if pending and time.monotonic() - last_progress >= PROGRESS_EVERY_S:
                last_progress = time.monotonic()
                waited = time.monotonic() - min(c.started_at for c in pending)
                _say(f"waiting for {', '.join(c.name for c in pending)} ({waited:.0f} s)")
                self.supervisor.track_all()
            if pending:
                time.sleep(POLL_S)
        return True

    # ---- signals and the stop ----------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stopping:  # a second signal: no more draining
            print(f"[fleet] {signal.Signals(signum).name} again: killing what is left",
                  flush=True)
            self.supervisor.kill_leftovers(self.supervisor.children)
            return
        self.stop_signal = signum

    def stop(self) -> None:
        """Router, then instances, then stores: each drains what it holds before the next goes."""
        self.stopping = True
        s = self.supervisor
        for kind, timeout in (("router", ROUTER_STOP_S), ("instance", INSTANCE_STOP_S),
                              ("store", STORE_STOP_S)):
            children = [c for c in s.of_kind(kind) if c.proc is not None]
            if children:
                if any(c.alive() for c in children):
                    _say(f"stopping the {kind}{'s' if kind != 'router' else ''}")
                s.stop(children, timeout)
        for secret in (self.token_file, self.control_key_file):
            if secret is not None:
                secret.unlink(missing_ok=True)
        left = s.leftovers()
        if left:
            _error(f"still running after the stop: {', '.join(str(p.pid) for p in left)}")
        _say("stopped")

    # ---- the run -----------------------------------------------------------------------------

    def write_state(self) -> Path:
        """``fleet.json``: what the summary prints, for scripts (a benchmark, the tests)."""
        c = self.config

        def entry(child: Child) -> dict[str, Any]:
            return {"name": child.name, "address": child.address, "pid": child.pid,
                    "log": str(child.log)}

        state = {
            "pid": os.getpid(), "router": entry(self.supervisor.of_kind("router")[0]),
            "policy": c.policy, "metrics": f"http://127.0.0.1:{c.metrics_port}/metrics",
            "instances": [entry(ch) for ch in self.supervisor.of_kind("instance")],
            "stores": [entry(ch) for ch in self.supervisor.of_kind("store")],
            "api_key": self.key_source,
            "store_token_file": str(self.token_file) if self.token_file else None,
            "router_admin_key_file": str(self.control_key_file),
        }
        path = self.log_dir / "fleet.json"
        path.write_text(json.dumps(state, indent=2) + "\n")
        return path

    def summary(self, state: Path) -> str:
        c = self.config
        rows = []
        for child in self.supervisor.children:
            what = child.address
            if child.kind == "router":
                what += f"  (policy {c.policy}; metrics http://127.0.0.1:{c.metrics_port}/metrics)"
            rows.append(f"  {child.name:<11} {what}\n  {'':<11} log {child.log}")
        if self.key_source.startswith("$"):
            key = f"  {'API key':<11} {self.key_source} (from the environment)"
        else:
            key = (f"  {'API key':<11} {self.key_source}: clients send "
                   f"-H \"Authorization: Bearer $(cat {self.key_source})\"")
        lines = [f"{PROG}: ready in {time.monotonic() - self.started:.1f} s; pid {os.getpid()}",
                 *rows, key]
        lines.append(f"  {'router admin':<11} {self.control_key_file} (the router's "
                     "/workers API; not for clients)")
        if self.token_file is not None:
            lines.append(f"  {'store token':<11} {self.token_file}")
        lines += [f"  {'state':<11} {state}",
                  "SIGTERM or Ctrl-C drains and stops everything: the router, then the "
                  "instances, then the stores."]
        return "\n".join(lines)

    def plan(self) -> None:
        """What needs this machine before anything starts: its GPU (``UsageError`` for shares
        that cannot fit), its cores, the embedded model, the log folder, key and token."""
        from sglang_pic.cpu import support as cpu_support

        on_gpu = self.on_gpu = cpu_support.has_cuda()
        self.share_of_gpu = self.instance_gpu_share(on_gpu)
        self.threads = self.instance_threads(on_gpu)
        if not any(value_of(self.config.serve_args, f) for f in ("--model-path", "--model")):
            from sglang_pic.launcher.default_model import ensure_default_model

            try:
                ensure_default_model()  # once here, not in every instance at the same time
            except FileNotFoundError as e:
                raise UsageError(str(e)) from None
        self.prepare()

    def start(self) -> bool:
        c = self.config
        router_url = _url(c.host, c.port)
        if not api_key.is_loopback(c.host):
            _say(f"note: --host {c.host}: the router listens beyond this machine; every request "
                 "needs the key, and travels in plain HTTP unless the router has a certificate "
                 "(--router-args '--tls-cert-path PEM --tls-key-path PEM')")
        _say(f"{c.stores} store{'s' * (c.stores != 1)}, {c.instances} "
             f"instance{'s' * (c.instances != 1)}, router on {router_url} (policy {c.policy}); "
             f"logs in {self.log_dir}")
        stores = [self.supervisor.start(self.store_child(i)) for i in range(c.stores)]
        if not self.wait_ready(stores, 60.0):
            return False
        one_by_one = self.shares_one_gpu
        _say(f"starting {c.instances} instance{'s' * (c.instances != 1)} "
             f"({', '.join(str(p) for p in c.instance_ports)})"
             f"{', one after another (they share one GPU)' if one_by_one else ''}")
        instances: list[Child] = []
        for i in range(c.instances):
            try:
                gpu_args = self.instance_gpu_args(i)
            except UsageError as e:
                _error(str(e))
                return False
            instances.append(self.supervisor.start(
                self.instance_child(i, gpu_args, self.threads)))
            if i == 0:
                # the router starts beside them: its import and start (seconds) overlap their
                # loads, and it registers each one within a second of its first answer
                self.supervisor.start(self.router_child())
            if one_by_one and not self.wait_ready(instances[-1:], c.start_timeout_s):
                return False
        _say(f"instance logs: {', '.join(i.log.name for i in instances)}")
        if not self.wait_ready(instances, c.start_timeout_s):
            return False
        return self.wait_ready(self.supervisor.of_kind("router"),
                               c.start_timeout_s + ROUTER_READY_TIMEOUT_S)

    def watch(self) -> int:
        """Until a stop signal (0) or the router's or the last instance's exit (1)."""
        s = self.supervisor
        router_child = s.of_kind("router")[0]
        last_track = time.monotonic()
        while self.stop_signal is None:
            time.sleep(POLL_S)
            if time.monotonic() - last_track > 2.0:
                s.track_all()
                last_track = time.monotonic()
            for child in s.children:
                if child.alive() or child.exit_reported:
                    continue
                child.exit_reported = True
                how = exit_text(child.returncode())
                if child.kind == "router":
                    _error(f"the router exited ({how}); stopping the fleet. Its log "
                           f"{child.log} ends:\n{child.log_tail()}")
                    return 1
                if child.kind == "instance":
                    removed = router.remove_worker(router_child.address, self.control_key,
                                                    child.address)
                    _say(f"WARNING: {child.name} ({child.address}) exited ({how}); log "
                         f"{child.log}. The router retries its requests in flight on the "
                         f"others{' and no longer sends it any' if removed else ''}.")
                    if not any(i.alive() for i in s.of_kind("instance")):
                        _error("no instance left; stopping the fleet")
                        return 1
                else:
                    _say(f"WARNING: {child.name} ({child.address}) exited ({how}); log "
                         f"{child.log}. Its pages are misses: the instances recompute them.")
        _say(f"{signal.Signals(self.stop_signal).name}: draining and stopping")
        return 0

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            try:
                self.plan()
            except UsageError as e:  # nothing started
                _error(e.message.removeprefix("error: "))
                return 2
            ok = self.start()
            if not ok:
                self.stop()
                return 0 if self.stop_signal is not None else 1
            print(self.summary(self.write_state()), flush=True)
            code = self.watch()
            self.stop()
            return code
        except BaseException:
            self.stopping = True
            self.supervisor.kill_leftovers(self.supervisor.children)
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def main(argv: list[str]) -> int:
    """``sglang-pic fleet ARGV``: help, a one-line refusal (exit 2), or the fleet's run."""
    try:
        config = parse(argv)
    except UsageError as e:
        _error(e.message.removeprefix("error: "))
        return 2
    if config is None:
        print(help_text(), end="")
        return 0
    return Fleet(config).run()
