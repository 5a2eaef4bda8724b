"""Rotating attention: attention kernels that apply RoPE to keys on read.

The KV pool stores keys un-rotated; these kernels rotate each key at its logical position (its
index in the request's KV sequence) in registers, so a cached page carries no position and can be
shared by requests that place the same span at different offsets (MiniPIC, section 2.1).
"""

from .decode import rotating_decode_attention_fwd
from .extend import (
    NEW_KEYS_IN_KERNEL,
    NEW_KEYS_PRE_ROTATED,
    rotating_extend_attention_fwd,
)
from .reference import reference_decode, reference_extend
from .rope import ROPE_FROM_CACHE, ROPE_IN_KERNEL, ROPE_STEP, RotaryTable, rotate_neox

__all__ = [
    "NEW_KEYS_IN_KERNEL",
    "NEW_KEYS_PRE_ROTATED",
    "ROPE_FROM_CACHE",
    "ROPE_IN_KERNEL",
    "ROPE_STEP",
    "RotaryTable",
    "reference_decode",
    "reference_extend",
    "rotate_neox",
    "rotating_decode_attention_fwd",
    "rotating_extend_attention_fwd",
]
