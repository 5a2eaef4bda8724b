"""Seams in SGLang's scheduler process: how requests are admitted, batched, streamed and
cancelled, and the attributes we hang on its requests."""

from __future__ import annotations

from .seam import Seam

TITLE = "Scheduler"

_S = "sglang.srt.managers.scheduler.Scheduler"
_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
_REQ = "sglang.srt.managers.schedule_batch.Req"

ROWS: tuple[Seam, ...] = (
    # span cache: the planner (sub-requests, holding, ISPS)
    Seam(f"{_S}.handle_generate_request", "sglang_pic.spans:_on_generate_request", "AROUND",
         "spans", why="a span request's independent spans become sub-requests"),
    Seam(f"{_S}._add_request_to_queue", "sglang_pic.spans:_on_add_to_queue", "AROUND", "spans",
         why="a request waits, held, until its sub-requests are cached"),
    Seam(f"{_S}.get_new_batch_prefill", "sglang_pic.spans:_on_new_prefill_batch", "AROUND",
         "spans",
         why="a request joins the batch right after its sub-requests'; sub-requests alone just "
             "over the chunk budget (by at most 1/8) go in one pass"),
    Seam(f"{_S}.chunked_prefill_size", "sglang_pic.spans:_on_new_prefill_batch",
         "instance-patch", "spans",
         why="the chunk budget of that one batch, put back after it is formed"),
    Seam(f"{_S}.abort_request", "sglang_pic.spans:_on_abort", "AFTER", "spans",
         why="an aborted request releases what it held; sub-requests no one needs are cancelled"),
    Seam(f"{_STREAMER}.stream_output", "sglang_pic.spans:_hide_span_prefills", "AROUND",
         "spans", why="sub-requests are not streamed to clients"),
    Seam(f"{_STREAMER}.get_cached_tokens_details", "sglang_pic.spans:_cached_details", "AROUND",
         "spans", why="the split of `cached_tokens` for a span request"),
    Seam(f"{_S}.init_load_inquirer", "sglang_pic.spans:_on_load_inquirer", "AFTER", "spans",
         why="held requests count in `/v1/loads`"),
    Seam(f"{_S}.load_inquirer", "sglang_pic.spans.load:install_span_load", "instance-patch",
         "spans", why="SGLang's load inquirer becomes `SpanLoadInquirer`"),
    Seam(f"{_REQ}.pic_segments", "sglang_pic.spans.planner:SpanPlanner._plan_request",
         "attribute", "spans", why="a span request's segments, read by `SpanRadixCache`"),
    Seam(f"{_REQ}.pic_store_tokens", "sglang_pic.spans.planner:SpanPlanner._plan",
         "attribute", "spans", why="tokens a span request found in the storage tier"),
    # eviction: the scheduler's steps, measured
    Seam(f"{_S}.run_batch", "sglang_pic.eviction.hooks:around_run_batch", "AROUND", "eviction",
         "sae_stats", why="the scheduler's batches and busy time, next to the policy's time"),
    Seam(f"{_S}.on_idle", "sglang_pic.eviction.hooks:around_on_idle", "AROUND", "eviction",
         "sae_stats", why="idle time is not busy time"),
    Seam(f"{_REQ}._pic_eviction_ctx", "sglang_pic.eviction.hooks:request_context", "attribute",
         "eviction", why="a request's eviction context (token types, session), built once"),
    # position-free KV: what a request's keys moved by
    Seam(f"{_REQ}.pic_moved_copy", "sglang_pic.position_free.moved_copies:"
         "MovedPageCopier._set_state", "attribute", "position-free-kv",
         why="a span request's turned copies of moved pages (`--span-copy-on-reuse`)"),
    Seam(f"{_REQ}.pic_shift_runs", "sglang_pic.position_free.moved_copies:"
         "MovedPageCopier.prepare", "attribute", "position-free-kv",
         why="the runs of keys a request reads moved, by shift"),
    # sparse decode with offloading: prompts longer than the pool
    Seam(f"{_S}.get_new_batch_prefill", "sglang_pic.sparse.offload:around_get_new_batch_prefill",
         "AROUND", "sparse-decode", "sparse_offload",
         why="pool slots freed mid-request clear SGLang's batch-is-full mark"),
    Seam("sglang.srt.managers.tp_worker.TpModelWorker.get_worker_info",
         "sglang_pic.sparse.prefill_offload:raise_input_limit", "AFTER", "sparse-decode",
         "sparse_offload", why="the input cap becomes the host region's `--sparse-max-context`"),
    Seam(f"{_S}.init_req_max_new_tokens", "sglang_pic.sparse.prefill_offload:clip_new_tokens",
         "AROUND", "sparse-decode", "sparse_offload",
         why="a prompt longer than the pool keeps its new tokens"),
    Seam("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
         "sglang_pic.sparse.prefill_offload:admit_offloaded_prompt", "AROUND", "sparse-decode",
         "sparse_offload",
         why="such a prompt is admitted at its peak in the pool (threshold + 2 chunks) while a "
             "sparse slot is free"),
    # HiCache storage I/O
    Seam(f"{_S}.on_idle", "sglang_pic.store.idle_yield:around_on_idle", "AROUND",
         "hicache-storage", "storage_idle_yield",
         why="while storage I/O is in flight and nothing runs, the idle pass ends with a nap "
             "(or waits for the lookup in flight), so the storage threads get the GIL"),
    Seam(f"{_S}.get_new_batch_prefill", "sglang_pic.store.prefetch_trace:after_new_prefill_batch",
         "AFTER", "hicache-storage", "ptstore_trace",
         why="a trace line per prefill batch formed"),
)
