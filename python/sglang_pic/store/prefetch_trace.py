"""With ``--ptstore-trace``: stderr lines when SGLang's scheduler takes a finished prefetch,
and when it forms a prefill batch.

The backend's trace (``hicache_backend._traced``) says when a load from the storage tier ended;
the benchmark knows when the first token came. Between the two, SGLang's scheduler must notice
that the prefetch finished (``HiRadixCache.check_prefetch_progress``, asked for each waiting
request on each scheduler pass), insert the loaded pages into the radix tree, copy them to the
GPU and run the prompt's uncached tail. This line splits that time in two: the wait until the
scheduler took the pages (``[ptstore-trace] prefetch_done at <wall clock>: <tokens> tokens``),
and the rest (``benchmark/store/bench_store_ttft.py``'s ``phases_<n>``).

A request whose prefix the store lacks waits for the lookup, then prefills it all: the cost of a
cold miss over plain recompute lies in that wait and in what runs before its first prefill pass.
``[ptstore-trace] prefill at <wall clock>: <tokens> tokens, <n> requests`` marks each prefill
batch the scheduler forms (every chunk of a chunked prefill), so the benchmark's ``cold_phases``
can say which.

Seams: an AROUND hook on ``HiRadixCache.check_prefetch_progress`` and an AFTER hook on
``Scheduler.get_new_batch_prefill`` (rows of ``sglang_pic.compat``), registered only with
``--ptstore-trace``.
"""

from __future__ import annotations

import time

from .trace import trace


def around_check_prefetch_progress(original, self, req_id: str, *args, **kwargs):
    """SGLang's check; a trace line when it took a prefetch of this request (the request was
    in ``ongoing_prefetch`` and no longer is)."""
    ongoing = getattr(self, "ongoing_prefetch", {})
    pending = req_id in ongoing
    done = original(self, req_id, *args, **kwargs)
    if pending and done and req_id not in ongoing:
        tokens = getattr(self, "prefetch_loaded_tokens_by_reqid", {}).get(req_id, 0)
        trace("prefetch_done", time.time(), f"{tokens} tokens")
    return done


def around_handle_prefetch_result(original, self, operation, *args, **kwargs):
    """SGLang 0.5.23's ``UnifiedRadixCache._handle_prefetch_result(operation)``, where a finished
    prefetch goes into the tree (mostly when the cache controller acknowledges it, before the
    scheduler asks ``check_prefetch_progress``); the same trace line, with the tokens it loaded
    from storage."""
    result = original(self, operation, *args, **kwargs)
    handle = getattr(operation, "handle", None)
    tokens = getattr(self, "prefetch_loaded_tokens_by_reqid", {}).get(handle, 0)
    trace("prefetch_done", time.time(), f"{tokens} tokens")
    return result


def after_new_prefill_batch(plan, scheduler, *args, **kwargs):
    """A trace line for each prefill batch formed: wall clock, tokens computed (the batch's
    ``extend_num_tokens``) and requests. SGLang returns a ``NextBatchPlan`` whose
    ``batch_to_run`` is the batch, or None when nothing could be formed."""
    batch = getattr(plan, "batch_to_run", None)
    reqs = getattr(batch, "reqs", None)
    if reqs:
        trace("prefill", time.time(), f"{int(getattr(batch, 'extend_num_tokens', 0) or 0)} "
              f"tokens, {len(reqs)} requests")
    return plan

