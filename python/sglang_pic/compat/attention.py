"""Seams in SGLang's attention backends and the KV pool they write: our backends in its
registry, the private methods our subclasses override, and the pool API they call."""

from __future__ import annotations

from .seam import Seam

TITLE = "Attention backends and the KV pool"

_BACKENDS = "sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS"
_CHOICES = "sglang.srt.server_args.ATTENTION_BACKEND_CHOICES"
_TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
_FLASHINFER = "sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend"
_OURS = {  # backend name -> (factory, feature)
    "pic_flashinfer": ("sglang_pic.position_free.backends:create_pic_flashinfer",
                       "position-free-kv"),
    "pic_triton": ("sglang_pic.position_free.backends:create_pic_triton", "position-free-kv"),
    "pic_torch_native": ("sglang_pic.position_free.backends:create_pic_torch_native",
                         "position-free-kv"),
    "pariskv_triton": ("sglang_pic.sparse.backends:create_pariskv_triton", "sparse-decode"),
    "pariskv_flashinfer": ("sglang_pic.sparse.backends:create_pariskv_flashinfer",
                           "sparse-decode"),
    "pariskv_torch_native": ("sglang_pic.sparse.backends:create_pariskv_torch_native",
                             "sparse-decode"),
}
_SDPA_OVERRIDES = {  # our torch_native twin -> feature
    "sglang_pic.position_free.backends:PositionFreeTorchNativeBackend": "position-free-kv",
    "sglang_pic.sparse.backends:ParisKVTorchNativeBackend": "sparse-decode",
}


def kv_write_loc_takes_loc_first() -> bool:
    """``KVWriteLoc``'s first two fields are ``loc`` and ``swa_loc``: the only-sparse decode
    builds it positionally, as SGLang's own decode does."""
    import dataclasses

    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    return [f.name for f in dataclasses.fields(KVWriteLoc)][:2] == ["loc", "swa_loc"]


ROWS: tuple[Seam, ...] = (
    *(Seam(_BACKENDS, factory, "registry", feature, key=name,
           why="our attention backend in SGLang's registry")
      for name, (factory, feature) in _OURS.items()),
    *(Seam(_CHOICES, None, "registry", feature, key=name,
           why="an `--attention-backend` choice")
      for name, (_, feature) in _OURS.items()),
    Seam("sglang.srt.utils.common.support_triton", "sglang_pic.plugin:_support_triton",
         "AROUND", "cpu-twins",
         why="`pic_torch_native` and `pariskv_torch_native` answer like `torch_native` (False): "
             "SGLang decides by backend name whether its Triton bookkeeping kernels may run"),
    *(Seam(f"{_TORCH_NATIVE}.{method}", f"{ours}.{method}", "override", feature,
           why="the CPU twin attends through SGLang's SDPA loop with its own keys (turned, or "
               "the sparse selection)")
      for ours, feature in _SDPA_OVERRIDES.items()
      for method in ("_run_sdpa_forward_extend", "_run_sdpa_forward_decode")),
    Seam(f"{_FLASHINFER}._prepare_cuda_graph_metadata",
         "sglang_pic.sparse.backends:ParisKVFlashInferBackend._prepare_cuda_graph_metadata",
         "override", "sparse-decode",
         why="the graph-side metadata of the sparse part next to FlashInfer's"),
    Seam(f"{_FLASHINFER}._kv_write_scales",
         "sglang_pic.sparse.backends:ParisKVFlashInferBackend._save_decode_kv", "call",
         "sparse-decode",
         why="the only-sparse decode writes the new K/V as FlashInfer's decode does"),
    Seam("sglang.srt.mem_cache.memory_pool.KVWriteLoc",
         "sglang_pic.sparse.backends:ParisKVFlashInferBackend._save_decode_kv", "call",
         "sparse-decode", check="sglang_pic.compat.attention:kv_write_loc_takes_loc_first",
         why="where that K/V goes (`loc`, `swa_loc`)"),
    Seam("sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.free",
         "sglang_pic.sparse.offload:PoolSlotRelease", "instance-patch", "sparse-decode",
         "sparse_offload",
         why="the token allocator's `free`, wrapped on its one instance: slots of offloaded "
             "positions go back to the pool, the padding slot never"),
)
