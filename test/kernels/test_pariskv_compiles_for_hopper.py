"""The ParisKV kernels compile for the H200 (sm_90) on a machine without a GPU.

The Triton interpreter (how the other kernel tests run on CPU) executes a kernel as Python, so it
accepts code the compiler refuses - a variable whose type differs between the two sides of a
runtime branch, for one - and such a kernel would fail only on the device. Here each kernel is
compiled through Triton's whole pipeline (TTIR, TTGIR, LLVM, PTX, then ptxas to a cubin) for
``GPUTarget("cuda", 90, 32)`` with the argument types and compile-time constants of the
server's launches (``sglang_pic_kernel.pariskv.hopper_build.LAUNCHES``). The compiles run in a
child process with ``TRITON_INTERPRET=0``: the test session binds the kernels to the interpreter
when they are first decorated (``conftest.py``).
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
    from sglang_pic_kernel.pariskv.hopper_build import LAUNCHES, compile_for_hopper

    def compile_error(name: str) -> str:
        """'' when kernel ``name`` compiles to an sm_90 cubin, else the compiler's message."""
        try:
            compiled = compile_for_hopper(name)
        except Exception as e:  # the message is the result
            return f"{type(e).__name__}: {e}"
        return "" if compiled.asm.get("cubin") else "no cubin (ptxas did not run)"

    print(json.dumps({name: compile_error(name) for name in LAUNCHES}))
    sys.exit(0)

# the table's names, read without importing the kernels into this (interpreter) process
NAMES = ("encode", "encode_rotated", "query", "plane", "sampled_vote", "vote_select",
         "merge_candidates", "gather_rerank", "rerank", "topk", "topk_t4", "topk_keep",
         "merge_candidates_reuse", "rerank_reuse", "topk_reuse",
         "attention_pool",
         "attention_host", "attention_merge", "query_own_rows", "attention_host_own_rows",
         "attention_merge_own_rows")


@pytest.fixture(scope="module")
def compile_errors() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    child = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                           timeout=300, cwd=Path(__file__).parent)
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_every_launch_of_the_table_is_checked(compile_errors):
    assert sorted(compile_errors) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_kernel_compiles_to_a_hopper_cubin(name, compile_errors):
    assert compile_errors[name] == ""
