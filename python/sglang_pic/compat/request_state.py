"""A request's KV bookkeeping on SGLang's ``Req``, wherever the installed release keeps it.

Our features read and write two of a request's fields: its ``req_to_token`` row
(``req_pool_idx``) and how much of its sequence the prefix cache owns (``cache_protected_len``).
SGLang 0.5.17 keeps them on the ``Req`` itself; 0.5.23 moved them into ``req.kv`` (a
``ReqKvInfo``). Assigning the old name on a newer ``Req`` would not fail, it would add a stray
attribute SGLang never reads, so every read and write goes through here instead of
``req.<field>``. Adding a release that moves them again is an edit of ``_holder`` alone.

They also read how long the request's matched prefix is (``matched_len``): 0.5.17 keeps the
matched indices (``prefix_indices``), 0.5.23 their count (``prefix_len``); and where its current
extend ends (``extend_end``): 0.5.17's ``extend_range``, 0.5.23's ``extend_end``.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def _kv_info_on_req() -> bool:
    """Whether the installed SGLang keeps the fields in ``req.kv``: its ``ReqKvInfo`` declares
    ``req_pool_idx`` (0.5.23; 0.5.17 has a ``ReqKvInfo`` too, with other fields)."""
    import dataclasses

    from sglang.srt.managers import schedule_batch

    info = getattr(schedule_batch, "ReqKvInfo", None)
    return info is not None and dataclasses.is_dataclass(info) and "req_pool_idx" in {
        f.name for f in dataclasses.fields(info)}


def _holder(req: Any) -> Any:
    """The object holding ``req``'s KV fields: ``req.kv`` where the release has it (and a
    stand-in request in a test carries one), else ``req``."""
    kv = getattr(req, "kv", None) if _kv_info_on_req() else None
    return req if kv is None else kv


def pool_row(req: Any) -> int | None:
    """``req``'s row of ``req_to_token`` (None: it holds none)."""
    return _holder(req).req_pool_idx


def protected_len(req: Any) -> int:
    """The tokens at the head of ``req``'s sequence the prefix cache owns."""
    return _holder(req).cache_protected_len


def set_protected_len(req: Any, n: int) -> None:
    _holder(req).cache_protected_len = n


def matched_len(req: Any) -> int:
    """How many tokens of ``req``'s sequence its prefix match found in the cache."""
    indices = getattr(req, "prefix_indices", None)  # 0.5.17
    return len(indices) if indices is not None else req.prefix_len


def extend_end(req: Any) -> int | None:
    """Where ``req``'s current extend ends in its sequence (None: none scheduled): 0.5.17's
    ``extend_range.end``, 0.5.23's ``extend_end``."""
    if hasattr(req, "extend_end"):  # 0.5.23
        return req.extend_end
    extend = req.extend_range
    return None if extend is None else extend.end
