"""Make Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``) work with NumPy >= 2.4, and stop it
re-patching ``triton.language`` on every helper call.

The interpreter holds every scalar as a 1-element array and implements ``tensor.__index__`` as
``int(handle.data)``; NumPy 2.4 made ``int()`` of a 1-d array an error, so any kernel whose loop
bounds are loaded from memory (``for n in range(start, end, BLOCK)``, as in every paged attention
kernel) dies with "only 0-dimensional arrays can be converted to Python scalars".

We wrap ``triton.runtime.interpreter._patch_lang_tensor`` (the function that installs those
dunder methods) and re-install ``__index__`` through the same restore-on-exit scope. This runs
only when the interpreter is on, and changes nothing on GPU.

The interpreter runs a launch with ``triton.language`` patched (``_patch_lang``: every builtin of
the language modules the kernel sees replaced, found by ``inspect.getmembers``) and restores it at
the end; but every call of a ``@triton.jit`` helper from the kernel (ours, such as
``rotate_pair``, and Triton's own ``tl.max``, ``tl.sum``, ``tl.cdiv``: once or more per key block
of every program) runs ``_patch_lang`` again, which is never restored. Once a launch patched a
helper's language modules (``tl`` for ours, ``tl.core`` for Triton's), a repeat finds no builtin
left and installs the same replacements again: measured, 45 % of an interpreted rotating-attention
request. ``skip_nested_lang_patching`` skips the repeats within a launch; the first patch of each
module set, calls outside a launch and every launch's own patch run as before.
"""

from __future__ import annotations

import os
import types

_applied = False
_nested_skip_applied = False


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


def fix_interpreter_scalar_index() -> None:
    global _applied
    if _applied or not _interpreter_on():
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor
    _applied = True


def skip_nested_lang_patching() -> None:
    global _nested_skip_applied
    if _nested_skip_applied or not _interpreter_on():
        return
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    launch = interpreter.GridExecutor.__call__
    running: list[frozenset[int] | None] = []  # per launch in progress: the modules it patched
    seen: dict[int, frozenset[int]] = {}

    def lang_modules(fn) -> frozenset[int]:
        # what _patch_lang patches for fn: the triton.language modules among its globals
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values()
                                  if isinstance(v, types.ModuleType) and (v is tl or v is tl.core))
        return seen[key]

    def _patch_lang(fn):
        modules = lang_modules(fn)
        if running and running[-1] is not None and modules <= running[-1]:
            return interpreter._LangPatchScope()  # patched in this launch: nothing to add
        scope = patch_lang(fn)
        if running:  # the launch's own patch, or a helper's (tl.max & co. see tl.core)
            running[-1] = modules | (running[-1] or frozenset())
        return scope

    def __call__(self, *args, **kwargs):
        running.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.pop()

    _patch_lang.__wrapped__ = patch_lang  # the interpreter's own, for tests
    __call__.__wrapped__ = launch
    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = __call__
    _nested_skip_applied = True
