"""The fleet's child processes: start, readiness, unexpected exits, and the stop.

Every child (a store server, an instance's ``sglang-pic serve`` launcher, the router) runs in a
session of its own, with its output in its own log file. Its own session, because a Ctrl-C in
the terminal would otherwise reach every child at once: the router, the instances and the stores
would all stop together, and requests in flight between them would fail. Here the signal reaches
the fleet alone, which stops the children in order (``Supervisor.stop``): the router first (it
stops taking requests and waits for those in flight), then the instances (each drains, then
exits), then the stores, which the instances used until then.

No orphans: each child gets ``PR_SET_PDEATHSIG`` (SIGTERM when the fleet dies, even by SIGKILL;
Linux), so the children are started from the main thread only (the signal follows the thread that
forked, not the process). What a child started itself (SGLang's scheduler and detokenizer
processes; an instance's server process runs in a process group of its own) is found with psutil
while the fleet runs, and whatever of it is still alive at the end of a stop is SIGKILLed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the fleet's process dies (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class Child:
    """One child process of the fleet."""

    name: str
    """As messages name it: ``store 0``, ``instance 1``, ``router``."""
    kind: str
    """``store``, ``instance`` or ``router``."""
    cmd: list[str]
    env: dict[str, str]
    log: Path
    address: str
    """Where it serves: an instance's or the router's URL, a store's endpoint."""
    ready: Callable[[Child], bool]
    """Whether it serves yet (polled while it starts)."""
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None
    known: dict[int, psutil.Process] = field(default_factory=dict)
    """Its process and every descendant seen so far (pid -> process; psutil tells a reused pid
    from the process it saw by the start time)."""
    exit_reported: bool = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


def exit_text(code: int | None) -> str:
    """``exit status N`` or ``killed by SIGNAME`` for a ``Popen.returncode``."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class Supervisor:
    """Starts children, tracks their processes, stops them in order."""

    def __init__(self) -> None:
        self.children: list[Child] = []

    def start(self, child: Child) -> Child:
        """Start ``child`` (from the main thread: see the module's note on orphans)."""
        child.log.parent.mkdir(parents=True, exist_ok=True)
        with open(child.log, "w") as out:
            child.proc = subprocess.Popen(
                child.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=child.env, start_new_session=True, preexec_fn=_die_with_parent)
        child.started_at = time.monotonic()
        self.children.append(child)
        self.track(child)
        return child

    def track(self, child: Child) -> None:
        """Note the child's process tree as it is now (called while the fleet runs, so the
        processes an instance starts are known before a stop, when their parents may be gone)."""
        if child.proc is None:
            return
        try:
            root = psutil.Process(child.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                child.known.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def track_all(self) -> None:
        for child in self.children:
            if child.alive():
                self.track(child)

    def of_kind(self, kind: str) -> list[Child]:
        return [c for c in self.children if c.kind == kind]

    def stop(self, children: Iterable[Child], timeout_s: float,
             sig: signal.Signals = signal.SIGTERM) -> None:
        """Send ``sig`` to each child (each drains and exits on SIGTERM), wait up to
        ``timeout_s`` for them to exit, then SIGKILL what is left of their process trees."""
        children = [c for c in children if c.proc is not None]
        for child in children:
            self.track(child)
            if child.alive():
                try:
                    child.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for child in children:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill_leftovers(children, grace_s=min(5.0, max(0.0, deadline - time.monotonic())))

    def kill_leftovers(self, children: Iterable[Child], grace_s: float = 0.0) -> None:
        """SIGKILL every process of these children's trees that is still running (after up to
        ``grace_s`` for descendants that are exiting on their own), and reap the children."""
        procs = [p for c in children for p in c.known.values()]
        if grace_s > 0:
            psutil.wait_procs(procs, timeout=grace_s)
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)
        for child in children:
            if child.proc is not None and child.proc.poll() is None:
                try:
                    child.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass

    def leftovers(self) -> list[psutil.Process]:
        """Processes of any child's tree still running (an empty list after a clean stop)."""
        out = []
        for child in self.children:
            for p in child.known.values():
                try:
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        out.append(p)
                except psutil.Error:
                    pass
        return out
