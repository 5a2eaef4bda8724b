"""What a prefix match found, wherever the installed release puts it in ``MatchResult``.

SGLang 0.5.17's ``MatchResult`` carries the matched KV indices (``device_indices``); 0.5.23's
carries their count (``device_prefix_len``), the indices lying on the path to
``last_device_node`` (``path_device_indices``). Our code that matches SGLang's ``RadixCache``
itself (the eviction replay and ``auto``'s shadow caches) reads a match through here.
"""

from __future__ import annotations

from typing import Any


def matched_tokens(result: Any) -> int:
    """How many tokens the match found on the device."""
    n = getattr(result, "device_prefix_len", None)  # 0.5.23
    return len(result.device_indices) if n is None else n


def matched_indices(cache: Any, result: Any) -> Any:
    """The matched tokens' KV indices (a 1-D int tensor)."""
    indices = getattr(result, "device_indices", None)  # 0.5.17
    return cache.path_device_indices(result.last_device_node) if indices is None else indices
