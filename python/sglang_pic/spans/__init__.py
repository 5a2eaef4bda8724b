"""Span caching (MiniPIC section 2.2): SSEP / PDEP / page padding, span sub-request prefill, ISPS.

A prompt may be cut into pieces by markers (``<|ssep|>`` opens an independent span, ``<|pdep|>`` a
dependent segment; ``-1`` / ``-2`` in ``input_ids``; or the ``spans`` request field). An independent
span is computed as if it stood alone and cached under its own hash chain, so one physical copy of
its KV serves every request that contains it, at any offset, after any prefix (this needs the
position-free KV of ``sglang_pic.position_free``). What this changes in SGLang is the ``spans``
rows of the seam table (``sglang_pic.compat``; listed in docs/architecture.md): ``register()``
puts ``SpanRadixCache`` in SGLang's radix-cache registry (``pic_span``), the tokenizer manager's
hooks are in ``request``, and the scheduler's hooks below hand over to the planner (``planner``)
and the load inquirer (``load``).

``sglang-pic serve --enable-span-cache`` selects all of it; semantics and API: ``docs/spans.md``.

Importing this package loads only ``config``, ``segments`` and ``request`` (standard library
alone): the frontend DSL (``sglang_pic.lang``) imports them in client programs, where the planner
and the radix cache (SGLang's server code: seconds of import time and its platform warnings) are
not needed. ``register()`` and the scheduler hooks import those when they run.
"""

from __future__ import annotations

from typing import Any

from .config import BACKEND
from .request import PDEP_ID, SSEP_ID, spans_to_prompt
from .segments import SpanError

__all__ = ["BACKEND", "PDEP_ID", "SSEP_ID", "SpanError", "register", "spans_to_prompt"]

def register() -> None:
    """The ``spans`` feature's set-up: our cache in SGLang's radix-cache registry (its hooks are
    rows of ``sglang_pic.compat``, registered by the plugin)."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend

    from .factory import create_span_radix_cache

    register_radix_cache_backend(BACKEND, create_span_radix_cache)


def _planner(scheduler: Any) -> Any:
    return getattr(getattr(scheduler, "tree_cache", None), "planner", None)


def _on_generate_request(
    original: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any
) -> Any:
    planner = _planner(scheduler)
    if planner is None:
        return original(scheduler, recv_req, *args, **kwargs)
    return planner.on_generate_request(original, scheduler, recv_req)


def _on_add_to_queue(original: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    planner = _planner(scheduler)
    if planner is None:
        return original(scheduler, req, *args, **kwargs)
    return planner.on_add_to_queue(original, scheduler, req, *args, **kwargs)


def _on_new_prefill_batch(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    planner = _planner(scheduler)
    if planner is None or not planner.units:  # no sub-request in flight: nothing to look at
        return original(scheduler, *args, **kwargs)
    planner.release_launched_units(scheduler)
    deferred = planner.defer_units(scheduler)
    if deferred is not None:
        try:
            return original(scheduler, *args, **kwargs)
        finally:
            planner.restore_units(scheduler, deferred)
    budget = planner.unit_chunk_budget(scheduler)
    if budget is None:
        return original(scheduler, *args, **kwargs)
    size = scheduler.chunked_prefill_size
    scheduler.chunked_prefill_size = budget  # this batch only (read when it is formed)
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        scheduler.chunked_prefill_size = size


def _on_abort(result: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    planner = _planner(scheduler)
    if planner is not None:
        planner.on_abort(scheduler, recv_req)
    return result


def _hide_span_prefills(original: Any, streamer: Any, reqs: Any, *args: Any, **kwargs: Any) -> Any:
    """Drop span prefills (the planner's unit requests) from what SGLang streams to clients.

    SGLang streams every batch's requests after every step, decode steps included. Only a
    planner makes unit requests (clients may not use their rid prefix: ``request_validation``),
    so without a span cache, or before its planner submitted its first unit, nothing is looked
    at: a scan of the rids costs ~35-90 us a step at batch 256 on a 2-core machine, on the
    scheduler thread the overlap scheduler needs free for the next step."""
    planner = _planner(streamer)
    if planner is None or not getattr(planner, "units_submitted", 1):
        return original(streamer, reqs, *args, **kwargs)
    from .planner import is_unit

    if any(is_unit(r) for r in reqs):
        reqs = [r for r in reqs if not is_unit(r)]
        if not reqs:
            return None
    return original(streamer, reqs, *args, **kwargs)


def _cached_details(original: Any, streamer: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    planner = _planner(streamer)
    if planner is None or getattr(req, "pic_segments", None) is None:
        return original(streamer, req, *args, **kwargs)
    from .planner import cached_tokens_details

    return cached_tokens_details(req, with_storage=planner.cache.store is not None)


def _on_load_inquirer(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    planner = _planner(scheduler)
    if planner is not None:
        from .load import install_span_load

        install_span_load(scheduler, planner.waiting_load)
    return result
