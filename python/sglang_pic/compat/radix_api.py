"""Calls into SGLang's radix tree whose shapes differ between releases.

- A match result: SGLang 0.5.17's ``MatchResult`` carries the matched KV indices
  (``device_indices``); 0.5.23's carries their count (``device_prefix_len``), the indices lying on
  the path to ``last_device_node`` (``path_device_indices``).
- An insert's parameters: 0.5.17's ``InsertParams`` has ``chunked``, 0.5.23's does not.
- Keeping a running request's KV between chunks: 0.5.17's ``cache_unfinished_req(req,
  chunked=True)``, 0.5.23's ``checkpoint_kv_cache(req, cache)`` (``checkpoint(req, up_to=)``).

Our code that calls SGLang's radix tree itself (the span cache and its planner and store tier,
the eviction replay, ``auto``'s shadow caches) goes through here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


def matched_tokens(result: Any) -> int:
    """How many tokens the match found on the device."""
    n = getattr(result, "device_prefix_len", None)  # 0.5.23
    return len(result.device_indices) if n is None else n


def matched_indices(cache: Any, result: Any) -> Any:
    """The matched tokens' KV indices (a 1-D int tensor)."""
    indices = getattr(result, "device_indices", None)  # 0.5.17
    return cache.path_device_indices(result.last_device_node) if indices is None else indices


def match_result(indices: Any, handle: Any) -> Any:
    """The release's ``MatchResult`` for a device match of ``indices`` ending at ``handle``
    (whose ``path_device_indices`` must give ``indices`` where the release reads them there)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult

    found = ({"device_indices": indices} if "device_indices" in MatchResult._fields
             else {"device_prefix_len": len(indices)})
    return MatchResult(**found, last_device_node=handle, last_host_node=handle,
                       best_match_node=handle)


@functools.cache
def _insert_fields() -> frozenset[str]:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    return frozenset(f.name for f in dataclasses.fields(InsertParams))


def insert_params(**fields: Any) -> Any:
    """The release's ``InsertParams`` from ``fields``, less those it does not have."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    known = _insert_fields()
    return InsertParams(**{k: v for k, v in fields.items() if k in known})


def keep_running_request(cache: Any, req: Any) -> None:
    """Put the KV a running (unfinished) request computed so far into the tree, as SGLang does
    between the chunks of a chunked prefill."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    if hasattr(RadixCache, "cache_unfinished_req"):  # 0.5.17 (our subclasses may keep theirs)
        cache.cache_unfinished_req(req, chunked=True)
        return
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    checkpoint_kv_cache(req, cache)
