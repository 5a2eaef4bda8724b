"""sglang-pic's GPU kernels, written in Triton (no compiled extension, nothing to build).

This package mirrors SGLang's `sgl-kernel`: kernels live here, the code that wires them into
SGLang lives in `sglang_pic`. Kernels run on CPU tensors under `TRITON_INTERPRET=1` (tiny shapes,
for tests) and natively on CUDA. Planned contents, one module per kernel family:
`rotating_attention` (position-free KV: RoPE applied to keys on read) and, later, `pariskv`
(sparse long-context decoding).
"""

from ._interpreter import fix_interpreter_scalar_index, skip_nested_lang_patching

__version__ = "0.1.0"

fix_interpreter_scalar_index()
skip_nested_lang_patching()
