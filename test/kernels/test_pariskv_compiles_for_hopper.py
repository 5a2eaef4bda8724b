"""The ParisKV kernels compile for the H200 (sm_90) on a machine without a GPU.

The Triton interpreter (how the other kernel tests run on CPU) executes a kernel as Python, so it
accepts code the compiler refuses - a variable whose type differs between the two sides of a
runtime branch, for one - and such a kernel would fail only on the device. Here each kernel is
compiled through Triton's whole pipeline (TTIR, TTGIR, LLVM, PTX, then ptxas to a cubin) for
``GPUTarget("cuda", 90, 32)`` with the argument types and compile-time constants of the
server's launches (Llama-3-8B's attention shape: 4 query heads per KV head, head dim 128). The
compiles run in a child process with ``TRITON_INTERPRET=0``: the test session binds the kernels
to the interpreter when they are first decorated (``conftest.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if __name__ == "__main__":  # the child: Triton's compiler, not the interpreter
    os.environ["TRITON_INTERPRET"] = "0"
import triton  # noqa: E402
from sglang_pic_kernel.pariskv import attention, select  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
_VOTE = {"Cent": "*i32", "Table": "*fp32", "Planes": "*i32", "Params": "*fp32", "NRet": "*i32"}
_VOTE_CONSTS = {"B": 32, "G": 4, "NB": 256, "P": 8, "BLOCK_N": 256, "SIMILARITY": True,
                "ASM": True}
_ATTN = {"Q": "*bf16", "RowOfSlot": "*i64", "KW": "*bf16", "VW": "*bf16", "WinLen": "*i32",
         "WinIdx": "*i64", "KH": "*bf16", "VH": "*bf16", "Sel": "*i32", "ReqToToken": "*i32",
         "PoolOfSlot": "*i64", "MidO": "*fp32", "MidL": "*fp32", "sm_scale": "fp32"}
_ATTN_CONSTS = {"G": 4, "D": 128, "CHUNK": 256, "BLOCK_T": 32, "BLOCK_H": 16, "Q_ROWS": True}

KERNELS = {
    "query": (select._query_kernel,
              {"Q": "*bf16", "RowOfSlot": "*i64", "Rt": "*fp32", "Tiers": "*fp32",
               "Table": "*fp32", "Qt": "*fp32", "Qnorm": "*fp32"},
              {"D": 128, "B": 32, "SIMILARITY": True, "Q_ROWS": True}),
    "plane": (select._plane_kernel,
              {"Qt": "*fp32", "Planes": "*i32", "Params": "*fp32", "Counts": "*i32",
               "NRet": "*i32", "Hist": "*i32"},
              {"G": 4, "D": 128, "B": 32, "NB": 256, "P": 8, "FLOOR_SD": 3.0}),
    "sampled_vote": (select._vote_kernel, {**_VOTE, "Bins": "*i32", "Hist": "*i32"},
                     {**_VOTE_CONSTS, "STRIDE": 16, "STORE_BINS": False}),
    "sampled_threshold": (select._sampled_threshold_kernel,
                          {"Hist": "*i32", "NRet": "*i32", "Thresh": "*i32", "Need": "*i32"},
                          {"NB": 256}),
    "vote_select": (select._vote_select_kernel,
                    {**_VOTE, "Thresh": "*i32", "Kept": "*i32", "CountA": "*i32",
                     "CountE": "*i32"}, _VOTE_CONSTS),
    "merge_candidates": (select._merge_kernel,
                         {"Kept": "*i32", "CountA": "*i32", "CountE": "*i32", "Cand": "*i32"},
                         {"NPROG": 256, "BLOCK": 256}),
    "rerank": (select._rerank_kernel,
               {"Cand": "*i32", "Need": "*i32", "Codes": "*u8", "W": "*fp16", "Qt": "*fp32",
                "Qnorm": "*fp32", "Levels": "*fp32", "Est": "*fp32"},
               {"B": 32, "G": 4, "BLOCK_C": 64}),
    "topk": (select._topk_kernel, {"Est": "*fp32", "Cand": "*i32", "Sel": "*i32"},
             {"CP": 4096, "KP": 128}),
    "attention_pool": (attention._partial_kernel, _ATTN, {**_ATTN_CONSTS, "POOL": True}),
    "attention_host": (attention._partial_kernel, _ATTN, {**_ATTN_CONSTS, "POOL": False}),
    "attention_merge": (attention._merge_kernel,
                        {"MidO": "*fp32", "MidL": "*fp32", "RowOfSlot": "*i64", "Out": "*bf16"},
                        {"SPLITS": 4, "SPLITS_P": 4, "D": 128, "Q_ROWS": True}),
}
# the variants the kernel benchmark's layer (``kv_layout.ParisKVLayer``) launches: one query
# row per sequence, no row table
for _name in ("query", "attention_host", "attention_merge"):
    _fn, _pointers, _consts = KERNELS[_name]
    KERNELS[f"{_name}_own_rows"] = (_fn, _pointers, {**_consts, "Q_ROWS": False})


def compile_for_hopper(name: str) -> str:
    """'' when kernel ``name`` compiles to an sm_90 cubin, else the compiler's message."""
    fn, pointers, consts = KERNELS[name]
    names = fn.arg_names
    unknown = (set(pointers) | set(consts)) - set(names)
    if unknown:
        return f"the table names arguments the kernel lacks: {sorted(unknown)}"
    # every argument not listed is an integer (sizes, strides, counts)
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    try:
        compiled = triton.compile(src, target=HOPPER)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "" if compiled.asm.get("cubin") else "no cubin (ptxas did not run)"


@pytest.fixture(scope="module")
def compile_errors() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    child = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                           timeout=300, cwd=Path(__file__).parent)
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_to_a_hopper_cubin(name, compile_errors):
    assert compile_errors[name] == ""


if __name__ == "__main__":
    print(json.dumps({name: compile_for_hopper(name) for name in KERNELS}))
