"""The prefix tree our policies run on, on SGLang releases whose default tree has no Python
priority order (0.5.23).

SGLang 0.5.23 builds a ``UnifiedRadixCache`` for every prefix cache. Its default tree core is
native (Rust) and takes the eviction policy by name from a fixed list, so a policy object of
ours would never be asked for a priority. With one of our policies asked for, the default
factory builds instead:

- for a device-only cache, SGLang's ``RadixCache`` (still shipped and complete for the 0.5.23
  scheduler: ``checkpoint``, ``lock``/``unlock``), the tree 0.5.17 builds, whose events
  ``hooks`` reports;
- with HiCache's host tier (``--enable-hierarchical-cache``, which ``--ptstore`` turns on), and
  for ``tlru`` (0.5.23 refuses that name on any other tree), ``UnifiedRadixCache`` on its
  Python tree core (``tree_core_backend="python"``), which orders both tiers' evictions by the
  policy's ``get_priority`` and whose events ``unified_hooks`` reports; access times there come
  from the monotonic clock (``unified_hooks.use_clock``).

Everything else is SGLang's choice, as before. The trees a learning policy cannot run on
(hybrid models' component trees, LMCache, FlexKV, external linkers, session trees) are refused
in one line naming the setting.
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
    """SGLang's default tree, except for a cache on one of our policies (module docstring)."""
    policy = (ctx.params.eviction_policy or "").lower()
    if policy not in POLICIES or ctx.disable_radix_cache:
        return original(ctx, *args, **kwargs)
    blocker = _blocker(ctx)
    if blocker is not None:
        raise gaps.CapabilityUnavailable(
            f"--radix-eviction-policy {policy}: our eviction policies run on SGLang's "
            f"RadixCache or on UnifiedRadixCache's Python tree core, and {blocker} needs "
            f"another tree; use one of SGLang's own policies with it")
    if ctx.enable_hierarchical_cache or policy == "tlru":
        from . import unified_hooks

        ctx.params.tree_core_backend = "python"
        unified_hooks.use_clock()
        from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

        cache = original(ctx, *args, **kwargs)
        core = getattr(cache, "tree_core", None)
        if not isinstance(core, UnifiedTreeCore):
            raise gaps.CapabilityUnavailable(
                f"--radix-eviction-policy {policy}: SGLang built {type(cache).__name__} with "
                f"tree core {type(core).__name__}, not the Python UnifiedTreeCore our policies "
                "need")
        return cache
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(ctx.params)
