"""Which forward batches read moved keys, and the positions of the keys every batch computes.

In the shifted layout (``stored_positions``) a request without spans reads every key at the
position it was computed at, so a batch of such requests is vanilla attention: ``pic_flashinfer``
runs it on FlashInfer, CUDA graphs included. A request whose prompt reuses a cached span at
another offset (the span cache sets ``req.pic_segments``) reads moved keys; a batch holding one
runs segmented attention (``segmented_backend``: each run of keys moved by one distance attended
with the query turned back), eagerly, and with the batch its requests' key runs
(``current_runs``); which CUDA graphs such a batch may replay: ``span_graphs``.

AFTER hook on ``ForwardBatch.init_new`` (``mark_forward_batch``, a row of
``sglang_pic.compat.forward_batch``): records the positions of the batch's new keys in the slot table,
gives span requests turned copies of the pages they read moved (``moved_copies``, with
``--span-copy-on-reuse``), and sets ``forward_batch.pic_shifted``: whether a request of the batch
still reads moved keys.
"""

from __future__ import annotations

from typing import Any

from sglang_pic.metrics import counters_for

from . import moved_copies, stored_positions
from .key_runs import RUNS_ATTR, request_runs

ATTR = "pic_shifted"
COUNTERS = {  # with --enable-metrics (sglang_pic.metrics)
    "shifted_batches": ("sglang_pic:shifted_batches",
                        "Forward batches holding a request that reads cached span pages at "
                        "another offset than they were computed at (on pic_flashinfer: run "
                        "by segmented attention, off vanilla's CUDA graphs)."),
    "shared_run_batches": ("sglang_pic:span_shared_run_batches",
                           "Decode batches in which runs of several requests read the same "
                           "cached pages (a document, a system prompt) and were attended "
                           "together, those pages read once for all of them."),
    "graph_steps": ("sglang_pic:span_graph_steps",
                    "Decode steps of batches holding span requests replayed from the second "
                    "CUDA graph set (--position-free-span-graphs) instead of run eagerly."),
    "prefill_graph_batches": ("sglang_pic:span_prefill_graph_batches",
                              "Extend batches holding span requests that read moved keys, run "
                              "in SGLang's prefill CUDA graphs (attention between the captured "
                              "pieces) instead of eagerly."),
    "copied_requests": ("sglang_pic:span_copied_requests",
                        "Span requests reading turned copies of the pages they read moved "
                        "(--span-copy-on-reuse), made for them or shared."),
    "copied_tokens": ("sglang_pic:span_copied_tokens",
                      "Tokens of moved span pages copied for the requests reading them."),
    "reused_copy_tokens": ("sglang_pic:span_reused_copy_tokens",
                           "Tokens of moved span pages a request read from a turned copy "
                           "another running request had made (same pages, same shift)."),
    "shared_requests": ("sglang_pic:span_shared_requests",
                        "Span requests that read the moved pages shared (by segmented "
                        "attention) for their whole life: not copied (--span-copy-on-reuse "
                        "off, or a moved key in a partial page)."),
    "waiting_requests": ("sglang_pic:span_waiting_requests",
                         "Times a span request's copy did not fit the pool (it read the shared "
                         "pages meanwhile, and was copied once the pool had room)."),
}
_counters = None
_started = False  # set at this process's first forward batch
_current = False  # the last batch init_new built here reads moved keys (is_shifted)
_runs: list | None = None  # and its key runs (current_runs)


def reads_moved_keys(req: Any) -> bool:
    """A request whose KV holds cached spans placed at an offset other than where they were
    computed (the span cache's segment layout), unless it reads its own turned copies of them
    (``moved_copies``)."""
    if getattr(req, "pic_segments", None) is None:
        return False
    return moved_copies.copier() is None or moved_copies.reads_shared_pages(req)


def batch_runs(reqs: Any, moved: list[bool], forward_batch: Any
               ) -> list[list[tuple[int, int, int]]]:
    """Each request's ``(start, end, shift)`` runs over the keys the batch reads from the pool:
    its whole sequence for a decode step, its prefix for an extend (``key_runs``). ``moved``:
    per request, whether it reads moved keys (``reads_moved_keys``)."""
    if forward_batch.forward_mode.is_extend():
        lens = list(forward_batch.extend_prefix_lens_cpu)
    else:
        lens = forward_batch.seq_lens_cpu.tolist()
    out = []
    for req, reads_moved, n in zip(reqs, moved, lens, strict=True):
        runs = None
        if reads_moved:
            if not hasattr(req, RUNS_ATTR):
                raise RuntimeError(f"request {req.rid}: reads moved keys but its runs were "
                                   "never found (not prepared at its first extend)")
            runs = getattr(req, RUNS_ATTR)
        out.append(request_runs(runs, int(n)))
    return out


def current_runs() -> list[list[tuple[int, int, int]]] | None:
    """The runs of the batch ``init_new`` built last in this process, if it reads moved keys
    and this process finds runs (it has a copier: ``moved_copies.wanted``)."""
    return _runs


def is_shifted(forward_batch: Any) -> bool:
    """Whether ``forward_batch`` reads moved keys. SGLang's runners hand the model their own
    copy of the batch (the eager runner's ``load_batch`` copies it into static buffers, a
    graph runner's view is built from them), which carries none of our attributes; such a copy
    belongs to the batch ``init_new`` built last in this process (one forward at a time)."""
    marked = getattr(forward_batch, ATTR, None)
    return _current if marked is None else bool(marked)


def current() -> bool:
    """Whether the batch this process's forward is running reads moved keys."""
    return _current


def mark_forward_batch(result: Any, cls: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook for ``ForwardBatch.init_new(batch, model_runner, ...)``.

    It runs for every forward, decode steps included, outside the CUDA graph and on the
    scheduler thread that SGLang's overlap scheduler needs free to prepare the next step, so a
    batch without spans must cost what vanilla SGLang does plus as little as possible:

    * the positions of its new keys are recorded (one scatter of ``batch`` entries, no sync):
      kept for every batch, since a plain request's cached pages may later be read by a span
      request, whose kernels and copier read the recorded positions;
    * with the copier (``pic_flashinfer``'s default), which of its requests read moved keys
      is answered by the copier's CPU counts (``reads_shared_anywhere``) while no request of
      the process reads shared pages: no request of the batch is looked at, and ``retry``
      returns at once. Only otherwise is each request asked (``reads_moved_keys``), which
      gives the same answer for every request the copier has seen (all of a batch's span
      requests by then: an extend prepares them just above).

    No device-to-host read here, for any batch: the copier's one per new span request is in
    ``prepare`` (an extend batch holding such a request)."""
    if stored_positions.table() is None:
        return
    stored_positions.record(result.out_cache_loc, result.positions)
    reqs = getattr(batch, "reqs", None) or ()
    if not _started:
        _start(args[0] if args else kwargs.get("model_runner"))
    copier = moved_copies.copier()
    if copier is not None and reqs:
        if result.forward_mode.is_extend():
            copier.prepare(list(reqs), getattr(result, "extend_prefix_lens_cpu", None))
        else:  # a decode batch: requests that waited for room may be copied now
            copier.retry(reqs)
    global _current, _runs
    if copier is not None and not copier.reads_shared_anywhere():
        moved = None  # every span request reads its own turned copies (or moved nothing)
    else:
        moved = [reads_moved_keys(r) for r in reqs]
    shifted = moved is not None and any(moved)
    setattr(result, ATTR, shifted)
    _current = shifted
    _runs = batch_runs(reqs, moved, result) if shifted and copier is not None else None
    if shifted and _counters is not None:
        _counters.inc("shifted_batches")


def count(name: str) -> None:
    """Add one to this process's counter ``name`` (of ``COUNTERS``), with ``--enable-metrics``."""
    if _counters is not None:
        _counters.inc(name)


def _start(model_runner: Any) -> None:
    """This process's counters and, with ``--span-copy-on-reuse``, its copier."""
    global _started, _counters
    _started = True
    if model_runner is None:
        return
    _counters = counters_for(model_runner, COUNTERS)
    if moved_copies.wanted(model_runner):
        moved_copies.start(model_runner, _counters)

