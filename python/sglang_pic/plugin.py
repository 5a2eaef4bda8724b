"""The single place where sglang-pic registers itself with SGLang.

SGLang calls `register()` through the `sglang.srt.plugins` entry point in every process it starts
(the launcher, each scheduler, the detokenizer), before server arguments are parsed and before any
model code runs (`sglang.srt.plugins.load_plugins`). Each capability adds its registration here,
and only here, so one file shows everything sglang-pic changes in SGLang:

| capability                     | SGLang seam                                                    |
|--------------------------------|----------------------------------------------------------------|
| CPU support (`cpu_support`)    | HookRegistry on the HiCache host pool, paged allocator (CPU only) |
| request validation             | BEFORE hook on `TokenizerManager.generate_request` (400, not 500) |
| position-free KV (`position_free`) | `register_attention_backend` (`pic_triton`, `pic_torch_native`) + AROUND hook on `RotaryEmbedding.forward` |
| CPU twins of `torch_native`    | one AROUND hook on `support_triton` (`pic_torch_native`, `pariskv_torch_native` answer False) |
| span cache (`spans`)           | `register_radix_cache_backend` (`pic_span`) + hooks on TokenizerManager (markers -> layout), Scheduler (span sub-requests, ISPS), the output streamer and the HTTP app (`spans` field); table in `spans/__init__.py` |
| SAE eviction (`eviction`)      | `_EVICTION_POLICY_FACTORIES` + `add_radix_eviction_policy_choices` (`sae`, `gdsf`, `s3fifo`); AROUND hooks on `RadixCache` events (and `HiRadixCache`'s overrides); with `SGLANG_PIC_SAE_STATS` only, on `Scheduler.run_batch` / `on_idle` (step timing) |
| sparse decode (`sparse`)       | `register_attention_backend` (`pariskv_triton`, `pariskv_torch_native`) + AROUND hooks on `DecodeCudaGraphRunner` (a second graph set with the sparse part); with `--sparse-offload`, an AROUND hook on `Scheduler.get_new_batch_prefill` and the token allocator's `free` wrapped (`sparse/offload.py`) |
| PTStore (`store`)              | HiCache `dynamic` storage backend: `store.hicache_backend.PTStoreHiCacheStorage`, named in `--hicache-storage-backend-extra-config` (nothing to register) |
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time

from sglang_pic import __version__

logger = logging.getLogger("sglang_pic")

_registered = False


def register() -> None:
    """Entry point `sglang.srt.plugins: sglang_pic`. Idempotent."""
    global _registered
    if _registered:
        return
    _registered = True

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_pic import eviction, position_free, request_validation, spans, sparse

    features: list[str] = [
        "request-validation", "position-free-kv", "spans", "eviction", "sparse-decode"
    ]
    HookRegistry.register(
        request_validation.HOOK_TARGET,
        request_validation.check_generate_request,
        HookType.BEFORE,
    )
    position_free.register()
    _CPU_TWINS.update(position_free.CPU_BACKENDS, sparse.CPU_BACKENDS)
    HookRegistry.register(
        "sglang.srt.utils.common.support_triton", _support_triton, HookType.AROUND
    )
    spans.register()
    import sglang_pic.lang  # noqa: F401  (sgl.span for frontend programs run in this process)
    eviction.register()
    sparse.register()
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        from sglang_pic import cpu_support

        cpu_support.enable_cpu_engine()  # children spawned after this inherit the settings
        cpu_support.register_cpu_hooks()
        features.append("cpu-support")

    _announce(
        f"sglang-pic {__version__} plugin active (features: {', '.join(features)})"
    )


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
