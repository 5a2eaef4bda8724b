"""``--radix-cache-backend pic_span``: the factory SGLang's cache registry calls, which refuses
the settings the span cache cannot serve and wires the cache to its planner and store tier."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang_pic.compat import versions
from sglang_pic.metrics import counters_for_args
from sglang_pic.position_free import BACKEND_FOR

from . import config as span_config
from .planner import SpanPlanner
from .radix_cache import SpanRadixCache
from .store_tier import COUNTERS as STORE_COUNTERS
from .store_tier import create_span_store

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)


def create_span_radix_cache(ctx: TreeCacheBuildContext) -> SpanRadixCache:
    """Factory registered as ``--radix-cache-backend pic_span``; refuses what it cannot serve."""
    args = ctx.server_args
    problems = []
    backends = {
        args.attention_backend,
        args.prefill_attention_backend,
        args.decode_attention_backend,
    }
    backends.discard(None)
    if not backends or not backends <= set(BACKEND_FOR.values()):
        problems.append(
            "it needs position-free KV: use --attention-backend "
            f"{' or '.join(BACKEND_FOR.values())} (sglang-pic serve --enable-span-cache picks it)"
        )
    if ctx.disable_radix_cache:
        problems.append("--disable-radix-cache is set")
    if ctx.enable_hierarchical_cache:
        problems.append("HiCache (--enable-hierarchical-cache) is not supported with spans yet")
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.is_dsa:
        problems.append("hybrid (sliding-window / SSM / DSA) models are not supported")
    if getattr(args, "disaggregation_mode", "null") not in (None, "null"):
        problems.append("prefill/decode disaggregation is not supported (transferred KV carries "
                        "no record of the positions its keys were computed at)")
    if (getattr(args, "enable_streaming_session", False)
            and versions.streaming_sessions_need_unified_tree()):
        problems.append("streaming sessions (--enable-streaming-session) are not supported: "
                        "SGLang keeps them in its unified tree")
    if getattr(ctx.params, "is_eagle", False):
        problems.append("speculative decoding (EAGLE bigram keys) is not supported")
    if problems:
        raise ValueError(f"--radix-cache-backend {span_config.BACKEND}: " + "; ".join(problems))
    cache = SpanRadixCache(ctx.params)
    cache.planner = SpanPlanner(cache, span_config.load())
    cache.store = create_span_store(cache, args.model_path, args.tp_size,
                                    getattr(args, "pp_size", 1),
                                    counters_for_args(args, STORE_COUNTERS))
    logger.info("span cache: segmented radix matching, schedule=%s", cache.planner.cfg.schedule)
    return cache
