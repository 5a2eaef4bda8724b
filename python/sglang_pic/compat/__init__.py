"""Every seam sglang-pic uses in SGLang, declared once.

A seam is a place where our code meets SGLang's: a hook the ``HookRegistry`` patches, an entry
in one of SGLang's registries, a private method one of our subclasses overrides, a name replaced
on an instance or module at run time, an attribute we hang on SGLang's objects, or an SGLang API
we call that must exist. Each is one ``Seam`` row, in the module of the SGLang subsystem it
touches (``scheduler``, ``tokenizer_manager``, ``radix_cache``, ``hicache``, ``forward_batch``,
``graph_runner``, ``attention``, ``server_args``, ``http``, ``frontend``, ``platform``).

The rows are data: a row names our function as ``"module:qualname"`` text, so reading the table
imports no feature. ``sglang_pic.plugin.register`` consumes it: for each feature it runs the
feature's set-up, registers the feature's hook rows whose condition holds (resolving the hook
only then), applies them, and checks every row it applied (``check``); anything that fails stops
the process with a ``SeamError`` naming the feature and the symbol. This table is the only
place a target string is written; the seam section of ``docs/architecture.md`` is generated
from it (``python -m sglang_pic.compat --markdown``).
"""

from __future__ import annotations

import types

from . import (
    attention,
    forward_batch,
    frontend,
    graph_runner,
    hicache,
    http,
    platform,
    radix_cache,
    scheduler,
    server_args,
    tokenizer_manager,
)
from .seam import HOOK_KINDS, KINDS, Seam, resolve

SUBSYSTEMS: tuple[types.ModuleType, ...] = (
    http, server_args, tokenizer_manager, scheduler, radix_cache, hicache, forward_batch,
    graph_runner, attention, frontend, platform)
"""The table's modules, in the order the docs list them (each has ``TITLE`` and ``ROWS``)."""

SEAMS: tuple[Seam, ...] = tuple(row for module in SUBSYSTEMS for row in module.ROWS)
"""Every row of the table, for every supported release."""


def rows_for(release: str | None) -> tuple[Seam, ...]:
    """The rows for SGLang ``release`` (None: every row), in table order."""
    return tuple(s for s in SEAMS if s.applies_to(release))


def for_feature(feature: str, release: str | None = None) -> tuple[Seam, ...]:
    """The rows ``feature`` needs on SGLang ``release`` (None: the installed one), in table
    order."""
    if release is None:
        from .versions import installed_sglang

        release = installed_sglang()
    return tuple(s for s in rows_for(release) if s.feature == feature)


def check(seam: Seam) -> str | None:
    """Why ``seam`` is not as we need it in this process, or None when it is (see ``KINDS``;
    hook rows are verified by the plugin after the ``HookRegistry`` applied them). Call after
    the feature's set-up ran: registry entries and module attributes are in place by then."""
    try:
        problem = _check_kind(seam)
    except (ImportError, AttributeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    if problem is None and seam.check is not None and not resolve(seam.check)():
        problem = f"{seam.check} is false"
    return problem


def _check_kind(seam: Seam) -> str | None:
    if seam.kind in HOOK_KINDS or seam.kind == "call":
        resolve(seam.target)
        return None
    if seam.kind == "registry":
        registry = resolve(seam.target)
        if seam.key not in registry:
            return f"{seam.key!r} is not in it"
        if isinstance(registry, dict) and seam.hook is not None \
                and registry[seam.key] is not resolve(seam.hook):
            return f"{seam.key!r} is not {seam.hook}"
        return None
    if seam.kind == "override":
        base = resolve(seam.owner)
        if not hasattr(base, seam.name):
            return f"{seam.owner} has no {seam.name} any more"
        ours_owner, _, ours_name = str(seam.hook).rpartition(".")
        ours = resolve(ours_owner)
        if not (isinstance(ours, type) and issubclass(ours, base) and ours_name in vars(ours)):
            return f"{ours_owner} does not override it"
        return None
    owner = resolve(seam.owner)
    if seam.kind == "attribute":
        if isinstance(owner, types.ModuleType):  # a module: the attribute is set up already
            if seam.hook is not None and getattr(owner, seam.name, None) is not resolve(seam.hook):
                return f"{seam.target} is not {seam.hook}"
        elif hasattr(owner, seam.name):
            return f"SGLang's {seam.owner} defines {seam.name} itself"
    return None


def markdown() -> str:
    """The seam section of ``docs/architecture.md``: kinds, conditions, and one table per
    subsystem module."""
    from .conditions import CONDITIONS
    from .gaps import GAPS

    counts = {k: sum(1 for s in SEAMS if s.kind == k) for k in KINDS}
    lines = [
        "<!-- generated from python/sglang_pic/compat/ by "
        "`python -m sglang_pic.compat --markdown`; edit the table there -->",
        "",
        f"{len(SEAMS)} seams: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n) + ".",
        "Targets leave out `sglang.srt.` (other packages are named in full); our functions "
        "leave out `sglang_pic.`. The plugin checks each row of a feature it registers:",
        "",
        *(f"- **{k}**: {text}" for k, text in KINDS.items() if counts[k]),
        "",
        "Conditions (`compat/conditions.py`; a row without one is always registered and checked):",
        "",
        *(f"- `{name}`: {c.text}" for name, c in CONDITIONS.items()),
        "",
        "Gaps (`compat/gaps.py`): what a supported release does not serve yet. The launchers "
        "refuse the flags that ask for it, in one line naming the feature and the symbol:",
        "",
        "| release | capability | feature | symbol the release lacks | what took its place |",
        "|---|---|---|---|---|",
        *(f"| {g.release} | {g.capability} | {g.feature} | "
          f"`{g.symbol.removeprefix('sglang.srt.')}` | {g.why} |" for g in GAPS),
    ]
    for module in SUBSYSTEMS:
        lines += ["", f"### {module.TITLE} (`compat/{module.__name__.rsplit('.', 1)[1]}.py`)", "",
                  "| kind | target | ours | feature | when | releases | why |",
                  "|---|---|---|---|---|---|---|"]
        lines += [_row(s) for s in module.ROWS]
    return "\n".join(lines) + "\n"


def _row(seam: Seam) -> str:
    target = seam.label.removeprefix("sglang.srt.")
    hook = f"`{seam.hook.removeprefix('sglang_pic.')}`" if seam.hook else ""
    cells = [seam.kind, f"`{target}`", hook, seam.feature, f"`{seam.condition}`"
             if seam.condition else "", ", ".join(seam.releases) if seam.releases else "all",
             seam.why]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


__all__ = ["HOOK_KINDS", "KINDS", "SEAMS", "SUBSYSTEMS", "Seam", "check", "for_feature",
           "markdown", "resolve", "rows_for"]
