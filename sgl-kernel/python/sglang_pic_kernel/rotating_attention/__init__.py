"""Rotating attention: attention kernels for position-free KV in the shifted layout.

Keys are rotated by the model, as in vanilla SGLang, and stored rotated at the position they
were computed at; the pool records that position per slot (``stored_positions``). The kernels
turn each key by the distance between its index in the request's KV sequence and that position,
in registers, so one physical copy of a span's pages serves it at any offset (MiniPIC, section
2.1). Keys that did not move are read exactly as vanilla's kernels read them.
"""

from .decode import rotating_decode_attention_fwd
from .extend import rotating_extend_attention_fwd
from .reference import reference_decode, reference_extend
from .rope import RotaryTable, rotate_neox
from .turn_copy import LayerBuffers, turn_copy_kv

__all__ = [
    "LayerBuffers",
    "RotaryTable",
    "reference_decode",
    "reference_extend",
    "rotate_neox",
    "rotating_decode_attention_fwd",
    "rotating_extend_attention_fwd",
    "turn_copy_kv",
]
