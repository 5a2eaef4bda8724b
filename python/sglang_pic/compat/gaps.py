"""What a supported SGLang release cannot serve yet, refused where it is asked for.

A capability reaches a release through the seam table's rows for that release. Where SGLang
moved the code a capability hooks and its rows for the release are not written yet, the release
still serves everything else, and the capability is a ``Gap``: the launchers refuse the flags
that ask for it (``serve_conflicts.refuse``) in one line naming the feature and the SGLang
symbol the release lacks, and the feature's own set-up refuses it again in the scheduler (for
an ``Engine`` built without our launchers). Serving it anyway would be wrong without an error:
a learned eviction policy that sees no cache events, say.

Standard library only: the launcher reads it before SGLang or torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import versions
from .seam import release_numbers


@dataclass(frozen=True)
class Gap:
    """``capability`` (a key of ``serve_conflicts._features_on``: what the command line asks
    for) is not served on SGLang ``release``: plugin feature ``feature`` has no rows there for
    ``symbol``, which that release moved or removed; ``why`` says what took its place."""

    release: str
    capability: str
    feature: str
    symbol: str
    why: str

    def message(self, asked_by: str) -> str:
        """The one-line refusal of ``asked_by`` (the flags that asked, as the user gave them)."""
        return (f"{asked_by}: {self.capability.replace('_', ' ')} (feature {self.feature}) is not "
                f"available on SGLang {self.release}: it needs {self.symbol}, which "
                f"{self.release} does not have ({self.why}); SGLang "
                f"{', '.join(_serving(self.capability))} serves it")


GAPS: tuple[Gap, ...] = ()
"""Every gap, by release. Closing one is writing its feature's rows for the release
(``releases=(...)``) and deleting the gap; the tests of the capability then run on it."""


def gaps_for(release: str | None) -> tuple[Gap, ...]:
    """The gaps of SGLang ``release`` (a version string; None: not installed, none)."""
    if release is None:
        return ()
    return tuple(g for g in GAPS if release_numbers(g.release) == release_numbers(release))


def gap(capability: str, release: str | None = None) -> Gap | None:
    """The gap that keeps ``capability`` from SGLang ``release`` (None: the installed one), or
    None where the release serves it."""
    if release is None:
        release = versions.installed_sglang()
    return next((g for g in gaps_for(release) if g.capability == capability), None)


def _serving(capability: str) -> list[str]:
    """The supported releases without a gap for ``capability``."""
    return [r for r in versions.SUPPORTED_SGLANG if not any(
        g.capability == capability and g.release == r for g in GAPS)]


class CapabilityUnavailable(RuntimeError):
    """A feature's set-up was asked for a capability the installed release has a gap for."""

