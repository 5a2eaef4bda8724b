"""The single place where sglang-pic registers itself with SGLang.

SGLang calls `register()` through the `sglang.srt.plugins` entry point in every process it starts
(the launcher, each scheduler, the detokenizer), before server arguments are parsed and before any
model code runs (`sglang.srt.plugins.load_plugins`). Each capability adds its registration here,
and only here, so one file shows everything sglang-pic changes in SGLang.

HookRegistry hooks (each feature's `register()` adds them; `register()` below applies them and
**refuses to start** when one did not patch its target, naming the SGLang symbol and our feature:
SGLang's own `apply_hooks` only logs such a failure, and a missed hook would silently serve
wrong tokens, e.g. sparse rows replaying the dense CUDA graph):

| capability                     | SGLang seam                                                    |
|--------------------------------|----------------------------------------------------------------|
| request validation             | BEFORE hook on `TokenizerManager.generate_request` (400, not 500) |
| API key (`api_key`)            | AROUND hook on `sglang.srt.utils.auth.decide_request_auth`: a non-ASCII `Authorization` header is decided as none (401, not a 500 with a traceback), and the admin routes of `frontdoor.endpoints` need the admin key |
| HTTP front door (`frontdoor`)  | BEFORE hook on `http_server.launch_server` (the `FrontDoor` middleware: route allowlist, admin key, body size and time, span rewrite, one schema per body) and AROUND `uvicorn.config.Config.load` (header deadline and connection cap in uvicorn's protocol class); AFTER `utils.auth.add_api_key_middleware` (a 401 that names the header and the key file); AFTER `TokenizerManager.init_tokenizer_and_processor` (a tokenizer's "no limit" `model_max_length`) |
| secret redaction (`redaction`) | AROUND hook on `ServerArgs.__repr__` (the start-up log) and AFTER hooks on `TokenizerManager.resolved_config_dict` / `RuntimeContext.resolved_server_args_dict` (`/server_info`): `api_key`, `admin_api_key`, `ssl_keyfile_password` shown as `<redacted>` |
| our server flags (`sglang_launcher`) | AROUND hooks on `ServerArgs.add_cli_args` (our flag groups, first in `--help`) and `prepare_server_args` (our flags checked and translated, the API key handed over as `--api-key` in memory: `api_key`), so SGLang's own launchers take them too |
| position-free KV (`position_free`) | `register_attention_backend` (`pic_flashinfer`, `pic_triton`, `pic_torch_native`) + AFTER hook on `ForwardBatch.init_new` (slot positions, span requests' own turned copies of moved pages with `--span-copy-on-reuse`, batches that read moved keys) + AROUND hooks on `DecodeCudaGraphRunner` / `PrefillCudaGraphRunner.can_run_graph` (on `pic_flashinfer` those batches keep off FlashInfer's graphs) and, for `--position-free-span-graphs`, on `DecodeCudaGraphRunner._capture_one_stream` / `_make_graph_key` (a second decode graph set) |
| CPU twins of `torch_native`    | one AROUND hook on `support_triton` (`pic_torch_native`, `pariskv_torch_native` answer False) |
| span cache (`spans`)           | `register_radix_cache_backend` (`pic_span`) + hooks on TokenizerManager (markers -> layout), Scheduler (span sub-requests, ISPS, cancellation; `get_new_batch_prefill`: a request joins the batch right after its sub-requests', and sub-requests alone just over the chunk budget go in one pass; `init_load_inquirer` swaps in `SpanLoadInquirer` for `/v1/loads`), the output streamer (`get_cached_tokens_details`); the `spans` field is resolved by the front door (`spans.http.resolve`); table in `spans/__init__.py` |
| SAE eviction (`eviction`)      | AROUND hooks on `RadixCache` events (and `HiRadixCache`'s overrides, its host-tier `evict_host`, device-to-host `_evict_backuped`, write-through's `write_backup` (the policy may defer a copy) and `write_back`'s `_drop_subtree_no_host`; our `SpanRadixCache`'s `match_prefix`, `cache_finished_req`, `cache_unfinished_req`, which bypass `RadixCache`'s for span requests, with `eviction.context.segment_at` around each segment's insert); with `SGLANG_PIC_SAE_STATS` only, on `Scheduler.run_batch` / `on_idle` (step timing) |
| sparse decode (`sparse`)       | `register_attention_backend` (`pariskv_triton`, `pariskv_flashinfer`, `pariskv_torch_native`) + AROUND hooks on `DecodeCudaGraphRunner` (`_capture_one_stream` / `_make_graph_key`: a second graph set with the sparse part, and on `pariskv_flashinfer` a third for batches of only sparse rows, without the dense decode; `load_batch`: the batch for the replay-side metadata) + an AFTER hook on `ForwardBatch.init_new` (each request's row as host ints: a sparse step's bookkeeping reads no GPU tensor), a BEFORE hook on `TokenizerManager._validate_one_request` (with `--sparse-offload`: a request longer than its host region is a 400); with `--sparse-offload`, an AROUND hook on `Scheduler.get_new_batch_prefill`, and for prompts longer than the pool (`sparse/prefill_offload.py`) AFTER `TpModelWorker.get_worker_info` (the input cap), AROUND `Scheduler.init_req_max_new_tokens`, AROUND `PrefillAdder.add_one_req` (admission) and AROUND `PrefillCudaGraphRunner.can_run_graph` (batches that may attend an offloaded prefix run eagerly) |
| HiCache storage I/O (`store.idle_yield`, `store.prefetch_trace`) | AROUND hook on `Scheduler.on_idle`: while a storage prefetch or write-back is in flight and nothing runs, the idle pass ends with a `--hicache-storage-idle-yield-us` nap, so the storage threads get the GIL, and AROUND `HiCacheController._storage_hit_query` (a storage lookup in flight: the idle pass waits for its end instead); with `--ptstore-trace`, AROUND `HiRadixCache.check_prefetch_progress` (a trace line when the scheduler takes a finished prefetch) and AFTER `Scheduler.get_new_batch_prefill` (one per prefill batch formed) |
| CPU support (`cpu_support`, CPU only) | REPLACE hooks on the HiCache host pool's pinning, AFTER hook on `HostKVCache.__init__`; AFTER hook on `engine._set_envs_and_config` (the scheduler and detokenizer processes are forked, not spawned: they start with what is already imported); xgrammar on CPU (`cpu_grammar`): REPLACE `xgrammar_backend._allocate_token_bitmask`, AROUND `XGrammarGrammar.apply_vocab_mask` |

Seams outside the HookRegistry (SGLang offers no hook for them; `SEAMS` lists them and
`register()` checks those that exist at start):

| seam | where | why not a hook |
|---|---|---|
| `mem_cache.utils._EVICTION_POLICY_FACTORIES` += `sae`, `gdsf`, `s3fifo` | `eviction/__init__.py` | SGLang's policy table (with `add_radix_eviction_policy_choices`) |
| `RadixCache.evictable_leaves` swapped for a sample during one `evict` | `eviction/hooks.py` | per-instance state, inside our AROUND hook on `evict` |
| the token allocator's `free` wrapped per instance (`--sparse-offload`) | `sparse/offload.py` | instance attribute, wrapped when the offload state is built |
| `sglang.span` set on import | `lang.py` | the frontend DSL's namespace, not a function to wrap |
| the dense decode's K/V write (`KVWriteLoc`, `FlashInferAttnBackend._kv_write_scales`) called by the only-sparse decode | `sparse/backends.py` | a call into SGLang's pool API, not a patch: checked to exist |
| CPU only: `torch.cpu.Stream.synchronize/query`, the paged allocator, `transfer_kv_direct` where a module lacks it | `cpu_support.py` | torch's and SGLang's names that do not exist on CPU (HookRegistry can only wrap existing names) |
| CPU only: the Triton interpreter's scalar indexing and its re-patching of `triton.language` on every helper call | `sglang_pic_kernel._interpreter` | Triton, not SGLang |
| CPU only: `sglang_pic_cpu.pth` import finder | `cpu_support.py` | stand-ins for `torchvision` / `sgl_kernel` must exist before SGLang's first import |
| PTStore | HiCache `dynamic` storage backend, named in `--hicache-storage-backend-extra-config` | SGLang's own extension point (nothing to patch) |
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable

from sglang_pic import __version__

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


def _register() -> None:
    global _loaded
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_pic import (
        api_key,
        eviction,
        frontdoor,
        position_free,
        redaction,
        request_validation,
        sglang_launcher,
        spans,
        sparse,
    )
    from sglang_pic.store import idle_yield, prefetch_trace

    def validation() -> None:
        HookRegistry.register(request_validation.HOOK_TARGET,
                              request_validation.check_generate_request, HookType.BEFORE)

    def cpu_twins() -> None:
        _CPU_TWINS.update(position_free.CPU_BACKENDS, sparse.CPU_BACKENDS)
        HookRegistry.register("sglang.srt.utils.common.support_triton", _support_triton,
                              HookType.AROUND)

    def hicache_storage() -> None:
        idle_yield.register()
        prefetch_trace.register()

    def dsl() -> None:
        import sglang_pic.lang  # noqa: F401  (sgl.span for frontend programs in this process)

    steps: list[tuple[str, Callable[[], None]]] = [
        ("request-validation", validation),
        ("api-key", api_key.register),
        ("front-door", frontdoor.register),
        ("secret-redaction", redaction.register),
        ("server-flags", sglang_launcher.register),
        ("position-free-kv", position_free.register),
        ("cpu-twins", cpu_twins),
        ("spans", spans.register),
        ("frontend-dsl", dsl),
        ("eviction", eviction.register),
        ("sparse-decode", sparse.register),
        ("hicache-storage", hicache_storage),
    ]
    from sglang_pic import cpu_support

    # SGLang's CPU engine when asked for, or when there is no accelerator: SGLang's own launchers
    # (`python -m sglang.launch_server`) would stop with "No accelerator ... or platform plugin"
    # (`sglang_launcher` adds the CPU flags). Processes spawned after this inherit the settings.
    engine = os.environ.get("SGLANG_USE_CPU_ENGINE")
    if engine == "1" or (engine is None and not cpu_support.has_cuda()):
        cpu_support.enable_cpu_engine()
        steps.append(("cpu-support", cpu_support.register_cpu_hooks))

    needed: dict[str, list[str]] = {}  # hook target -> our features hooking it
    for feature, step in steps:
        before = {t: len(h) for t, h in HookRegistry._hooks.items()}
        try:
            step()
        except Exception as e:
            raise SeamError(f"sglang-pic: refusing to start: feature {feature} failed to "
                            f"register: {type(e).__name__}: {e}") from e
        for t, h in HookRegistry._hooks.items():
            if len(h) > before.get(t, 0):
                needed.setdefault(t, []).append(feature)
    apply_and_verify(needed)
    check_seams()
    _loaded = True
    _announce(f"sglang-pic {__version__} plugin active "
              f"(features: {', '.join(f for f, _ in steps)}; {len(needed)} hooks verified)")


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
            f"(sglang-pic {__version__} needs sglang==0.5.17; see the traceback above):\n{lines}")


SEAMS: dict[str, tuple[str, Callable[[], bool]]] = {}
"""Seams outside the HookRegistry checked at start: ``name -> (feature, check)``."""


def _seam(name: str, feature: str):
    def add(check: Callable[[], bool]) -> Callable[[], bool]:
        SEAMS[name] = (feature, check)
        return check
    return add


@_seam("sglang.srt.mem_cache.utils._EVICTION_POLICY_FACTORIES", "eviction")
def _policies_registered() -> bool:
    from sglang.srt.mem_cache import utils as cache_utils

    from sglang_pic.eviction import POLICIES

    return all(p in cache_utils._EVICTION_POLICY_FACTORIES for p in POLICIES)


@_seam("FlashInferAttnBackend._kv_write_scales + KVWriteLoc(loc, swa_loc)", "sparse")
def _decode_kv_write_exists() -> bool:
    import dataclasses

    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    fields = [f.name for f in dataclasses.fields(KVWriteLoc)]
    return callable(getattr(FlashInferAttnBackend, "_kv_write_scales", None)) \
        and fields[:2] == ["loc", "swa_loc"]


@_seam("sglang.span", "frontend-dsl")
def _span_exposed() -> bool:
    import sglang

    from sglang_pic.lang import span

    return getattr(sglang, "span", None) is span


def check_seams() -> None:
    """Stop the process if a seam outside the HookRegistry did not take."""
    bad = [f"  - {name} (needed by {feature})" for name, (feature, ok) in SEAMS.items()
           if not ok()]
    if bad:
        raise SeamError("sglang-pic: refusing to start: seam(s) not in place:\n" + "\n".join(bad))


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
