"""Semantic adaptive eviction (SAECache) and strong baselines for SGLang's prefix cache.

In SGLang (the ``eviction`` rows of the seam table, ``sglang_pic.compat``):

1. policies ``auto`` (``auto.AutoStrategy``: follows whichever of ``sae``, ``gdsf``, ``s3fifo``,
   ``lru`` and ``tlru`` hits most in its shadow cache, ``shadow``), ``sae``
   (``sae.SAEStrategy``), ``gdsf``, ``s3fifo`` and ``tlru`` (``baselines``) in SGLang's
   eviction-policy table ``sglang.srt.mem_cache.utils._EVICTION_POLICY_FACTORIES`` and as
   ``--radix-eviction-policy`` choices (``server_args.add_radix_eviction_policy_choices``);
2. AROUND hooks on ``RadixCache`` (``hooks``) that feed hits, inserts and evictions to the
   cache's policy through ``policy.CachePolicy``; SGLang's own policies are seen through an
   adapter whose events do nothing (``policy.as_policy``), so they are untouched;
3. on SGLang 0.5.23, whose default tree orders evictions natively, ``RadixCache`` as the tree of
   a cache on one of our policies (``tree``).

``register()`` does the first; the plugin registers the hooks. A program that replays traces
without a server calls ``sglang_pic.plugin.register_feature("eviction")``, which does both.

The trace-driven simulator that drives SGLang's real ``RadixCache`` with these policies lives in
``benchmark/eviction/``; how it all works: ``docs/eviction.md``.
"""

from __future__ import annotations

POLICIES = ("auto", "sae", "gdsf", "s3fifo", "tlru")


def register() -> None:
    """The feature's set-up: our policies in SGLang's table and choices."""
    from sglang.srt.mem_cache import utils as cache_utils
    from sglang.srt.server_args import add_radix_eviction_policy_choices

    from .auto import AutoStrategy
    from .baselines import GDSFStrategy, S3FIFOStrategy, TLRUStrategy
    from .sae import SAEStrategy

    ours = {"auto": AutoStrategy, "sae": SAEStrategy, "gdsf": GDSFStrategy,
            "s3fifo": S3FIFOStrategy, "tlru": TLRUStrategy}
    cache_utils._EVICTION_POLICY_FACTORIES.update(ours)
    # SGLang's own table has fifo, mru and filo, which its CLI does not offer: every policy of
    # the table is a choice (the docs list them all)
    add_radix_eviction_policy_choices(
        [*POLICIES, *(p for p in cache_utils._EVICTION_POLICY_FACTORIES if p not in POLICIES)])

