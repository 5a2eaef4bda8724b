"""Test servers forked from a process that has already imported SGLang (CPU machines only).

A CPU test server spends about half of its ~22 s start in a fresh Python importing torch, SGLang
and our plugin (``sglang_pic.launcher.server_process``: 11-13 s of CPU on an idle core), and the suite
starts about twenty of them. A zygote imports those modules once per test worker and forks each
server from there: the child runs ``server_process.main`` on the server's argv, as the
``sglang-pic serve`` launcher's child would, in its own session with its log as stdout/stderr.

What a forked server shares with a spawned one: the plugin is loaded in the child, after
``build_argv`` has set the hand-off variables (the zygote only imports modules, it never
registers anything), and SGLang's hooks replace every reference to a patched function across
``sys.modules`` (``HookRegistry``), so modules imported before the hooks see them too. SGLang's
CPU engine is selected before SGLang's first import here, as ``server_process`` does, so the
CPU server's own forking of its scheduler applies (``cpu_support._fork_children``). What it skips
is the thin launcher (``sglang-pic serve``'s signal forwarding), which the tests that stop a
server through it, or start SGLang's own launcher, still run as a real process.

A second kind, the *plain* zygote (``--plain``), stands in for ``python -c CODE`` in the tests
of what the plugin refuses (``plugin_process.run_python``): it imports SGLang's heavy modules
only (``PLAIN_PRELOAD``: no module of ours, no CPU engine selected, as in a fresh interpreter),
and each child runs the code with the caller's whole environment, its stdout and stderr going to
files. The plugin is loaded, and every module patched, in the child alone.

Protocol: one JSON object per line on stdin, one answer per line on stdout.
``{"op": "start", "argv": [...], "env": {...}, "log": PATH}`` -> ``{"pid": N}``;
``{"op": "python", "code": CODE, "env": {...}, "out": PATH, "err": PATH}`` -> ``{"pid": N}``;
``{"op": "poll", "pid": N}`` -> ``{"returncode": None | int}`` (negative: killed by that signal).
The zygote exits when its stdin closes (the test worker ended); the servers it forked get SIGTERM
then (``PR_SET_PDEATHSIG`` through ``SGLANG_PIC_LAUNCHER_PID``).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

PRELOAD = (
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama",
    "sglang.launch_server",
    "sglang_pic.launcher.server_process",
    "sglang_pic.launcher.launch_server",
)
"""Modules every CPU test server imports (the SmolLM2 model is a Llama)."""
PLAIN_PRELOAD = (
    "torch",
    "sglang.srt.server_args",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.entrypoints.http_server",
)
"""What loading the plugin imports of SGLang, for the plain zygote (none of our modules)."""


def _redirect(out: str, err: str) -> None:
    """In a forked child: stdin from /dev/null, stdout and stderr to ``out`` and ``err``."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)


def _become_child(reply_fd: int, out: str, err: str, env: dict[str, str], argv: list[str],
                  session: bool = False) -> None:
    """In a forked child: drop the zygote's reply descriptor, (``session``) lead a session of
    its own, write to ``out`` / ``err``, take default signal handling, ``env`` as the whole
    environment and ``argv`` as ``sys.argv``."""
    os.close(reply_fd)
    if session:
        os.setsid()
    _redirect(out, err)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = argv


def _run_code(code: str, env: dict[str, str], out: str, err: str, reply_fd: int) -> None:
    """In the forked child: run ``code`` as ``python -c`` would, then exit with its status."""
    _become_child(reply_fd, out, err, env, ["-c"])
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:  # as python does: None is 0, anything but an int is printed, 1
        if e.code is None or isinstance(e.code, int):
            status = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _run_server(argv: list[str], env: dict[str, str], log: str, reply_fd: int) -> None:
    """In the forked child: become a session leader writing to ``log``, then run the server."""
    _become_child(reply_fd, log, log, env, ["sglang_pic.launcher.server_process", *argv],
                  session=True)
    code = 1
    try:
        from sglang_pic.launcher import server_process

        code = server_process.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(plain: bool = False) -> None:
    if not plain:
        from sglang_pic.cpu import support as cpu_support

        cpu_support.enable_cpu_engine()  # before SGLang's first import, as server_process does
    for name in PLAIN_PRELOAD if plain else PRELOAD:
        importlib.import_module(name)
    done: dict[int, int] = {}
    # answers on a descriptor of their own: whatever SGLang prints goes to stderr, not into them
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "start":
            env = dict(request["env"], SGLANG_PIC_LAUNCHER_PID=str(os.getpid()))
            pid = os.fork()
            if pid == 0:
                _run_server(request["argv"], env, request["log"], reply.fileno())
            answer: dict = {"pid": pid}
        elif request["op"] == "python":
            pid = os.fork()
            if pid == 0:
                _run_code(request["code"], request["env"], request["out"], request["err"],
                          reply.fileno())
            answer = {"pid": pid}
        else:
            pid = request["pid"]
            if pid not in done:
                got, status = os.waitpid(pid, os.WNOHANG)
                if got == pid:
                    done[pid] = os.waitstatus_to_exitcode(status)
            answer = {"returncode": done.get(pid)}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


class ZygoteClient:
    """The test worker's end: starts the zygote on first use, one request at a time (servers
    started together come from several threads)."""

    def __init__(self, env: dict[str, str], log: Path, plain: bool = False):
        self._env, self._log, self._plain = env, log, plain
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _ask(self, request: dict) -> dict:
        with self._lock:
            if self._proc is None:
                with open(self._log, "w") as err:
                    self._proc = subprocess.Popen(
                        [sys.executable, __file__, *(["--plain"] if self._plain else [])],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=err, text=True, env=self._env)
                if not self._proc.stdout.readline():
                    raise RuntimeError(f"server zygote exited with {self._proc.wait()}; log:\n"
                                       + self._log.read_text(errors="replace")[-3000:])
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server zygote exited with {self._proc.poll()}")
            return json.loads(line)

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedServerProcess:
        log.write_text("")  # there before the child opens it: the caller reads it at once
        pid = self._ask({"op": "start", "argv": argv, "env": env, "log": str(log)})["pid"]
        return ForkedServerProcess(self, pid)

    def returncode(self, pid: int) -> int | None:
        return self._ask({"op": "poll", "pid": pid})["returncode"]

    def run_python(self, code: str, env: dict[str, str], timeout: float
                   ) -> subprocess.CompletedProcess:
        """``subprocess.run([python, "-c", code], env=env, capture_output=True, text=True,
        timeout=timeout)``, forked from a plain zygote."""
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "out"), Path(tmp, "err")
            pid = self._ask({"op": "python", "code": code, "env": env, "out": str(out),
                             "err": str(err)})["pid"]
            child = ForkedServerProcess(self, pid)
            try:
                rc = child.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
                child.wait()
                raise subprocess.TimeoutExpired(["python", "-c", code], timeout) from None
            read = {p: p.read_text(errors="replace") if p.exists() else "" for p in (out, err)}
            return subprocess.CompletedProcess(["python", "-c", code], rc, read[out], read[err])


class ForkedServerProcess:
    """What the tests use of ``subprocess.Popen`` (``pid``, ``returncode``, ``poll``, ``wait``)
    for a server the zygote forked (its child, so the zygote reaps it)."""

    def __init__(self, zygote: ZygoteClient, pid: int):
        self._zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout)
            time.sleep(0.1)
        return self.returncode


if __name__ == "__main__":
    main(plain="--plain" in sys.argv[1:])
