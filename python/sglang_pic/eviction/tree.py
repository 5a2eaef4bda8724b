"""The prefix tree our policies run on, on SGLang releases whose default tree has no Python
priority order (0.5.23).

SGLang 0.5.23 builds a ``UnifiedRadixCache`` for every prefix cache. Its default tree core is
native (Rust) and takes the eviction policy by name from a fixed list, so a policy object of
ours would never be asked for a priority, and its events (``hooks``) come from ``RadixCache``
methods that tree does not have. SGLang still ships ``RadixCache``, complete for the 0.5.23
scheduler (``checkpoint``, ``lock``/``unlock``; its pure sliding-window and FlexKV trees are
subclasses): with one of our policies asked for, the default factory builds that tree instead,
the tree 0.5.17 builds for every device-only cache. Everything else is SGLang's choice, as
before.

The trees a learning policy cannot run on there (HiCache's host tier, hybrid models' component
trees, external linkers) are refused in one line naming the setting; the launchers refuse the
HiCache case earlier, from the command line (``compat.gaps``).
"""

from __future__ import annotations

from typing import Any

from sglang_pic.compat import gaps

from . import POLICIES


def _blocker(ctx: Any) -> str | None:
    """The setting that needs SGLang's unified tree (None: a device-only ``RadixCache`` serves
    the cache as SGLang would)."""
    from sglang.srt.runtime_context import get_disagg, get_memory

    memory = get_memory()
    if ctx.enable_hierarchical_cache:
        return "--enable-hierarchical-cache"
    for flag, on in (
        ("--enable-lmcache", getattr(memory, "enable_lmcache", False)),
        ("--enable-flexkv", getattr(memory, "enable_flexkv", False)),
        ("--enable-unified-cache-external-linker",
         getattr(memory, "enable_unified_cache_external_linker", False)),
        ("--enable-session-radix-cache", ctx.params.enable_session_radix_cache),
        ("--enable-streaming-session",  # its sessions live in the unified tree
         getattr(ctx.server_args, "enable_streaming_session", False)),
        ("--disaggregation-decode-retraction-backup host_pool",
         getattr(get_disagg(), "disaggregation_decode_retraction_backup", None) == "host_pool"),
    ):
        if on:
            return flag
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.is_dsa:
        return "a hybrid model (sliding-window, state-space or sparse-attention layers)"
    return None


def around_default_radix_cache_factory(original, ctx, *args, **kwargs):
    """SGLang's default tree, except for a cache on one of our policies: ``RadixCache``."""
    policy = (ctx.params.eviction_policy or "").lower()
    if policy not in POLICIES or ctx.disable_radix_cache:
        return original(ctx, *args, **kwargs)
    blocker = _blocker(ctx)
    if blocker is not None:
        found = gaps.gap("eviction_with_hicache")
        release = found.release if found is not None else "this SGLang"
        raise gaps.CapabilityUnavailable(
            f"--radix-eviction-policy {policy}: our eviction policies run on SGLang's "
            f"RadixCache, and {blocker} needs SGLang {release}'s UnifiedRadixCache; use one of "
            f"SGLang's own policies with it")
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(ctx.params)
