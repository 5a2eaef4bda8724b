"""Shared fixtures: real sglang-pic servers (SmolLM2-135M on CPU) shared across test modules.

Starting a server costs ~26 s of CPU on 2 cores (three processes importing SGLang, the model load
and a warm-up request), so the suite shares two (session scope): ``server`` (plain) and
``span_server`` (span cache); modules that need other server flags start their own with
`start_server`. The modules using a shared server run in one xdist group, on one worker, so each
shared server starts once per run (``pytest_collection_modifyitems``). Every wait is bounded, so
a dead scheduler fails the test instead of hanging it.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from server_zygote import ZygoteClient
from sglang_pic.cpu.support import has_cuda
from sglang_pic.security.api_key import ENV as API_KEY_ENV
from sglang_pic.security.api_key import KEY_DIR as API_KEY_DIR

REPO = Path(__file__).resolve().parent.parent
CACHE_ENV = "SGLANG_PIC_CACHE"
TEST_CACHE_ENV = "SGLANG_PIC_TEST_CACHE"
"""The run's cache folder (``_use_a_test_cache``), kept for the xdist workers, which inherit it."""
_own_test_cache: Path | None = None
"""The cache folder this process made (removed at its end, ``pytest_unconfigure``)."""


def _use_a_test_cache() -> None:
    """Point ``$SGLANG_PIC_CACHE`` at a folder of this run, so that the API keys the test servers
    generate (``<cache>/api-keys/PORT``) never land in the user's ``~/.cache/sglang-pic``. The
    rest of the user's cache is linked in: the converted default model (``models/``, ~40 s to
    convert) and SGLang's flag list are shared, not made again. Done once per run, by the first
    process (the xdist workers inherit the variables), before anything starts a server; every
    server, zygote and subprocess gets it through ``os.environ``."""
    global _own_test_cache
    if os.environ.get(TEST_CACHE_ENV) and os.environ.get(CACHE_ENV) == os.environ[TEST_CACHE_ENV]:
        return  # an xdist worker: the run's folder exists already
    user = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sglang-pic")
    (user / "models").mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix="sglang-pic-test-cache-"))
    for entry in user.iterdir():
        if entry.name != API_KEY_DIR:
            (run / entry.name).symlink_to(entry)
    _own_test_cache = run
    os.environ[CACHE_ENV] = os.environ[TEST_CACHE_ENV] = str(run)


_use_a_test_cache()


def pytest_unconfigure(config):
    """The process that made the run's cache folder removes it (its links, not what they point
    at: ``rmtree`` does not follow them)."""
    if _own_test_cache is not None:
        shutil.rmtree(_own_test_cache, ignore_errors=True)


TEST_THREADS = os.environ.get("SGLANG_PIC_TEST_THREADS", "1")
"""Torch (OpenMP) threads of the test processes and of the servers they start (``_launch``).
The suite keeps both cores busy with servers; a second thread of a test process's torch spins at
OpenMP's barriers while the other core runs something else (measured: HF greedy references, 5
prompts x 16 tokens beside two busy cores, 30 s of CPU on 2 threads against 7.6 s on 1). Set
before the first import of torch (``has_cuda`` below), and inherited by the test's
subprocesses (the docs' examples, the CLI's)."""
os.environ.setdefault("OMP_NUM_THREADS", TEST_THREADS)
if not has_cuda():
    # Triton kernels bind the interpreter when first decorated, which may happen while any test
    # module is collected (store and HiCache modules import SGLang's kernels): set it before all
    # of them. The CPU engine sets the same for its servers (sglang_pic.cpu.support).
    os.environ.setdefault("TRITON_INTERPRET", "1")
START_TIMEOUT_S = 240
"""Seconds from a server's launch (once it holds a start slot) to its first healthy answer."""
HEALTH_POLL_S = 0.5
"""Pause between health checks while a server starts: SGLang answers 503 at once until its
warm-up is done, then ``/health`` generates a token (about 1 s)."""
START_SLOTS = int(os.environ.get("SGLANG_PIC_TEST_START_SLOTS", os.cpu_count() or 1))
"""Servers of the whole test run (every xdist worker) that may be starting at once. A start is
~20 s of CPU (three processes importing SGLang, then the model load and a warm-up request):
started all at once on 2 cores, two workers' multi-server fixtures (3 sparse servers beside 2
span servers) made 15 processes fight for the cores and ran past the start limit; queued, each
start takes its own ~20 s and the limit measures the start, not the queue."""
SLOT_WAIT_S = 1800
_SLOT_DIR = Path(tempfile.gettempdir()) / f"sglang-pic-test-starts-{os.getuid()}"
# HiCache on the CPU engine (see docs/cpu.md): a host tier of 4x the device pool (tens of MB, not
# a fixed GB a busy machine may not have free), direct I/O, layer-first layout
HICACHE_CPU_FLAGS = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct",
                     "--hicache-mem-layout", "layer_first", "--hicache-ratio", "4"]


def _has_hiradix() -> bool:
    """Whether the installed SGLang has ``HiRadixCache`` (0.5.17; 0.5.23 replaced it)."""
    from importlib.util import find_spec

    return find_spec("sglang.srt.mem_cache.hiradix_cache") is not None


needs_hiradix = pytest.mark.skipif(
    not _has_hiradix(), reason="drives SGLang 0.5.17's HiRadixCache itself; 0.5.23's HiCache "
    "tree (UnifiedRadixCache) is tested in test/unit/eviction/test_eviction_tree.py and by "
    "the sae HiCache server test")


_config: pytest.Config | None = None
"""This run's config (set by ``pytest_configure``): the report hook below gets no item."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU machines)")
    config.addinivalue_line("markers", "server: starts SGLang (a server, an Engine, a fleet); "
                            "the unit tier is `-m 'not server and not gpu and not kernels'` "
                            "(make test-unit)")
    config.addinivalue_line("markers", "capability(name): tests a capability of "
                            "sglang_pic.compat.gaps; skipped, with the gap's line, on a supported "
                            "SGLang release that does not serve it yet (make test-latest)")
    config.addinivalue_line("markers", "kernels: runs Triton kernels (ours, or SGLang's beside "
                            "our torch twin), on CPU under the interpreter (test/kernels, and "
                            "tests parametrized with the kernel ops); make test-kernels")
    global _config
    _config = config


def pytest_runtest_logreport(report):
    """A failed GPU test's report is written when it fails, not only in the summary at the end:
    a device call ends at its time limit, and a run cut there keeps what was written so far."""
    if not (report.failed and report.when == "call" and "gpu" in report.keywords):
        return
    reporter = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
    if reporter is not None:
        reporter.write_line(f"\n{report.nodeid} failed:\n{report.longreprtext}", red=True)


HEAVY_FIRST = (
    # the session-server group (~8 min), its modules in the order they run
    "test_eviction_server.py", "test_sparse_decode_cpu.py", "test_server_cpu.py", "test_api_key.py",
    "test_lang.py", "test_hf_equality.py", "test_http_security.py", "test_spans_cpu.py",
    # the other units, longest first
    "test_sparse_decode_state.py", "test_pariskv.py", "test_fleet_cpu.py", "test_front_door.py",
    "test_docs.py", "test_position_free_triton_cpu.py", "test_config_flags.py",
    "test_store_hicache_cpu.py", "test_cli.py", "test_spans_store_cpu.py",
    "test_position_free_cpu.py", "test_store_security.py", "test_eviction.py", "test_hicache_cpu.py",
    "test_compat_seams.py", "test_store_datapath.py", "test_compat_static.py",
    "test_plugin_seams.py", "test_store_engine.py", "test_cpu_support.py", "test_plugin_site.py",
    "test_span_scheduling.py", "test_request_validation.py",
)
"""Modules by their time on 2 cores, longest first (``--durations``). xdist hands out work units
(a module, or the group of the modules sharing a session server) in collection order
(``--no-loadscope-reorder``: its default order is by number of tests), so the long ones start
first and the short ones fill in at the end, instead of one worker starting a 3-minute module
when the other is nearly done (the HiCache modules after the group's three-server phases:
SGLang's 10 GiB host reserve leaves room for about four servers at once on a 24 GiB machine, and
a HiCache start waits for it, ``wait_for_host_memory``). A group's modules run in this order too: ``SHARED_GROUP`` (the
longest unit, ~8 min) runs ``span_server``'s users last and test_spans_cpu last of them, whose
own servers start after its last test using a session server: each session server stops after
its last user (``pytest_runtest_teardown``), so few servers are up at once (the HiCache tests'
host reserve check waits for memory)."""
SESSION_SERVERS = ("server", "span_server")
"""Session-scoped server fixtures: the modules using one (directly or through another fixture)
form the xdist group ``SHARED_GROUP``, so the server starts once per run, not once per worker."""
SHARED_GROUP = "session-servers"


def _session_servers_used(item) -> list[str]:
    """The ``SESSION_SERVERS`` the test needs (directly or through other fixtures; not another
    module's fixture or parameter of the same name). A test asking for one with
    ``request.getfixturevalue`` must also name it as an argument of some fixture it uses."""
    defs = getattr(item, "_fixtureinfo", None)
    used = []
    for name in SESSION_SERVERS:
        fixturedefs = defs.name2fixturedefs.get(name, ()) if defs else ()
        if fixturedefs and fixturedefs[-1].func.__module__ == __name__:
            used.append(name)
    return used


SERVER_SOURCE = re.compile(r"\bstart_servers?\b|\bLazyServers\b|\b_fleet_cmd\(|\bEngine\(|\bServerArgs\(|"
                           r"sglang\.launch_server")
"""What marks a module's source as starting SGLang (besides a session server fixture)."""
TESTS = Path(__file__).resolve().parent
SERVER_TESTS = (TESTS / "server", TESTS / "gpu")
"""The folders of the tests that start SGLang (a server, an Engine, a fleet): the server tier
(and the GPU tier, whose tests start servers too)."""
KERNEL_TESTS = TESTS / "kernels"
"""The kernel tests' folder: each of its tests is in the kernels tier."""

_server_modules: set[Path] = set()
"""Modules of the server tier (``pytest_collection_modifyitems``); ``_launch`` refuses a start
from any other: the tier marks are enforced, not guessed."""


def _server_tier(path: Path, module_items: list) -> bool:
    """A module is in the server tier by its folder (``SERVER_TESTS``). Each test of one elsewhere
    that uses a session server or whose source starts SGLang fails, naming the module: the unit
    and kernel tiers start no SGLang."""
    if any(folder in path.parents for folder in SERVER_TESTS):
        return True
    if any(_session_servers_used(item) for item in module_items) or \
            SERVER_SOURCE.search(path.read_text(errors="replace")):
        _misplaced[path] = (f"{path.relative_to(REPO)} starts SGLang: it belongs under "
                            "test/server/ (the unit and kernel tiers start none)")
    return False


_misplaced: dict[Path, str] = {}
"""Modules outside ``SERVER_TESTS`` that start SGLang, with the message each of their tests
fails with (``pytest_runtest_setup``: an error raised in the collection hook reaches an xdist
run as an INTERNALERROR without it)."""


def pytest_runtest_setup(item):
    if item.path in _misplaced:
        pytest.fail(_misplaced[item.path], pytrace=False)


def _xdist_group(module_items: list) -> str:
    """A module's xdist group: ``SHARED_GROUP`` when it uses a session server, else its path (one
    module, one worker: its module-scoped servers never start twice)."""
    if any(_session_servers_used(item) for item in module_items):
        return SHARED_GROUP
    return module_items[0].path.relative_to(REPO).as_posix()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    by_module: dict[Path, list] = {}
    for item in items:
        by_module.setdefault(item.path, []).append(item)
    group = {path: _xdist_group(module_items) for path, module_items in by_module.items()}
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    module_rank = {path: rank.get(path.name, len(HEAVY_FIRST)) for path in by_module}
    group_rank: dict[str, int] = {}
    for path, g in group.items():
        group_rank[g] = min(group_rank.get(g, len(HEAVY_FIRST)), module_rank[path])
    # a group's modules together, groups longest first, then each group's modules; stable
    items.sort(key=lambda item: (group_rank[group[item.path]], group[item.path],
                                 module_rank[item.path]))
    for path, module_items in by_module.items():
        if _server_tier(path, module_items):
            _server_modules.add(path)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group[item.path]))
        if item.path in _server_modules:
            item.add_marker(pytest.mark.server)
        if KERNEL_TESTS in item.path.parents:
            item.add_marker(pytest.mark.kernels)
        for name in _session_servers_used(item):
            _last_users[name] = item
    _skip_gaps(items)
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def skip_on_gap(capability: str) -> None:
    """Skip the test (or the fixture's users) where the installed SGLang release has a gap for
    ``capability`` (``compat.gaps``)."""
    from sglang_pic.compat import gaps

    found = gaps.gap(capability)
    if found is not None:
        pytest.skip(found.message("test"))


def _skip_gaps(items: list) -> None:
    """Skip the tests of a capability the installed SGLang release has a gap for
    (``compat.gaps``): the launchers refuse it there, so its tests would test the refusal."""
    from sglang_pic.compat import gaps

    for item in items:
        for mark in item.iter_markers("capability"):
            found = gaps.gap(mark.args[0])
            if found is not None:
                item.add_marker(pytest.mark.skip(reason=found.message("test")))


def _in_collection_order(config) -> bool:
    """Whether this process runs its tests in collection order with each xdist group whole (no
    xdist, or ``--dist loadgroup``), so a session server's last user in that order is the last
    test of the run that needs it."""
    return getattr(config.option, "dist", "no") in ("no", "loadgroup")


_last_users: dict[str, pytest.Item] = {}
"""Session server fixture name -> the last test (in the run's order) that uses it."""
_session_servers: dict[str, Server] = {}
"""The session servers started in this process (fixture name -> server)."""


def pytest_runtest_teardown(item, nextitem):
    """Stop a session server after the last test that uses it, not at the end of the run: the
    memory it holds (~2.4 GB) is what the HiCache tests' 10 GiB host reserve check waits for."""
    if not _in_collection_order(item.config):
        return
    for name, srv in _session_servers.items():
        if _last_users.get(name) is item:
            stop_server(srv)


HANDOFF_PREFIX = "SGLANG_PIC_"
"""Our hand-off variables (``server_flags``) and the launcher's own (span store, store token)."""


@pytest.fixture(autouse=True)
def _handoff_variables_restored():
    """Undo what a test's in-process ``build_argv`` wrote into ``os.environ``: the launcher sets
    a variable per flag given, and a later test's server (a child of this worker) would inherit
    it as if configured that way (``--sparse-threshold 700`` left behind made a
    ``--sparse-max-context 4096`` server valid, and it started instead of being refused)."""
    before = {k: v for k, v in os.environ.items() if k.startswith(HANDOFF_PREFIX)}
    yield
    for key in [k for k in os.environ if k.startswith(HANDOFF_PREFIX)]:
        if key not in before:
            del os.environ[key]
    os.environ.update(before)


GENERATED_RE = re.compile(r"API key generated into (\S+) \(mode 600")


def use_generated_key(server: Server) -> Path:
    """Set ``server.api_key`` to the key a server started with ``pass_key=False`` generated;
    returns its file (named in the server's log)."""
    m = GENERATED_RE.search(server.log.read_text(errors="replace"))
    assert m, f"no generated key in {server.log}"
    path = Path(m.group(1))
    server.api_key = path.read_text().strip()
    return path


def wait_for_host_memory(gb: float, wait_s: float = 180.0) -> None:
    """Skip (with the numbers) unless SGLang's HiCache can allocate a ``gb`` host tier here.

    SGLang refuses a host tier unless the host keeps 10 GiB available beside it
    (``HICACHE_HOST_MEMORY_RESERVE_BYTES``); with both test workers' servers up, a 24 GiB machine
    can dip below that for a while, so wait for the other worker's servers to go first."""
    import psutil
    from sglang.srt.mem_cache.pool_host.base import HICACHE_HOST_MEMORY_RESERVE_BYTES

    need = HICACHE_HOST_MEMORY_RESERVE_BYTES + int(gb * (1 << 30))
    deadline = time.time() + wait_s
    while (avail := psutil.virtual_memory().available) < need:
        if time.time() > deadline:
            pytest.skip(f"HiCache needs {need / (1 << 30):.1f} GiB available (SGLang's 10 GiB "
                        f"reserve + the tier); this host has {avail / (1 << 30):.1f} GiB")
        time.sleep(2)


TOP_LOGPROB_TOL = 1e-3
"""Both sides of a CPU comparison run SmolLM2 in float32 (its converted checkpoint's dtype): a
server and HF's reference agree to below 1e-4; the margin is for summation order only."""


def assert_top_logprobs_match(reference_tops: list, out: dict) -> None:
    """A server's per-step top logprobs (``/generate`` with ``return_logprob`` and
    ``top_logprobs_num``) are the reference's: the same tokens in order, each logprob within
    ``TOP_LOGPROB_TOL``. ``reference_tops``: per step ``[(logprob, token), ...]`` best first, as
    ``spans.reference.block_attention_greedy`` appends them."""
    server = [sorted(step, reverse=True) for step in out["meta_info"]["output_top_logprobs"]]
    for ref_step, server_step in zip(reference_tops, server, strict=True):
        assert [t for _, t in ref_step] == [t for _, t, _ in server_step]
        assert all(abs(a - b[0]) < TOP_LOGPROB_TOL
                   for (a, _), b in zip(ref_step, server_step, strict=True)), (ref_step,
                                                                              server_step)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A test server; ``get`` and ``post`` send its API key (``api_key``: None for a server
    started with ``--insecure``)."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path, api_key: str | None = None):
        self.proc, self.url, self.log = proc, url, log
        self.api_key = api_key
        self.stopping = False  # SIGTERM sent (stop_server)

    @property
    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header of its API key (none without a key)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _with_key(self, kwargs: dict) -> dict:
        return {**kwargs, "headers": {**self.headers, **kwargs.get("headers", {})}}

    def get(self, path: str, timeout: float = 30, **kwargs) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout, **self._with_key(kwargs))

    def post(self, path: str, timeout: float = 120, **kwargs) -> requests.Response:
        return requests.post(self.url + path, timeout=timeout, **self._with_key(kwargs))

    def generate_text(self, text: str, max_new_tokens: int = 8) -> dict:
        """Greedy ``/generate`` of ``text``; asserts HTTP 200 and returns the JSON answer."""
        r = self.post("/generate", json={"text": text, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0}})
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self, prefix: str = "sglang_pic:") -> dict[str, float]:
        """The values of its ``/metrics`` page (``--enable-metrics``) whose names start with
        ``prefix``, by name without labels."""
        return {line.split("{")[0]: float(line.split()[-1])
                for line in self.get("/metrics").text.splitlines() if line.startswith(prefix)}

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=30).status_code == 200
        except requests.RequestException:
            return False


SERVE = ("-m", "sglang_pic", "serve")
"""The launcher tests start by default (``start_server``'s ``launcher``)."""


def start_server(args: list[str], log: Path, attempts: int = 3,
                 timeout_s: float = START_TIMEOUT_S, launcher: tuple[str, ...] = SERVE,
                 env: dict[str, str] | None = None, forked: bool = True,
                 pass_key: bool = True) -> Server:
    """Start `sglang-pic serve` (or another ``launcher``: ``python <launcher> --port P
    <args>``, in ``env``, default this process's) on a free port and wait until /health
    answers; retried on a new port when another process took the chosen one in between
    (free_port cannot reserve it). ``forked``: see ``_launch``. ``pass_key``: the server gets a
    new API key in ``$SGLANG_PIC_API_KEY`` (``Server.api_key``, which its ``get`` and ``post``
    send); False: none (``--insecure``, ``--api-key-file``, or the key file the server
    generates: set ``api_key`` after the start)."""
    for attempt in range(attempts):
        try:
            key = secrets.token_urlsafe(32) if pass_key else None
            return _start_server_once(args, log, timeout_s, launcher, env, forked, key)
        except RuntimeError as e:
            if "address already in use" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def start_servers(specs: dict[str, tuple[list[str], Path]],
                  timeout_s: float = START_TIMEOUT_S) -> dict[str, Server]:
    """Start several servers together (``name -> (args, log)``), as many at once as start
    slots are free (``start_slot``; the rest queue). A failed start stops the others and raises
    its error."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(start_server, args, log, timeout_s=timeout_s)
                   for name, (args, log) in specs.items()}
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    if len(started) < len(specs):
        for srv in started.values():
            stop_server(srv)
        next(f for f in futures.values() if f.exception() is not None).result()
    return started


@contextmanager
def start_slot() -> Iterator[None]:
    """Hold one of ``START_SLOTS`` machine-wide start slots (``flock`` on a file per slot: freed
    when the holder closes it or dies) while a server starts; waits at most ``SLOT_WAIT_S``."""
    _SLOT_DIR.mkdir(exist_ok=True)
    deadline = time.time() + SLOT_WAIT_S
    while True:
        for i in range(max(1, START_SLOTS)):
            f = open(_SLOT_DIR / f"slot-{i}.lock", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            return
        if time.time() > deadline:
            raise RuntimeError(f"no server start slot free within {SLOT_WAIT_S} s")
        time.sleep(0.5)


def _start_server_once(args: list[str], log: Path, timeout_s: float,
                       launcher: tuple[str, ...] = SERVE, env: dict[str, str] | None = None,
                       forked: bool = True, api_key: str | None = None) -> Server:
    with start_slot():
        return _launch(args, log, timeout_s, launcher, env, forked, api_key)


def _launch(args: list[str], log: Path, timeout_s: float, launcher: tuple[str, ...] = SERVE,
            env: dict[str, str] | None = None, forked: bool = True,
            api_key: str | None = None) -> Server:
    """Start ``launcher`` (`sglang-pic serve`) on a free port and wait until /health answers
    (which needs no API key); ``api_key`` goes to the server in ``$SGLANG_PIC_API_KEY`` (None:
    the variable is removed from its environment).

    On a CPU machine a `sglang-pic serve` server in this process's environment is forked from
    the worker's zygote (``server_zygote``: SGLang imported once, not once per server) unless
    ``forked`` is False: the server process `sglang-pic serve` would start, without the launcher
    that forwards its signals.

    Test servers run torch with one thread: the suite keeps two or three servers up at once on a
    2-core machine, and SGLang's CPU scheduler polls a core while idle, so multi-threaded torch
    ops would fight them for cores (measured: ~15 s per short request instead of ~1 s).
    """
    running = os.environ.get("PYTEST_CURRENT_TEST", "").split("::", 1)[0]
    if running and _server_modules and (REPO / running).resolve() not in _server_modules:
        raise RuntimeError(f"{running} starts a server but is not in the server tier: move it "
                           "under test/server/")
    port = free_port()
    argv = ["--port", str(port), *args]
    forked = forked and launcher == SERVE and env is None and not has_cuda()
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS=TEST_THREADS)
    env.pop(API_KEY_ENV, None)
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    if forked:
        proc = _zygote().start(argv, env, log)
    else:
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, *launcher, *argv], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log, api_key)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:]
            if "Not enough host memory available" in tail:  # SGLang's HiCache reserve check
                pytest.skip("HiCache host tier refused by SGLang's 10 GiB host reserve (the other "
                            "test worker's servers hold the memory): "
                            + tail[tail.index("Not enough host memory"):].splitlines()[0])
            raise RuntimeError(f"server exited with {proc.returncode}; log:\n{tail}")
        if "address already in use" in log.read_text(errors="replace")[-2000:]:
            stop_server(server)
            raise RuntimeError(f"port {port}: address already in use")
        if server.healthy():
            return server
        time.sleep(HEALTH_POLL_S)
    stop_server(server)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; log:\n{log.read_text()[-4000:]}")


_zygote_client: ZygoteClient | None = None


def _zygote() -> ZygoteClient:
    """This worker's server zygote (started with the first forked server)."""
    global _zygote_client
    if _zygote_client is None:
        log = Path(tempfile.gettempdir()) / f"sglang-pic-test-zygote-{os.getpid()}.log"
        _zygote_client = ZygoteClient(dict(os.environ, OMP_NUM_THREADS=TEST_THREADS), log)
    return _zygote_client


STOP_WAIT_S = 30
"""Seconds a server may take to exit after SIGTERM before it is SIGKILLed (``wait_for_stops``)."""
_stopping: list[Server] = []


def stop_server(server: Server, wait: bool = False) -> None:
    """SIGTERM the server (its launcher drains the requests in flight and exits: 4-15 s, most of
    it SGLang's shutdown polls sleeping) and return without waiting, unless ``wait``: the servers
    still stopping are waited for (and SIGKILLed after ``STOP_WAIT_S``) at the end of this
    process's session (``wait_for_stops``), all at once. A second call does nothing."""
    if server.stopping:
        return
    server.stopping = True
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        _stopping.append(server)
    if wait:
        wait_for_stops([server])


def wait_for_stops(servers: list[Server] | None = None) -> None:
    """Wait for stopping servers (default: all of this process's) to exit, STOP_WAIT_S each at
    most from now, SIGKILLing their process group after that."""
    servers = list(_stopping) if servers is None else servers
    deadline = time.time() + STOP_WAIT_S
    for srv in servers:
        try:
            srv.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(srv.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            srv.proc.wait(timeout=30)
        if srv in _stopping:
            _stopping.remove(srv)


def pytest_sessionfinish(session, exitstatus):
    wait_for_stops()  # after the session fixtures' teardown: no server outlives the run


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[Server]:
    """The plain server: SGLang's defaults on CPU, a 16K-token pool."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = _session_servers["server"] = start_server(["--max-total-tokens", "16384"], log)
    yield srv
    stop_server(srv)


SPAN_SERVER_FLAGS = ["--enable-span-cache", "--max-total-tokens", "8192", "--page-size", "16",
                     "--chunked-prefill-size", "128", "--enable-metrics"]
"""``span_server``: page size 16 (page padding of spans), 128-token chunks (long prompts and
span units are prefilled in several chunks), the span counters on ``/metrics``."""


@pytest.fixture(scope="session")
def span_server(tmp_path_factory) -> Iterator[Server]:
    """A span-cache server (``SPAN_SERVER_FLAGS``), shared by test_spans_cpu and
    test_http_security (their tests use their own documents and prompts). Its tests are
    skipped, with the gap's line, on a release that does not serve spans yet."""
    skip_on_gap("spans")
    log = tmp_path_factory.mktemp("spans") / "server.log"
    srv = _session_servers["span_server"] = start_server(SPAN_SERVER_FLAGS, log)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from sglang_pic.launcher.default_model import ensure_default_model

    return ensure_default_model()
