"""Seams of SGLang's CPU engine: where SGLang 0.5.17 assumes CUDA (or an accelerator) on paths
the CPU engine takes. All of them are registered on the CPU engine only."""

from __future__ import annotations

from .seam import Seam

TITLE = "CPU platform"

_HOST_POOL = "sglang.srt.mem_cache.pool_host"
_GRAMMAR = "sglang.srt.constrained.xgrammar_backend"
_PAGED = "sglang.srt.mem_cache.allocator.paged"
_INTERPRETER = "triton.runtime.interpreter"
_CPU = "sglang_pic.cpu.support"

ROWS: tuple[Seam, ...] = (
    Seam("sys.meta_path", f"{_CPU}:install_import_stand_ins", "instance-patch", "cpu-support",
         "cpu",
         why="stand-ins for `torchvision` and `sgl_kernel`, which SGLang imports before plugins "
             "load: a finder at the end of the path, installed at interpreter start by "
             "`sglang_pic_cpu.pth` (`sglang-pic setup-cpu`) and again when the plugin selects "
             "the CPU engine"),
    Seam(f"{_HOST_POOL}.common._cuda_host_register", f"{_CPU}:_no_host_register", "REPLACE",
         "cpu-support", "cpu", why="HiCache's host pool: no CUDA to pin memory for"),
    Seam(f"{_HOST_POOL}.common._cuda_host_unregister", f"{_CPU}:_no_host_register", "REPLACE",
         "cpu-support", "cpu", why="likewise"),
    Seam(f"{_HOST_POOL}.base.HostKVCache.__init__", f"{_CPU}:_host_pool_without_pinning",
         "AFTER", "cpu-support", "cpu",
         why="CPU torch cannot allocate `pin_memory=True` tensors"),
    Seam("sglang.srt.entrypoints.engine._set_envs_and_config", f"{_CPU}:_fork_children", "AFTER",
         "cpu-support", "cpu",
         why="the scheduler and detokenizer processes are forked, not spawned: they start with "
             "what is already imported"),
    Seam(f"{_GRAMMAR}._allocate_token_bitmask", "sglang_pic.cpu.grammar:allocate_token_bitmask",
         "REPLACE", "cpu-support", "cpu",
         why="constrained decoding on CPU: the token bitmask without pinned memory"),
    Seam(f"{_GRAMMAR}.XGrammarGrammar.apply_vocab_mask", "sglang_pic.cpu.grammar:apply_vocab_mask",
         "AROUND", "cpu-support", "cpu", why="xgrammar's CPU kernel applies the mask"),
    Seam("torch.cpu.Stream.synchronize", f"{_CPU}:_patch_cpu_stream", "instance-patch",
         "cpu-support", "cpu",
         why="HiCache's cache controller calls it; CPU torch lacks it (the HookRegistry only "
             "wraps names that exist)"),
    Seam("torch.cpu.Stream.query", f"{_CPU}:_patch_cpu_stream", "instance-patch", "cpu-support",
         "cpu", why="likewise"),
    Seam(f"{_PAGED}.alloc_extend_kernel", f"{_CPU}:alloc_extend_torch", "instance-patch",
         "cpu-support", "cpu",
         why="the paged allocator's Triton kernel, in torch (Triton's CPU interpreter fails on "
             "it)"),
    Seam(f"{_PAGED}.alloc_decode_kernel", f"{_CPU}:alloc_decode_torch", "instance-patch",
         "cpu-support", "cpu", why="likewise (the interpreter runs it at a few steps a second)"),
    Seam(f"{_PAGED}.alloc_extend_naive", f"{_CPU}:alloc_extend_torch", "call", "cpu-support",
         "cpu", why="SGLang's own torch version of the extend allocation"),
    Seam(f"{_HOST_POOL}.mha.transfer_kv_direct", f"{_CPU}:transfer_kv_direct", "instance-patch",
         "cpu-support", "cpu",
         why="HiCache's transfer path imports it from `sgl_kernel` under CUDA only: a torch "
             "version where the module lacks it"),
    Seam("sglang.srt.mem_cache.memory_pool_host.transfer_kv_direct", f"{_CPU}:transfer_kv_direct",
         "instance-patch", "cpu-support", "cpu", why="likewise"),
    Seam(f"{_INTERPRETER}._patch_lang_tensor",
         "sglang_pic_kernel._interpreter:fix_interpreter_scalar_index", "instance-patch",
         "cpu-support", "cpu",
         why="Triton's interpreter and NumPy >= 2.4: scalar indexing (Triton, not SGLang)"),
    Seam(f"{_INTERPRETER}._patch_lang", "sglang_pic_kernel._interpreter:skip_nested_lang_patching",
         "instance-patch", "cpu-support", "cpu",
         why="the interpreter re-patches `triton.language` on every helper call"),
    Seam(f"{_INTERPRETER}.GridExecutor.__call__",
         "sglang_pic_kernel._interpreter:skip_nested_lang_patching", "instance-patch",
         "cpu-support", "cpu", why="likewise"),
)
