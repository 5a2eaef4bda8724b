"""The ParisKV kernels built for the H200 (sm_90) on a machine without a GPU.

Triton compiles a kernel from its argument types and compile-time constants alone: with
``GPUTarget("cuda", 90, 32)`` its whole pipeline (TTIR, TTGIR, LLVM, PTX, then the ptxas Triton
ships to a cubin) runs on a CPU machine. ``LAUNCHES`` lists each kernel as the server launches
it (Llama-3-8B's attention shape: 4 query heads per KV head, head dim 128; 4096 candidates; 256
histogram bins), which serves two uses:

- ``test/kernels/test_pariskv_compiles_for_hopper.py``: every kernel compiles (the interpreter,
  which runs the kernel tests on CPU, accepts code the compiler refuses);
- ``benchmark/kernels/pariskv_resources.py``: registers, spills and shared memory per kernel
  (``ptxas -v``), the first thing to read when a kernel is slow on the device.

The kernels must be Triton JIT functions, not the interpreter's: import this module in a process
started with ``TRITON_INTERPRET=0`` (the test session sets 1 on CPU machines).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import attention, encode, select

HOPPER = GPUTarget("cuda", 90, 32)

_VOTE = {"Cent": "*i32", "Table": "*fp32", "Planes": "*i32", "Params": "*fp32", "NRet": "*i32"}
_VOTE_CONSTS = {"B": 32, "G": 4, "NB": 256, "P": select.PLANES, "BLOCK_N": 256,
                "SIMILARITY": True, "ASM": True}
_ATTN = {"Q": "*bf16", "RowOfSlot": "*i64", "KW": "*bf16", "VW": "*bf16", "WinLen": "*i32",
         "WinIdx": "*i64", "KH": "*bf16", "VH": "*bf16", "Sel": "*i32", "ReqToToken": "*i32",
         "PoolOfSlot": "*i64", "MidO": "*fp32", "MidL": "*fp32", "sm_scale": "fp32"}
_ATTN_CONSTS = {"G": 4, "D": 128, "CHUNK": 256, "SEL_CHUNK": 32, "BLOCK_T": 32, "BLOCK_H": 16,
                "Q_ROWS": True}

_TOPK = {"Est": "*fp32", "Cand": "*i32", "Sel": "*i32", "NRet": "*i32", "NSel": "*i32",
         "Last": "*i32", "Shift": "*i32"}
_RERANK = {"Cand": "*i32", "Need": "*i32", "Codes": "*u8", "W": "*fp16", "Qt": "*fp32",
           "Qnorm": "*fp32", "SignedLevels": "*fp32", "Est": "*fp32", "NKeys": "*i32",
           "NSel": "*i32", "Shift": "*i32"}

LAUNCHES: dict[str, tuple] = {
    "encode": (encode._encode_kernel,
               {"K": "*bf16", "Rt": "*fp32", "Edges": "*fp32", "Levels": "*fp32", "Cent": "*i32",
                "Codes": "*u8", "W": "*fp16", "Counts": "*i32"},
               {"D": 128, "B": 32, "BLOCK_N": 32, "BLOCK_K": encode.ENCODE_BLOCK_K,
                "COUNT": True, "ROTATED": False}),
    # a region's keys, rotated by cuBLAS first (``encode.PREROTATE_FROM``)
    "encode_rotated": (encode._encode_kernel,
                       {"K": "*fp32", "Rt": "*fp32", "Edges": "*fp32", "Levels": "*fp32",
                        "Cent": "*i32", "Codes": "*u8", "W": "*fp16", "Counts": "*i32"},
                       {"D": 128, "B": 32, "BLOCK_N": 32, "BLOCK_K": encode.ENCODE_BLOCK_K,
                        "COUNT": True, "ROTATED": True}),
    "query": (select._query_kernel,
              {"Q": "*bf16", "RowOfSlot": "*i64", "NSel": "*i32", "RtJ": "*fp32",
               "Tiers": "*fp32", "Table": "*fp32", "Qt": "*fp32", "Qnorm": "*fp32"},
              {"D": 128, "B": 32, "SIMILARITY": True, "Q_ROWS": True}),
    "plane": (select._plane_kernel,
              {"Qt": "*fp32", "Planes": "*i32", "Params": "*fp32", "Counts": "*i32",
               "NRet": "*i32", "Hist": "*i32"},
              {"G": 4, "D": 128, "B": 32, "NB": 256, "P": select.PLANES,
               "FLOOR_SD": select.VOTE_FLOOR_SD}),
    "sampled_vote": (select._vote_kernel, {**_VOTE, "Bins": "*i32", "Hist": "*i32"},
                     {**_VOTE_CONSTS, "STRIDE": 16, "STORE_BINS": False}),
    "vote_select": (select._vote_select_kernel,
                    {**_VOTE, "Hist": "*i32", "Thresh": "*i32", "Need": "*i32", "Kept": "*i32",
                     "CountA": "*i32", "CountE": "*i32"}, _VOTE_CONSTS),
    "merge_candidates": (select._merge_kernel,
                         {"Kept": "*i32", "CountA": "*i32", "CountE": "*i32", "Cand": "*i32",
                          "NRet": "*i32"},
                         {"NPROG": 256, "BLOCK": 256, "REUSE": False}),
    # the rerank placing the vote programs' kept keys itself (``GATHER_IN_RERANK``)
    "gather_rerank": (select._gather_rerank_kernel,
                      {"Kept": "*i32", "CountA": "*i32", "CountE": "*i32", "Cand": "*i32",
                       "Est": "*fp32", "NRet": "*i32", "Codes": "*u8", "W": "*fp16",
                       "Qt": "*fp32", "Qnorm": "*fp32", "SignedLevels": "*fp32"},
                      {"B": 32, "G": 4, "NPROG": 256, "STEPS": 9, "BLOCK_C": 64}),
    "rerank": (select._rerank_kernel,
               _RERANK, {"B": 32, "G": 4, "BLOCK_C": 64, "REUSE": False}),
    "topk": (select._topk_kernel, _TOPK, {"CP": 4096, "KP": 128, "T": 1, "REUSE": False}),
    "topk_t4": (select._topk_kernel, _TOPK,  # bench_topk.py's alternative search
                {"CP": 4096, "KP": 128, "T": 4, "REUSE": False}),
    # --sparse-reselect-interval > 1: the layer's selection kept, moved on between selections
    "topk_keep": (select._topk_kernel, _TOPK,
                  {"CP": 4096, "KP": 128, "T": 1, "KEEP": True, "REUSE": False}),
    # --sparse-vote-interval > 1: the layer's kept vote, reranked moved on between votes
    "merge_candidates_reuse": (select._merge_kernel,
                               {"Kept": "*i32", "CountA": "*i32", "CountE": "*i32",
                                "Cand": "*i32", "NRet": "*i32"},
                               {"NPROG": 256, "BLOCK": 256, "REUSE": True}),
    "rerank_reuse": (select._rerank_kernel, _RERANK,
                     {"B": 32, "G": 4, "BLOCK_C": 64, "REUSE": True}),
    "topk_reuse": (select._topk_kernel, _TOPK, {"CP": 4096, "KP": 128, "T": 1, "REUSE": True}),
    "attention_pool": (attention._partial_kernel, _ATTN, {**_ATTN_CONSTS, "POOL": True}),
    "attention_host": (attention._partial_kernel, _ATTN, {**_ATTN_CONSTS, "POOL": False}),
    "attention_merge": (attention._merge_kernel,
                        {"MidO": "*fp32", "MidL": "*fp32", "RowOfSlot": "*i64", "Out": "*bf16"},
                        {"SPLITS": 7, "SPLITS_P": 8, "D": 128, "Q_ROWS": True}),
}
# the variants the kernel benchmark's layer (``kv_layout.ParisKVLayer``) launches: one query
# row per sequence, no row table
for _name in ("query", "attention_host", "attention_merge"):
    _fn, _pointers, _consts = LAUNCHES[_name]
    LAUNCHES[f"{_name}_own_rows"] = (_fn, _pointers, {**_consts, "Q_ROWS": False})


# warps the server launches a kernel with, where it is not Triton's default of 4
SERVER_WARPS = {name: select.topk_warps(LAUNCHES[name][2]["CP"])
                for name in ("topk", "topk_t4", "topk_keep", "topk_reuse")}


def compile_for_hopper(name: str, num_warps: int | None = None):
    """Kernel ``name`` of ``LAUNCHES`` compiled for sm_90 (a ``CompiledKernel``: ``asm`` holds
    its TTIR ... PTX and cubin) at ``num_warps`` (default: the server's, ``SERVER_WARPS`` or
    4). Every argument the table does not type is an int32 (sizes, strides, counts). Raises what
    the compiler raises."""
    if num_warps is None:
        num_warps = SERVER_WARPS.get(name, 4)
    fn, pointers, consts = LAUNCHES[name]
    names = fn.arg_names
    unknown = (set(pointers) | set(consts)) - set(names)
    if unknown:
        raise KeyError(f"{name}: the table names arguments the kernel lacks: {sorted(unknown)}")
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=HOPPER, options={"num_warps": num_warps})


def ptxas_resources(compiled) -> dict:
    """Registers per thread, spill bytes, stack frame and shared memory of a compiled kernel,
    from ``ptxas -v`` (the ptxas Triton ships) on its PTX."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        m = re.search(pattern, out)
        return int(m.group(1)) if m else 0

    return {"registers": number(r"Used (\d+) registers"),
            "spill_stores_bytes": number(r"(\d+) bytes spill stores"),
            "spill_loads_bytes": number(r"(\d+) bytes spill loads"),
            "stack_frame_bytes": number(r"(\d+) bytes stack frame"),
            "shared_bytes": int(compiled.metadata.shared),
            "num_warps": int(compiled.metadata.num_warps)}
