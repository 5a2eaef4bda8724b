"""Make Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``) work with NumPy >= 2.4.

The interpreter holds every scalar as a 1-element array and implements ``tensor.__index__`` as
``int(handle.data)``; NumPy 2.4 made ``int()`` of a 1-d array an error, so any kernel whose loop
bounds are loaded from memory (``for n in range(start, end, BLOCK)``, as in every paged attention
kernel) dies with "only 0-dimensional arrays can be converted to Python scalars".

We wrap ``triton.runtime.interpreter._patch_lang_tensor`` (the function that installs those
dunder methods) and re-install ``__index__`` through the same restore-on-exit scope. This runs
only when the interpreter is on, and changes nothing on GPU.
"""

from __future__ import annotations

import os

_applied = False


def fix_interpreter_scalar_index() -> None:
    global _applied
    if _applied or os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor
    _applied = True
