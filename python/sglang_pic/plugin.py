"""The single place where sglang-pic registers itself with SGLang.

SGLang calls `register()` through the `sglang.srt.plugins` entry point in every process it starts
(the launcher, each scheduler, the detokenizer), before server arguments are parsed and before any
model code runs (`sglang.srt.plugins.load_plugins`).

What sglang-pic changes in SGLang is declared in one table, `sglang_pic.compat` (one module per
SGLang subsystem; the list is generated into the seam section of docs/architecture.md, or printed
by `python -m sglang_pic.compat --markdown`). `register()` consumes it feature by feature
(`FEATURES`, in this order: hooks of several features on one target chain in it): it runs the
feature's set-up (registries, state), registers the feature's hook rows whose condition holds,
applies them, and **refuses to start** when a hook did not patch its target or another row is
not in place (an override, a registry entry, an API we call), naming the SGLang symbol and our
feature. SGLang's own `apply_hooks` only logs such a failure, and its plugin loader logs and
swallows a plugin's exception: a missed seam would silently serve wrong tokens, e.g. sparse rows
replaying the dense CUDA graph.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
from typing import TYPE_CHECKING

from sglang_pic import __version__

if TYPE_CHECKING:
    from sglang_pic.compat import Seam

logger = logging.getLogger("sglang_pic")

_registered = False  # re-entry guard: set when register() starts
_loaded = False  # set when it has finished


class SeamError(SystemExit):
    """An SGLang seam a feature needs did not apply: the process must not serve.

    A `SystemExit`, not an `Exception`: SGLang's `load_plugins` logs and swallows exceptions
    from a plugin, and the server would start without the feature's patch."""


def registered() -> bool:
    """Whether ``register`` ran to its end in this process: SGLang's ``load_plugins`` found our
    entry point, and every feature's registration and seam check passed (``load_plugins`` logs
    and swallows a plugin's exception, which would leave a feature out)."""
    return _loaded


def register() -> None:
    """Entry point `sglang.srt.plugins: sglang_pic`. Idempotent."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        _register()
    except SeamError:
        raise
    except Exception as e:  # SGLang's load_plugins would log it and serve without the feature
        raise SeamError(f"sglang-pic: refusing to start: registering the plugin failed: "
                        f"{type(e).__name__}: {e}") from e


FEATURES: dict[str, str | None] = {
    "request-validation": None,
    "api-key": None,
    "front-door": None,
    "secret-redaction": None,
    "server-flags": None,
    "position-free-kv": "sglang_pic.position_free:register",
    "cpu-twins": "sglang_pic.plugin:_gather_cpu_twins",
    "spans": "sglang_pic.spans:register",
    "frontend-dsl": "sglang_pic.lang:install",
    "eviction": "sglang_pic.eviction:register",
    "sparse-decode": "sglang_pic.sparse:register",
    "hicache-storage": "sglang_pic.store.idle_yield:register",
    "cpu-support": "sglang_pic.cpu.support:register_cpu_support",
}
"""Every feature, in registration order, with its set-up (``"module:function"``, run before its
seam rows are registered; None: it has only rows). ``cpu-support`` runs on the CPU engine only."""

CPU_ONLY = ("cpu-support",)


def _register() -> None:
    global _loaded
    from sglang_pic.compat.conditions import cpu_engine
    from sglang_pic.compat.versions import UnsupportedSGLang, require_supported_sglang
    from sglang_pic.cpu import support as cpu_support

    try:
        release = require_supported_sglang()
    except UnsupportedSGLang as e:
        raise SeamError(f"sglang-pic: refusing to start: {e}") from None

    features = list(FEATURES)
    # SGLang's CPU engine when asked for, or when there is no accelerator: SGLang's own launchers
    # (`python -m sglang.launch_server`) would stop with "No accelerator ... or platform plugin"
    # (`sglang_launcher` adds the CPU flags). Processes spawned after this inherit the settings.
    if cpu_engine():
        cpu_support.enable_cpu_engine()
    else:
        features = [f for f in features if f not in CPU_ONLY]

    needed: dict[str, list[str]] = {}  # hook target -> our features hooking it
    rows: list[Seam] = []  # the other rows registered: checked once all hooks are applied
    for feature in features:
        hooked, others = register_feature(feature, release)
        for target in hooked:
            needed.setdefault(target, []).append(feature)
        rows += others
    apply_and_verify(needed)
    check_seams(rows)
    _loaded = True
    _announce(f"sglang-pic {__version__} plugin active "
              f"(features: {', '.join(features)}; {len(needed)} hooks verified)")


def register_feature(feature: str, release: str | None = None) -> tuple[list[str], list[Seam]]:
    """Run ``feature``'s set-up and register its hook rows for SGLang ``release`` (None: the
    installed one) whose condition holds, without applying them (``HookRegistry.apply_hooks``
    does; ``apply_and_verify`` checks). Returns the targets hooked and the feature's other rows
    whose condition holds (for ``check_seams``). The plugin passes the release it checked, so
    the installed version is read once at start.

    The plugin calls this for every feature; a program that wants one feature without a
    server (the eviction trace replay) calls it, then ``HookRegistry.apply_hooks()``. Any
    exception is a ``SeamError`` naming the feature, and the row when one failed."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_pic.compat import HOOK_KINDS, for_feature, resolve
    from sglang_pic.compat.conditions import holds

    setup = FEATURES[feature]
    try:
        if setup is not None:
            resolve(setup)()
    except Exception as e:
        raise SeamError(f"sglang-pic: refusing to start: feature {feature} failed to "
                        f"register: {type(e).__name__}: {e}") from e
    hooked: list[str] = []
    others: list[Seam] = []
    for seam in for_feature(feature, release):
        try:
            if seam.condition is not None and not holds(seam.condition):
                continue
            if seam.kind in HOOK_KINDS:
                HookRegistry.register(seam.target, resolve(str(seam.hook)), HookType[seam.kind])
                hooked.append(seam.target)
            else:
                others.append(seam)
        except Exception as e:
            raise SeamError(f"sglang-pic: refusing to start: feature {feature} failed to "
                            f"register {seam.label} ({seam.kind} {seam.hook}): "
                            f"{type(e).__name__}: {e}") from e
    return hooked, others


def apply_and_verify(needed: dict[str, list[str]]) -> None:
    """Apply the registered hooks now and stop the process if any of ``needed`` (``{SGLang
    target: our features}``) was not patched. SGLang applies hooks again after all plugins ran;
    targets already patched are skipped there, so nothing is wrapped twice."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()
    missing = sorted(t for t in needed if t not in HookRegistry._patched)
    if missing:
        lines = "\n".join(f"  - {t} (needed by {', '.join(needed[t])})" for t in missing)
        raise SeamError(
            f"sglang-pic: refusing to start: {len(missing)} SGLang symbol(s) could not be patched "
            f"(see the traceback above):\n{lines}")


def check_seams(rows: list[Seam]) -> None:
    """Stop the process if a seam row outside the HookRegistry is not in place
    (``compat.check``: an override, a registry entry, an API we call, an attribute)."""
    from sglang_pic.compat import check

    bad = [f"  - {seam.label} (needed by {seam.feature}): {problem}" for seam in rows
           if (problem := check(seam)) is not None]
    if bad:
        raise SeamError("sglang-pic: refusing to start: seam(s) not in place:\n"
                        + "\n".join(bad))


def _gather_cpu_twins() -> None:
    """The ``cpu-twins`` set-up: the names our ``support_triton`` hook answers for."""
    from sglang_pic import position_free, sparse

    _CPU_TWINS.update(position_free.CPU_BACKENDS, sparse.CPU_BACKENDS)


# our CPU twins of ``torch_native`` (position-free, sparse), filled by register()
_CPU_TWINS: set[str] = set()


def _support_triton(original, backend: str) -> bool:
    """Our CPU twins of ``torch_native`` answer like it: False. SGLang asks on allocation
    paths, so the names are gathered once, at registration."""
    return False if backend in _CPU_TWINS else original(backend)


def _announce(message: str) -> None:
    """One line per server, from the launching process (scheduler/detokenizer children stay quiet).

    Plugins load before SGLang configures logging, so an INFO record would be dropped; we write
    the line in SGLang's log format ourselves.
    """
    if multiprocessing.parent_process() is not None:
        logger.debug(message)
        return
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}] {message}", file=sys.stderr, flush=True)
