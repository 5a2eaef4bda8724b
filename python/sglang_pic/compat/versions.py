"""The SGLang releases this sglang-pic supports, and the one-line refusal of any other.

The seam table is written against these releases (``python -m sglang_pic.compat --static``
checks another one's source). Any other installed SGLang stops the plugin and the ``sglang-pic``
commands that run SGLang before anything is patched, with one line naming the supported
releases: a partly applied plugin on an unknown release would fail later and less clearly.
"""

from __future__ import annotations

from importlib import metadata

from .seam import release_numbers

SUPPORTED_SGLANG: tuple[str, ...] = ("0.5.17", "0.5.23")
"""SGLang releases the seam table is written and tested against."""

STREAMING_SESSIONS_IN_UNIFIED_TREE: tuple[str, ...] = ("0.5.23",)
"""Releases whose ``--enable-streaming-session`` keeps its sessions in ``UnifiedRadixCache``
(0.5.17 wraps any prefix tree in a ``StreamingSession``): the span cache and a cache on one of
our eviction policies, both a ``RadixCache``, cannot serve them there."""


def streaming_sessions_need_unified_tree(release: str | None = None) -> bool:
    """Whether SGLang ``release`` (None: the installed one) keeps streaming sessions in its
    unified tree."""
    release = installed_sglang() if release is None else release
    return release is not None and release_numbers(release) in {
        release_numbers(v) for v in STREAMING_SESSIONS_IN_UNIFIED_TREE}


class UnsupportedSGLang(RuntimeError):
    """The installed SGLang is not one of ``SUPPORTED_SGLANG`` (or is not installed)."""


def installed_sglang() -> str | None:
    """The installed SGLang's version from its package metadata (None: not installed); reading
    it imports no SGLang."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def require_supported_sglang() -> str:
    """The installed SGLang's version; raises ``UnsupportedSGLang`` with one line when it is
    missing or not supported."""
    from sglang_pic import __version__

    found = installed_sglang()
    if found is None or release_numbers(found) not in {release_numbers(v) for v in SUPPORTED_SGLANG}:
        wanted = " or ".join(f"sglang=={v}" for v in SUPPORTED_SGLANG)
        raise UnsupportedSGLang(
            f"sglang-pic {__version__} supports SGLang {', '.join(SUPPORTED_SGLANG)}; found "
            f"{'no SGLang' if found is None else f'SGLang {found}'} (pip install '{wanted}')")
    return found
