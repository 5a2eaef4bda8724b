"""Span caching (MiniPIC section 2.2): SSEP / PDEP / page padding, span sub-request prefill, ISPS.

A prompt may be cut into pieces by markers (``<|ssep|>`` opens an independent span, ``<|pdep|>`` a
dependent segment; ``-1`` / ``-2`` in ``input_ids``; or the ``spans`` request field). An independent
span is computed as if it stood alone and cached under its own hash chain, so one physical copy of
its KV serves every request that contains it, at any offset, after any prefix (this needs the
position-free KV of ``sglang_pic.position_free``). What this changes in SGLang, all registered by
``register()``:

| where (process)   | SGLang seam                                                    | module         |
|-------------------|----------------------------------------------------------------|----------------|
| tokenizer         | AFTER ``TokenizerManager.init_tokenizer_and_processor``: markers become special tokens | ``request`` |
| tokenizer         | BEFORE ``TokenizerManager.generate_request``: markers -> padded ids + layout (400 on bad input) | ``request`` |
| scheduler         | ``register_radix_cache_backend("pic_span")``: segmented matching and insertion | ``radix_cache`` |
| scheduler         | AROUND ``Scheduler.handle_generate_request`` / ``_add_request_to_queue``: span sub-requests, holding | ``planner`` |
| scheduler         | AROUND ``Scheduler.get_new_batch_prefill``: requests whose sub-requests the last batch completed join this batch; span prefills alone that overshoot the chunk budget by at most 1/8 go in one pass | ``planner`` |
| scheduler         | AFTER ``Scheduler.abort_request``: release what aborted requests held, cancel unneeded sub-requests | ``planner`` |
| scheduler         | AROUND ``SchedulerOutputStreamer.stream_output``: internal span prefills are not streamed | here |
| scheduler         | AROUND ``SchedulerOutputStreamer.get_cached_tokens_details``: the split of ``cached_tokens`` | ``planner`` |
| scheduler         | AFTER ``Scheduler.init_load_inquirer``: held requests in ``/v1/loads`` | ``load`` |

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

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
_TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"


def register() -> None:
    from sglang.srt.mem_cache.registry import register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import request
    from .factory import create_span_radix_cache

    register_radix_cache_backend(BACKEND, create_span_radix_cache)
    hooks = [
        (
            f"{_TOKENIZER_MANAGER}.init_tokenizer_and_processor",
            request.install_resolver,
            HookType.AFTER,
        ),
        (
            f"{_TOKENIZER_MANAGER}.generate_request",
            request.resolve_generate_request,
            HookType.BEFORE,
        ),
        (f"{_SCHEDULER}.handle_generate_request", _on_generate_request, HookType.AROUND),
        (f"{_SCHEDULER}._add_request_to_queue", _on_add_to_queue, HookType.AROUND),
        (f"{_SCHEDULER}.get_new_batch_prefill", _on_new_prefill_batch, HookType.AROUND),
        (f"{_SCHEDULER}.abort_request", _on_abort, HookType.AFTER),
        (f"{_STREAMER}.stream_output", _hide_span_prefills, HookType.AROUND),
        (f"{_STREAMER}.get_cached_tokens_details", _cached_details, HookType.AROUND),
        (f"{_SCHEDULER}.init_load_inquirer", _on_load_inquirer, HookType.AFTER),
    ]
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, kind)


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
