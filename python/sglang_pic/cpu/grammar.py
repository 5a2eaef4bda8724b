"""Constrained decoding (regex, JSON schema, EBNF, structural tags) on SGLang's CPU engine.

SGLang 0.5.17's xgrammar backend assumes an accelerator in two places, and each takes the whole
server down on CPU (the scheduler process dies, every request after it fails):

* ``xgrammar_backend._allocate_token_bitmask`` allocates the token bitmask with
  ``pin_memory=True``; CPU-only torch has no pinned-memory allocator and raises;
* ``XGrammarGrammar.apply_vocab_mask`` knows CUDA/XPU/MUSA/NPU logits only and raises otherwise.

xgrammar itself ships a CPU kernel (``xgrammar.apply_token_bitmask_inplace`` dispatches on the
tensors' device), so the two hooks below are all it takes (rows of the seam table,
``sglang_pic.compat.platform``, registered by the plugin on the CPU engine with the other CPU
seams). Until ``register`` has run in the server process, ``request_validation`` refuses
constrained requests on CPU with a 400 instead of letting them crash the scheduler.
"""

from __future__ import annotations

from typing import Any

_registered = False


def cpu_grammar_registered() -> bool:
    """Whether this process registered the CPU grammar hooks (set before SGLang applies hooks)."""
    return _registered


def allocate_token_bitmask(vocab_size: int, batch_size: int) -> Any:
    """REPLACE for ``xgrammar_backend._allocate_token_bitmask``: pinned only where CUDA exists.

    Pinning serves the non-blocking host-to-device copy of the mask; on CPU the mask never leaves
    host memory, so an ordinary tensor is the same thing.
    """
    import torch
    from xgrammar import bitmask_dtype, get_bitmask_shape

    return torch.full(
        get_bitmask_shape(batch_size, vocab_size),
        -1,
        dtype=bitmask_dtype,
        pin_memory=torch.cuda.is_available(),
    )


def apply_vocab_mask(original: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND ``XGrammarGrammar.apply_vocab_mask(self, logits, vocab_mask)``: CPU logits go to
    xgrammar's CPU kernel; every other device keeps SGLang's path."""
    names = ("self", "logits", "vocab_mask")
    bound = dict(zip(names, args, strict=False)) | kwargs
    logits, mask = bound.get("logits"), bound.get("vocab_mask")
    if getattr(getattr(logits, "device", None), "type", None) != "cpu":
        return original(*args, **kwargs)
    from xgrammar import apply_token_bitmask_inplace

    apply_token_bitmask_inplace(logits, mask.to(logits.device))
    return None


def register() -> None:
    """Mark this process as serving constrained requests on CPU; called by the CPU set-up
    (``cpu_support.register_cpu_support``), right before the plugin registers the two hooks
    (a failure there stops the process)."""
    global _registered
    _registered = True
