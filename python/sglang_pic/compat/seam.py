"""The row type of the seam table (``sglang_pic.compat``): a leaf, so each subsystem module
imports it without importing the table."""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from typing import Any

HOOK_KINDS = ("BEFORE", "AFTER", "AROUND", "REPLACE")
"""The ``HookRegistry``'s hook types: the plugin registers these rows and verifies the patch."""

KINDS: dict[str, str] = {
    "BEFORE": "HookRegistry BEFORE hook: runs before the target, may change its arguments",
    "AFTER": "HookRegistry AFTER hook: runs after the target, may change its result",
    "AROUND": "HookRegistry AROUND hook: wraps the target and calls it (or not)",
    "REPLACE": "HookRegistry REPLACE hook: the target is ours",
    "registry": "an entry our set-up puts in one of SGLang's registries (`key`), checked to be "
                "there and to be ours",
    "override": "a private method of an SGLang class that our subclass overrides; checked: the "
                "base still has it, and our class overrides it",
    "instance-patch": "a name replaced on an instance, class or module at run time, outside the "
                      "HookRegistry; checked: its owner exists",
    "attribute": "an attribute we hang on SGLang's objects; checked: SGLang's class does not "
                 "define it (on a module: it is ours once set up)",
    "call": "an SGLang API our code calls or implements; checked: it exists",
}
"""Each kind of seam, and what the plugin checks for it at start."""


@dataclass(frozen=True)
class Seam:
    """One place where sglang-pic meets SGLang.

    ``target`` is the dotted symbol on SGLang's side (or uvicorn's, torch's, Triton's, or one of
    our own classes' when a hook wraps it); ``hook`` is ours, as ``"module:qualname"`` (None
    where a row has nothing of ours to name); ``kind`` is a key of ``KINDS``; ``feature`` is the
    plugin feature that needs it (``sglang_pic.plugin.FEATURES``); ``condition`` names a
    predicate of ``compat.conditions`` (None: always); ``why`` says what the seam is for;
    ``key`` is a registry row's entry; ``check`` names a further test (``"module:function"``,
    returning True when the seam is as we need it); ``releases`` names the SGLang releases the
    row is for (None: every supported release), so one table serves several releases and a
    seam SGLang moved is two rows, one per release."""

    target: str
    hook: str | None
    kind: str
    feature: str
    condition: str | None = None
    why: str = ""
    key: str | None = None
    check: str | None = None
    releases: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"seam {self.target}: unknown kind {self.kind!r}")
        if self.kind in HOOK_KINDS and (self.hook is None or ":" not in self.hook):
            raise ValueError(f"seam {self.target}: a hook row names its hook as 'module:name'")

    def applies_to(self, release: str | None) -> bool:
        """Whether the row is for SGLang ``release`` (a version string; None: not known, every
        row applies). A local build or post-release counts as the release it was built from."""
        if self.releases is None or release is None:
            return True
        return release_numbers(release) in {release_numbers(r) for r in self.releases}

    @property
    def owner(self) -> str:
        """The dotted name the target's last part lives on (a module, class or object)."""
        return self.target.rsplit(".", 1)[0]

    @property
    def name(self) -> str:
        """The target's last part: the method, function or attribute."""
        return self.target.rsplit(".", 1)[1]

    @property
    def label(self) -> str:
        """The target as messages and the docs show it (a registry row with its entry)."""
        return f"{self.target}[{self.key!r}]" if self.key is not None else self.target


def release_numbers(version: str) -> tuple:
    """The release numbers of ``version``: ``0.5.17+cu128`` and ``0.5.17.post1`` are
    ``(0, 5, 17)``, as is ``0.5.17``."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return (version,)


def resolve(name: str) -> Any:
    """The object ``name`` names: ``"pkg.module:Qual.name"`` or a dotted path (importing what
    it needs, as the ``HookRegistry`` does)."""
    return pkgutil.resolve_name(name)
