"""CPU support for SGLang 0.5.17: what a CPU-only machine lacks, and what we put in its place.

SGLang 0.5.17 targets CUDA. On a CPU-only machine (our developer machines and CI) it runs a dense
Llama/Qwen correctly once five gaps are closed; this module is the one place that closes them.

1. `torchvision` is imported unconditionally (`sglang/srt/utils/common.py`, multimodal utils), but
   PyPI's torchvision does not load beside a CPU torch build ("operator torchvision::nms does not
   exist") and the matching CUDA build is 5 GB. We serve an import-only stand-in.
2. `sgl_kernel` (the CUDA/AMX kernel library) is imported by kernel modules at import time; its CPU
   build is not on PyPI and the CUDA build fails without `libcuda.so.1`. For a dense model none of its
   ops is called on CPU, so a stand-in whose every op raises `NotImplementedError` naming the op is
   enough, and says loudly when that assumption breaks.
   Both stand-ins are served by a finder appended to the *end* of `sys.meta_path`: it is consulted
   only when no real package was found, so on a machine with the real libraries it never acts.
   Because SGLang imports them before any plugin can run (and again in every spawned scheduler
   process), the finder is installed at interpreter start by `sglang_pic_cpu.pth`, which
   `sglang-pic setup-cpu` writes into a CPU environment's site-packages.
3. The CPU engine: SGLang's `is_cpu()` is driven by `SGLANG_USE_CPU_ENGINE=1`; without it RoPE falls
   through to a vLLM kernel. `cpu_server_defaults` picks the flags a CPU server needs
   (`--device cpu`, a CPU attention backend, a KV budget that fits the host).
4. HiCache's host pool assumes CUDA: `cudaHostRegister` for pinning
   (`sglang.srt.mem_cache.pool_host.common._cuda_host_register`), `pin_memory=True` allocations,
   `torch.cpu.Stream` without `synchronize`/`wait_stream`, and `transfer_kv_direct`, which is only
   imported from `sgl_kernel.kvcacheio` on CUDA/ROCm. The hooks below close these through
   SGLang's HookRegistry (rows of `sglang_pic.compat.platform`, which the plugin registers on the
   CPU engine), and `register_cpu_support` puts a pure-torch `transfer_kv_direct` and the stream
   methods in place, so HiCache L2/L3 run on CPU with `--hicache-io-backend direct
   --hicache-mem-layout layer_first`.
5. `--page-size` > 1: the paged allocator launches Triton kernels (`alloc_extend_kernel`,
   `alloc_decode_kernel`) that Triton 3.6's CPU interpreter cannot run or runs very slowly; torch
   versions replace them (for extend, SGLang's own `alloc_extend_naive`). Other Triton kernels run
   under `TRITON_INTERPRET=1`, which the CPU engine sets.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

from sglang_pic import environment

# ---------------------------------------------------------------------------------------------
# 1 + 2: import stand-ins for torchvision and sgl_kernel
# ---------------------------------------------------------------------------------------------

STUBBED_PACKAGES = ("torchvision", "sgl_kernel")


class _UnavailableMeta(type):
    """Attribute access on the placeholder class yields the placeholder (`InterpolationMode.X`)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Unavailable(metaclass=_UnavailableMeta):
    """Placeholder for any torchvision class/function: importable, fails when used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "torchvision is not installed in this CPU environment (sglang-pic stand-in)"
        )


def _torchvision_getattr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unavailable


def _sgl_kernel_getattr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing_op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available on this CPU-only install (sglang-pic stand-in); "
            "this model or setting needs a CUDA machine"
        )

    _missing_op.__name__ = name
    return _missing_op


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `torchvision[.*]` and top-level `sgl_kernel` when, and only when, nothing else can."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        top = fullname.split(".", 1)[0]
        if top not in STUBBED_PACKAGES:
            return None
        if top == "sgl_kernel" and fullname != top:
            # No `sgl_kernel.<sub>` modules: SGLang guards those imports with ImportError
            # fallbacks of its own (e.g. `sgl_kernel.scalar_type`), which are right on CPU.
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__sglang_pic_stand_in__ = True
        module.__version__ = "0.0.0+sglang-pic-stand-in"
        is_torchvision = spec.name.startswith("torchvision")
        module.__getattr__ = _torchvision_getattr if is_torchvision else _sgl_kernel_getattr
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_import_stand_ins() -> None:
    """Append the stand-in finder to `sys.meta_path` (idempotent, cheap: no imports)."""
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.append(_StandInFinder())


def is_stand_in(module: types.ModuleType) -> bool:
    return bool(getattr(module, "__sglang_pic_stand_in__", False))


PTH_NAME = "sglang_pic_cpu.pth"
PTH_LINE = "import sglang_pic.cpu.support as _m; _m.install_import_stand_ins()\n"


def write_pth(site_packages: str) -> str:
    """Write the start-up hook that installs the stand-ins in every process of an environment."""
    path = os.path.join(site_packages, PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path


# ---------------------------------------------------------------------------------------------
# 3: CPU engine and server defaults
# ---------------------------------------------------------------------------------------------


def has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def enable_cpu_engine() -> None:
    """Select SGLang's CPU engine for this process and the processes it spawns.

    Also sets `TRITON_INTERPRET=1`: any Triton kernel SGLang launches on its CPU path (beyond the
    paged allocator's, which `patch_paged_allocator` replaces) can only run in Triton's interpreter
    on a machine without a GPU ("0 active drivers" otherwise).
    """
    global _selected_before_import
    if _selected_before_import is None:
        _selected_before_import = ("sglang" not in sys.modules
                                   or environment.is_on("SGLANG_USE_CPU_ENGINE"))
    environment.default("SGLANG_USE_CPU_ENGINE", "1")
    environment.default("TRITON_INTERPRET", "1")
    install_import_stand_ins()


_selected_before_import: bool | None = None
"""Whether SGLang's modules saw the CPU engine when this process imported them (``sglang-pic
serve`` selects it first; SGLang's own launcher imports SGLang before plugins load). Their
import-time constants (``is_cpu()`` and the kernels chosen from it) are only right then, and only
then may its processes be forked from this one (``_fork_children``)."""


# KV budget when the model's config cannot be read here (e.g. a hub id): small but serviceable.
FALLBACK_KV_TOKENS = 16384


def _flag_given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def kv_budget_tokens(model_path: str, fraction: float = 0.10, cap: int = 65536) -> int:
    """A KV budget that fits this host: `fraction` of available RAM, at most `cap` tokens.

    Without an explicit budget SGLang sizes the KV pool from host memory (tens of millions of
    tokens, many seconds of allocation), which is never what a CPU user wants.
    """
    import json

    import psutil

    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    bytes_per_token = 2 * cfg["num_hidden_layers"] * heads * head_dim * 4  # K+V, fp32 worst case
    budget = int(psutil.virtual_memory().available * fraction) // bytes_per_token
    return max(1024, min(cap, budget))


def _config_dtype(model_path: str | None) -> str | None:
    """The checkpoint's dtype as its config.json names it (None when there is none)."""
    import json

    path = os.path.join(model_path, "config.json") if model_path else None
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    return config.get("dtype") or config.get("torch_dtype")


def cpu_server_defaults(argv: list[str], model_path: str | None) -> list[str]:
    """SGLang flags a CPU server needs, for each one the user did not give."""
    extra: list[str] = []
    if not _flag_given(argv, "--device"):
        extra += ["--device", "cpu"]
    if not _flag_given(argv, "--attention-backend"):
        extra += ["--attention-backend", "torch_native"]
    if not _flag_given(argv, "--max-total-tokens"):
        has_config = bool(model_path) and os.path.isfile(os.path.join(model_path, "config.json"))
        budget = kv_budget_tokens(model_path) if has_config else FALLBACK_KV_TOKENS
        extra += ["--max-total-tokens", str(budget)]
    if not _flag_given(argv, "--disable-cuda-graph"):
        extra += ["--disable-cuda-graph"]
    if not _flag_given(argv, "--dtype") and _config_dtype(model_path) == "float32":
        # SGLang casts a float32 checkpoint to float16 ("auto"), a GPU habit: CPUs without fp16
        # arithmetic emulate it, with results that depend on the processor (measured: greedy
        # tokens equal HF's bfloat16 ones on one machine, float32 ones on another). A float32
        # checkpoint is served in float32 on CPU, as HF transformers runs it.
        extra += ["--dtype", "float32"]
    if not _flag_given(argv, "--sleep-on-idle"):
        # SGLang's scheduler loop spins while idle (measured: 87 % of a core with no requests);
        # on a CPU machine that core is one the model needs. SGLang's own IdleSleeper then waits
        # on the scheduler's zmq sockets, so a request still wakes it at once.
        extra += ["--sleep-on-idle"]
    return extra


# ---------------------------------------------------------------------------------------------
# 4a: paged KV allocation (--page-size > 1) on CPU
# ---------------------------------------------------------------------------------------------


def alloc_extend_torch(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
    """`alloc_extend_kernel[(bs,)](...)` via SGLang's own torch version, `alloc_extend_naive`."""
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

    alloc_extend_naive(
        prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device
    )


def alloc_decode_torch(seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
    """`alloc_decode_kernel[(bs,)](...)` in torch: one slot per request for its next token.

    `seq_lens` already counts the new token. A request whose previous length filled its last page
    takes the next free page (in batch order: an exclusive prefix sum over the requests that need
    one), the others write at `last_loc + 1`.
    """
    import torch  # not at module level: this module is imported at every interpreter start

    needs_page = (seq_lens + page_size - 1) // page_size - (seq_lens - 1 + page_size - 1) // page_size
    start = torch.cumsum(needs_page, 0) - needs_page
    if len(free_pages):
        pages = free_pages[start.clamp(max=len(free_pages) - 1)]
    else:
        pages = torch.zeros_like(start)
    out_indices.copy_(torch.where(needs_page.bool(), pages * page_size, last_loc + 1))


class _TorchLaunch:
    """Makes a torch function launchable like a Triton kernel: `kernel[grid](*args)`."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def patch_paged_allocator() -> None:
    """Replace the paged allocator's Triton kernels (module attributes of
    `sglang.srt.mem_cache.allocator.paged`) with torch: Triton 3.6's CPU interpreter fails on
    `alloc_extend_kernel` ("only 0-dimensional arrays can be converted") and runs
    `alloc_decode_kernel` at a few steps per second."""
    import importlib

    paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
    paged.alloc_extend_kernel = _TorchLaunch(alloc_extend_torch)
    paged.alloc_decode_kernel = _TorchLaunch(alloc_decode_torch)


# ---------------------------------------------------------------------------------------------
# 4b: HiCache host pool on CPU
# ---------------------------------------------------------------------------------------------

# Modules whose HiCache transfer paths call `transfer_kv_direct` (imported from
# `sgl_kernel.kvcacheio` only under CUDA/ROCm, so the name is undefined on CPU).
_TRANSFER_KV_DIRECT_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.memory_pool_host",
)


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int) -> None:
    """Pure-torch `sgl_kernel.kvcacheio.transfer_kv_direct`: copy token rows layer by layer.

    `src_layers[i][src_indices]` -> `dst_layers[i][dst_indices]`; indices are token slots, so the
    page size only matters to the CUDA kernel's vectorisation, not to the result.
    """
    src_idx = src_indices.long().cpu()
    dst_idx = dst_indices.long().cpu()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_idx] = src[src_idx].to(dst.dtype)


def _no_host_register(buffer, *_args: Any, **_kwargs: Any) -> None:
    """Replaces `pool_host.common._cuda_host_register`/`_cuda_host_unregister`: no CUDA to pin
    for (0.5.23 passes a registration granularity too)."""
    return None


def _host_pool_without_pinning(result, self, *args, **kwargs) -> None:
    """AFTER `HostKVCache.__init__`: CPU torch cannot allocate `pin_memory=True` tensors."""
    self.pin_memory = False


def _patch_cpu_stream() -> None:
    """`torch.cpu.Stream` lacks `synchronize`/`query`, which HiCache's cache controller calls."""
    import torch

    for name in ("synchronize", "query"):
        if not hasattr(torch.cpu.Stream, name):
            setattr(torch.cpu.Stream, name, lambda self, *a, **k: True)


def _fork_children(result, server_args) -> None:
    """AFTER `engine._set_envs_and_config` (which sets multiprocessing's start method to "spawn",
    for CUDA): on CPU, SGLang's scheduler and detokenizer processes are forked, so they start
    with the modules (SGLang, torch, our plugin) this process has already imported instead of
    importing them again (a SmolLM2 server on 2 cores: 30-31 s to start against 46-48 s). Only
    where SGLang was imported knowing the CPU engine (``_selected_before_import``): a forked
    child keeps its parent's import-time choices, a spawned one makes them again), and only
    from a process with no other thread (an application running ``sgl.Engine`` in a thread
    pool, say, keeps spawn)."""
    import multiprocessing as mp
    import threading

    # a thread of this process holding a lock at the fork would leave the child that lock held
    if _selected_before_import and threading.active_count() == 1:
        mp.set_start_method("fork", force=True)


def register_cpu_support() -> None:
    """The ``cpu-support`` feature's set-up (the plugin, on the CPU engine): the names torch and
    SGLang lack on CPU, the paged allocator's kernels in torch, and Triton's interpreter fixes.
    Its hooks (HiCache host pool, process start, xgrammar) are rows of the seam table."""
    import importlib

    from sglang_pic_kernel._interpreter import (
        fix_interpreter_scalar_index,
        skip_nested_lang_patching,
    )

    fix_interpreter_scalar_index()  # Triton interpreter vs NumPy >= 2.4 (see that module)
    skip_nested_lang_patching()  # and its repeated patching of triton.language (same module)

    from sglang_pic.cpu import grammar as cpu_grammar

    cpu_grammar.register()  # constrained decoding (xgrammar) on CPU
    _patch_cpu_stream()
    patch_paged_allocator()
    # HookRegistry can only wrap names that exist; these modules never define the name on CPU.
    for name in _TRANSFER_KV_DIRECT_MODULES:
        module = importlib.import_module(name)
        if not hasattr(module, "transfer_kv_direct"):
            module.transfer_kv_direct = transfer_kv_direct
