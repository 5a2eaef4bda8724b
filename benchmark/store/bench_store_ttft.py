"""TTFT of a prefix computed by *another* instance: recompute vs SGLang's `file` backend vs PTStore.

One GPU, instances one after the other (each its own process and Engine, so the reader has never
seen the prefixes and shares no GPU or host memory with the writer):

* ``vanilla``: vanilla SGLang 0.5.17 on FlashInfer (the harness's baseline), no HiCache: the
  reader recomputes the prefix;
* ``vanilla-file-writer`` then ``vanilla-file``: vanilla SGLang with HiCache and its built-in
  ``file`` storage backend (a directory on the node's disk); the writer computes the prefixes and
  waits until they are written through to storage, the reader loads them;
* ``sglang-pic-ptstore-writer`` then ``sglang-pic-ptstore``: the same with PTStore (three store
  servers on this node, each its own process, started by this script) as the ``dynamic``
  backend; the servers are on the reader's node and SGLang's host pool is in shared memory
  (``"allocator": "shm"``, as ``--ptstore`` sets it), so the servers write the pages straight
  into the reader's host pool (the same-node path);
* ``sglang-pic-ptstore-tcp``: the PTStore reader reaching the store servers over TCP only
  (``"data_plane": "tcp"``: no shared memory at all, a private host pool; pages over 4 parallel
  connections per server, received into the host-pool slots and verified there) - what a reader
  on another node gets;
* ``sglang-pic-ptstore-fastgil`` / ``sglang-pic-ptstore-tcp-fastgil``: the same-node / TCP
  reader with ``"gil_switch_ms": 0.5`` (the scheduler process hands the GIL to its HiCache
  threads within 0.5 ms instead of 5 ms);
* ``sglang-pic-ptstore-staging``: the PTStore reader with a private host pool: pages come
  through its shared-memory staging segment and are copied into the pool by the reader;
* ``sglang-pic-ptstore-socket``: the PTStore reader with every page inside the CURVE replies of
  the zmq socket (``"data_plane": "zmq"``, the path before the TCP data plane);
* ``vanilla-hicache``: vanilla SGLang with HiCache (write-through) and no storage tier: what
  SGLang's host tier alone costs a cold miss;
* any PTStore variant with ``-nonap``: the same with ``--hicache-storage-idle-yield-us 0``.

``--rounds N`` runs every variant N times, alternating the order, and pools the samples.

Every engine runs on FlashInfer (Llama-3-8B shape, dummy weights, bf16, page size 64; HiCache
write-through and ``wait_complete`` prefetch). A prompt is a stored prefix + a fresh 64-token
question, one output token; the reader reports TTFT and where the cached tokens came from.
A prefix has the nominal length, trimmed to whole pages that leave the question room in the
model's context (131072: a 130944-token prefix).

Samples (``--samples``, default 3) go round the lengths in turn (8K, 32K, 128K, 8K, ...). With
``--flush`` the writer stores one prefix per length and every side empties its device and host
caches (``Engine.flush_cache``) before each request, so each sample loads from the store (or
recomputes) again; the first request of each length on each side is an unrecorded warm-up.
Without ``--flush`` every sample has its own prefix.

The run also measures, before the engines, the copy rates the loads are compared with: a raw TCP
loopback copy (``bench_transport.py``'s ``tcp-1`` / ``tcp-4``: ``sendall`` / ``recv_into`` between
two processes) and PTStore's own client reading the same bytes from the store servers over the
TCP data plane and over the CURVE socket. PTStore readers log each load (``batch_get_v1``, the
backend's trace): ``load_gbps_<n>`` is the bytes loaded over the time spent in those calls.

    python3 -m benchmark.store.bench_store_ttft [--out DIR] [--samples 3]
    python3 -m benchmark.store.bench_store_ttft --lengths 8192 32768 131072 --flush \
        --variants vanilla,sglang-pic-ptstore-writer,sglang-pic-ptstore-tcp,sglang-pic-ptstore \
        --cold-lengths 8192 --name store_ttft_tcp_h200
    python3 -m benchmark.store.bench_store_ttft --replot benchmark/results/store_ttft_tcp_h200.json

Prints a table and writes the JSON and a plot (``docs/figures/<name>.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

from benchmark import description
from benchmark.harness import LLAMA3_8B_DUMMY, ROUND_ENV, store_totals

HERE = Path(__file__).resolve().parent

REPO = HERE.parent.parent
LENGTHS = (1024, 2048, 4096, 8192)
TRACE_ENV = "SGLANG_PIC_STORE_TRACE"  # the PTStore backend's per-call trace (stderr)
TRACE_LOAD = re.compile(r"\[ptstore-trace\] batch_get_v1 at ([0-9.]+): (\d+) pages, (\d+) hits, "
                        r"([0-9.]+) ms")
TRACE_EXISTS = re.compile(r"\[ptstore-trace\] batch_exists at ([0-9.]+): (\d+) pages, (\d+) hits, "
                          r"([0-9.]+) ms")
TRACE_DONE = re.compile(r"\[ptstore-trace\] prefetch_done at ([0-9.]+): (\d+) tokens")
TRACE_PREFILL = re.compile(r"\[ptstore-trace\] prefill at ([0-9.]+): (\d+) tokens, (\d+) requests")
TRACE_PUT = re.compile(r"\[ptstore-trace\] batch_set_v1 at ([0-9.]+): (\d+) pages, (\d+) hits, "
                       r"([0-9.]+) ms")
FLUSH_SLICE_S = 10.0  # a deferred flush waits this long per call; progress is printed in between


NO_NAP = "-nonap"  # a PTStore variant's suffix: --hicache-storage-idle-yield-us 0
NAP_ENV = "SGLANG_PIC_STORAGE_IDLE_YIELD_US"  # that flag's hand-off to the scheduler process


def _role() -> tuple[str, bool]:
    """The variant's kind and whether it is the writer. ``-nonap`` turns the idle scheduler's
    nap off (``store/idle_yield.py``) for this process and its schedulers, and is dropped."""
    variant = os.environ.get("SGLANG_PIC_BENCH_VARIANT", "vanilla")
    if variant.endswith(NO_NAP):
        os.environ[NAP_ENV] = "0"
        variant = variant.removesuffix(NO_NAP)
    return variant.removesuffix("-writer"), variant.endswith("-writer")


def prefix_tokens(n: int, params: dict) -> int:
    """The stored prefix of nominal length ``n``: whole pages that leave the question (and one
    output token) room in the model's context."""
    page = params["page_size"]
    room = (params["model_context"] - params["question_tokens"] - 1) // page * page
    return min(n, room)


def _prefixes(params: dict) -> dict[int, list[list[int]]]:
    """Per length, the prefixes the writer stores: one (``flush``: every sample reloads it) or
    one per sample."""
    import numpy as np

    rng = np.random.default_rng(params["seed"])
    count = 1 if params.get("flush") else params["samples"]
    return {n: [[int(t) for t in rng.integers(1000, params["vocab"], size=prefix_tokens(n, params))]
                for _ in range(count)] for n in params["lengths"]}


def _stored_bytes(params: dict, kind: str) -> int:
    if kind.endswith("file"):
        root = Path(params["file_dir"])
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return store_totals(params["servers"], params["token"], ("bytes_in",))["bytes_in"]


def extra_config(kind: str, params: dict) -> dict:
    """The ``dynamic`` backend's extra config of a PTStore variant."""
    cfg = {"backend_name": "ptstore", "module_path": "sglang_pic.store.hicache_backend",
           "class_name": "PTStoreHiCacheStorage", "servers": params["servers"],
           "interface_v1": 1}
    if kind.endswith(("-tcp", "-tcp-fastgil")):  # another node's view: TCP only, private pool
        cfg.update(data_plane="tcp", data_streams=params.get("data_streams", 4))
    elif kind.endswith("-socket"):
        cfg.update(data_plane="zmq")
    elif kind.endswith("-staging"):  # host pool in private memory: the staging segment
        cfg.update(data_plane="shm")
    else:  # as --ptstore sets it: the host pool in shared memory, written by the servers
        cfg.update(allocator="shm")
    if kind.endswith("-fastgil"):
        cfg["gil_switch_ms"] = 0.5
    return cfg


def page_bytes(model_path: str, page_size: int) -> int:
    """Bytes of one SGLang page of the model's KV (bf16, K and V, every layer)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2
    return per_token * page_size


def loads_in(trace: list[tuple[float, int, int, float]], start: float, end: float
             ) -> tuple[int, float]:
    """Pages hit and milliseconds spent by the loads (``batch_get_v1``) that began within
    ``[start, end]`` (wall clock)."""
    hits = [(h, ms) for t, _, h, ms in trace if start <= t <= end]
    return sum(h for h, _ in hits), sum(ms for _, ms in hits)


def phases_in(lookups: list[tuple[float, int, int, float]],
              loads: list[tuple[float, int, int, float]], start: float, ttft_s: float,
              taken: list[float] = ()) -> dict[str, float] | None:
    """Where one timed request's TTFT went, from the backend trace (wall clock, ms from the
    request's start): ``lookup`` (until SGLang's prefetch thread asked the store which pages it
    holds), ``to_load`` (until the first load began: the scheduler's host allocation),
    ``loading`` (first load's start to last load's end) and ``after_load`` (from there to the
    first token: the host-to-GPU load-back and the question's prefill). With the scheduler's
    ``prefetch_done`` lines (``taken``, wall clock), ``after_load`` splits into ``to_take`` (until
    the scheduler took the loaded pages) and ``after_take``. None without loads."""
    end = start + ttft_s
    got = [(t, t + ms / 1000) for t, _, _, ms in loads if start <= t <= end]
    asked = [t for t, _, _, _ in lookups if start <= t <= end]
    if not got:
        return None
    first, last = min(a for a, _ in got), max(b for _, b in got)
    out = {"lookup_ms": round(1000 * ((min(asked) if asked else first) - start), 2),
           "to_load_ms": round(1000 * (first - start), 2),
           "loading_ms": round(1000 * (last - first), 2),
           "after_load_ms": round(1000 * (end - last), 2)}
    took = [t for t in taken if last - 0.001 <= t <= end]  # the line has ms resolution
    if took:
        out.update(to_take_ms=round(1000 * (min(took) - last), 2),
                   after_take_ms=round(1000 * (end - min(took)), 2))
    return out


def split_medians(splits: list[dict[str, float]]) -> dict[str, float]:
    """Each part's median over the samples' splits (the parts every sample has); rounds of a
    run pool their ``*_all`` splits, and the table recomputes these from them."""
    keys = [k for k in splits[0] if all(k in s for s in splits)] if splits else []
    return {k: statistics.median(s[k] for s in splits) for k in keys}


def cold_phases_in(lookups: list[tuple[float, int, int, float]],
                   prefills: list[tuple[float, int]], start: float, ttft_s: float
                   ) -> dict[str, float]:
    """Where a cold miss's TTFT went, from the trace (ms from the request's start): the
    store's lookup (``lookup_start``, ``lookup_end``: SGLang's prefetch thread asking which
    pages the store holds), the first and last prefill batch the scheduler formed
    (``first_prefill``, ``last_prefill``: each chunk of a chunked prefill is one) and how many
    (``prefill_batches``), and ``ttft``."""
    end = start + ttft_s
    asked = [(t, t + ms / 1000) for t, _, _, ms in lookups if start <= t <= end]
    formed = [t for t, _ in prefills if start <= t <= end]
    out = {"ttft_ms": round(1000 * ttft_s, 2), "prefill_batches": len(formed)}
    if asked:
        out.update(lookup_start_ms=round(1000 * (asked[0][0] - start), 2),
                   lookup_end_ms=round(1000 * (max(b for _, b in asked) - start), 2))
    if formed:
        out.update(first_prefill_ms=round(1000 * (formed[0] - start), 2),
                   last_prefill_ms=round(1000 * (formed[-1] - start), 2))
    return out


def parse_trace(text: str, pattern: re.Pattern = TRACE_LOAD) -> list[tuple[float, int, int, float]]:
    """``(wall clock, pages, hits, ms)`` of each traced call: loads (``TRACE_LOAD``), or stores
    (``TRACE_PUT``: hits are the pages the store took)."""
    return [(float(a), int(b), int(c), float(d)) for a, b, c, d in pattern.findall(text)]


def put_summary(puts: list[tuple[float, int, int, float]], page: int) -> dict:
    """The writer's stores (``batch_set_v1``, from the trace): calls, pages, pages that failed
    (SGLang drops the rest of a write-back operation after a failed batch), the slowest call and
    the rate while storing."""
    pages, stored = sum(p for _, p, _, _ in puts), sum(h for _, _, h, _ in puts)
    ms = sum(m for _, _, _, m in puts)
    return {"trace_puts": len(puts), "put_pages": pages, "put_failed_pages": pages - stored,
            "put_ms_max": max((m for _, _, _, m in puts), default=0.0),
            **({"put_gbps": stored * page / (ms / 1000) / 1e9} if stored and ms else {})}


def expected_pages(prompts: list[int], page_size: int) -> int:
    """Pages SGLang stores for requests of these prompt lengths (one output token each): the
    whole pages of each prompt (its partial last page is never cached)."""
    return sum(n // page_size for n in prompts)


def _flush_once(engine, timeout_s: float):
    """One ``flush_cache``; with ``timeout_s`` > 0 SGLang's scheduler defers it until it is fully
    idle or the time-out passes (``SchedulerFlushWrapper``), where the engine's tokenizer manager
    takes one (``Engine.flush_cache`` does not pass it)."""
    manager = getattr(engine, "tokenizer_manager", None)
    flush = getattr(manager, "flush_cache", None)
    if timeout_s > 0 and flush is not None \
            and "timeout_s" in inspect.signature(flush).parameters:
        return engine.loop.run_until_complete(flush(timeout_s=timeout_s)), True
    return engine.flush_cache(), False


def flush_when_idle(engine, budget_s: float, label: str, progress=None,
                    slice_s: float = FLUSH_SLICE_S) -> float:
    """Empty the engine's device and host caches as soon as SGLang lets it, waiting at most
    ``budget_s``; returns the seconds waited.

    SGLang refuses a flush while its scheduler is not fully idle (``Scheduler.is_fully_idle``),
    and with HiCache that includes every operation in flight: device-to-host write-through,
    write-back to the storage backend, prefetch and load-back. After a long prefill whose pages
    are written through to storage, that lasts as long as the storage writes (a 64K-token
    half-prefix of Llama-3-8B is 8 GiB of puts): far beyond a fixed 10 s. The flush is asked in
    slices of ``slice_s`` (SGLang defers each until idle), with a progress line after each
    slice (``progress()`` adds to it); past ``budget_s`` it raises, naming what was waited for."""
    t0 = time.monotonic()
    printed = t0
    while True:
        left = budget_s - (time.monotonic() - t0)
        out, deferred = _flush_once(engine, max(0.0, min(slice_s, left)))
        if getattr(out, "success", True):
            return time.monotonic() - t0
        now = time.monotonic()
        if now - t0 >= budget_s:
            raise RuntimeError(
                f"{label}: the engine did not flush its cache within {budget_s:g} s: SGLang "
                "refuses while HiCache write-through, storage write-back, prefetch or load-back "
                f"is in flight ({getattr(out, 'message', '') or 'not idle'})"
                + (f"; {progress()}" if progress else ""))
        if now - printed >= slice_s or deferred:
            printed = now
            print(f"[bench] {label}: waiting for HiCache operations in flight, {now - t0:.0f} s "
                  f"of {budget_s:g} s" + (f"; {progress()}" if progress else ""), flush=True)
        if not deferred:
            time.sleep(0.2)


def workload(engine_kwargs: dict, params: dict) -> dict:
    kind, writer = _role()
    kwargs = dict(engine_kwargs)
    if not Path(kwargs["model_path"]).is_absolute():
        kwargs["model_path"] = str(REPO / kwargs["model_path"])
    ptstore = kind.startswith("sglang-pic-ptstore")
    if kind != "vanilla":
        kwargs.update(params.get("hicache_kwargs", {}))
        kwargs.update(enable_hierarchical_cache=True, hicache_size=params["hicache_gb"],
                      hicache_write_policy="write_through",
                      hicache_storage_prefetch_policy="wait_complete")
        if kind == "vanilla-hicache":  # SGLang's host tier alone: what HiCache costs a miss
            pass
        elif kind.endswith("file"):
            os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = params["file_dir"]
            kwargs["hicache_storage_backend"] = "file"
        else:
            kwargs["hicache_storage_backend"] = "dynamic"
            os.environ["SGLANG_PIC_PTSTORE_TOKEN"] = params["token"]  # the schedulers inherit it
            kwargs["hicache_storage_backend_extra_config"] = json.dumps(extra_config(kind,
                                                                                     params))
    trace_file, puts = None, {}
    pb = page_bytes(kwargs["model_path"], kwargs["page_size"])
    if ptstore:  # the backend's trace (loads; a writer's stores), from the scheduler's stderr
        os.environ[TRACE_ENV] = "1"
        trace_file = tempfile.NamedTemporaryFile("w+", prefix="ptstore-trace-", suffix=".log")
        saved_stderr = os.dup(2)
        os.dup2(trace_file.fileno(), 2)  # the scheduler processes inherit it
    try:
        result = _run(kind, writer, kwargs, params)
    finally:
        if trace_file is not None:
            os.dup2(saved_stderr, 2)
            os.close(saved_stderr)
            trace_file.seek(0)
            text = trace_file.read()
            trace_file.close()
            sys.stderr.write(text)  # the engine's log, as it would have been printed
            if writer:  # printed also when the writer failed: which stores failed, how slow
                puts = put_summary(parse_trace(text, TRACE_PUT), pb)
                print(f"[bench] the writer's stores (backend trace): {puts}", flush=True)
    result.update(puts)
    if trace_file is not None and not writer:
        trace = parse_trace(text)
        lookups = parse_trace(text, TRACE_EXISTS)
        taken = [float(t) for t, _ in TRACE_DONE.findall(text)]
        prefills = [(float(t), int(k)) for t, k, _ in TRACE_PREFILL.findall(text)]
        for n in params.get("cold_lengths", []):
            cold = [cold_phases_in(lookups, prefills, a, b - a)
                    for a, b in result.pop(f"_cold_windows_{n}", [])]
            if cold:
                result[f"cold_phases_{n}_all"] = cold
                result[f"cold_phases_{n}"] = split_medians(cold)
        result["trace_loads"] = len(trace)
        for n in params["lengths"]:
            windows = result.pop(f"_windows_{n}", [])
            gbps, ms_all = [], []
            for start, end in windows:
                hits, ms = loads_in(trace, start, end)
                ms_all.append(round(ms, 2))
                if hits and ms:
                    gbps.append(hits * pb / (ms / 1000) / 1e9)
            result[f"load_ms_{n}_all"] = ms_all
            phases = [phases_in(lookups, trace, start + 0.05, end - start - 0.05, taken)
                      for start, end in windows]
            phases = [p for p in phases if p is not None]
            if phases:  # each part's median over the samples, and every sample's split
                result[f"phases_{n}"] = split_medians(phases)
                result[f"phases_{n}_all"] = phases
            if gbps:
                result[f"load_gbps_{n}_all"] = [round(g, 3) for g in gbps]
                result[f"load_gbps_{n}"] = statistics.median(gbps)
    else:
        for n in params["lengths"]:
            result.pop(f"_windows_{n}", None)
    for n in params.get("cold_lengths", []):
        result.pop(f"_cold_windows_{n}", None)
    return result


def _run(kind: str, writer: bool, kwargs: dict, params: dict) -> dict:
    import numpy as np
    import sglang as sgl

    lengths, vocab, flush = params["lengths"], params["vocab"], bool(params.get("flush"))
    prefixes = _prefixes(params)
    pb = page_bytes(kwargs["model_path"], kwargs["page_size"])
    t0 = time.perf_counter()
    engine = sgl.Engine(**kwargs)
    result: dict = {"engine_start_s": time.perf_counter() - t0,
                    "role": "writer" if writer else "reader",
                    "prefix_tokens": {str(n): prefix_tokens(n, params) for n in lengths}}
    print(f"[bench] {kind}{' (writer)' if writer else ''}: engine up in "
          f"{result['engine_start_s']:.1f} s", flush=True)
    started = time.perf_counter()  # progress: where the variant's time goes
    # questions and cold prefixes differ per reader: a reader's write-back of its cold prefixes
    # must not turn the next reader's into hits
    # and per round: a round's write-back of its cold prefixes must not turn the next round's
    # into hits either
    variant = os.environ.get("SGLANG_PIC_BENCH_VARIANT", kind)
    round_no = int(os.environ.get(ROUND_ENV, "0"))
    rng = np.random.default_rng([params["seed"], round_no,
                                 1 if writer else 2 + zlib.crc32(variant.encode())])

    def question() -> list[int]:
        return [int(t) for t in rng.integers(1000, vocab, size=params["question_tokens"])]

    wait_s = params.get("store_wait_s", 120)
    waits: list[float] = []

    def in_store() -> str:
        return f"{_stored_bytes(params, kind) / 1e9:.2f} GB stored in all"

    def empty_caches(label: str) -> None:
        """Device and host caches emptied (the store keeps its pages): the next request loads
        or recomputes its whole prefix. SGLang flushes only once no HiCache operation is in
        flight: after a request whose pages the store lacked, its own write-back of them."""
        waits.append(round(flush_when_idle(engine, wait_s, label,
                                           in_store if kind != "vanilla" else None), 2))

    def ttft(ids: list[int]) -> tuple[float, dict, float]:
        t, wall = time.perf_counter(), time.time()
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1,
                                                              "temperature": 0})
        dt = time.perf_counter() - t
        if os.environ.get(TRACE_ENV) == "1":
            print(f"[ptstore-trace] request at {wall:.3f}: {len(ids)} tokens, TTFT "
                  f"{1000 * dt:.1f} ms", file=sys.stderr, flush=True)
        return dt, out["meta_info"], wall

    try:
        if writer:  # nothing timed: compute each prefix once, wait until it is stored
            before = _stored_bytes(params, kind)  # e.g. the copy-rate reference's pages
            prompts = []
            for n in lengths:
                for p in prefixes[n]:
                    ids = p + question()
                    ttft(ids)
                    prompts.append(len(ids))
            expected = expected_pages(prompts, kwargs["page_size"]) * pb

            def stored() -> int:
                return _stored_bytes(params, kind) - before

            # Write-through to storage is asynchronous: one operation per radix node (a chunk of
            # chunked prefill, 8192 tokens on the H200: 1 GiB), stored one after the other by
            # HiCache's backup thread. SGLang's own bookkeeping says when none is left (the
            # flush waits for it); a pause in the stored bytes does not (one operation may take
            # longer than any pause chosen).
            waited = flush_when_idle(engine, wait_s, "writer", lambda: (
                f"{stored() / 1e9:.2f} of {expected / 1e9:.2f} GB stored"))
            got = stored()
            result.update(stored_bytes=got, stored_expected_bytes=expected,
                          store_wait_s=round(waited, 1))
            # a later round's writer finds the first round's prefixes stored (the servers outlive
            # the rounds) and adds only its new questions' pages: the store must then hold at
            # least what one writer stores
            if got < expected and not (round_no > 0 and _stored_bytes(params, kind) >= expected):
                raise RuntimeError(
                    f"the writer stored {got} of {expected} bytes ({got // pb} of "
                    f"{expected // pb} pages) with no write-back left in flight: stores failed "
                    "(SGLang logs 'Write page to storage: N pages failed' and drops the rest of "
                    "that operation; the backend trace's batch_set_v1 lines show which)")
            return result
        # warm-up: JIT for every shape class (and, with flush, the load path) untimed
        for n in lengths:
            if flush:
                empty_caches(f"before the {n}-token warm-up")
                ttft(prefixes[n][0] + question())
            else:
                size = prefix_tokens(n, params) + params["question_tokens"]
                ttft([int(t) for t in rng.integers(1000, vocab, size=size)])
        print(f"[bench] {kind}: warm-up done in {time.perf_counter() - started:.1f} s",
              flush=True)
        rows: dict[int, list] = {n: [] for n in lengths}
        for s in range(params["samples"]):  # round the lengths: drift spreads over all of them
            for n in lengths:
                if flush:
                    empty_caches(f"before {n}-token sample {s + 1}")
                p = prefixes[n][0 if flush else s]
                dt, meta, wall = ttft(p + question())
                rows[n].append((dt, meta, wall))
        for n in lengths:
            times = [dt for dt, _, _ in rows[n]]
            result[f"ttft_{n}_ms"] = 1000 * statistics.median(times)
            result[f"ttft_{n}_ms_all"] = [round(1000 * t, 2) for t in times]
            result[f"cached_{n}"] = statistics.median(int(m.get("cached_tokens", 0))
                                                      for _, m, _ in rows[n])
            hits = [int((m.get("cached_tokens_details") or {}).get("storage", 0))
                    for _, m, _ in rows[n]]
            result[f"storage_hit_{n}"] = statistics.median(hits)
            result[f"storage_hit_{n}_all"] = hits
            result[f"_windows_{n}"] = [(w - 0.05, w + dt) for dt, _, w in rows[n]]
        # a cold miss: a prefix the store never saw, on an engine whose caches are empty
        for n in params.get("cold_lengths", []) if kind != "vanilla" else []:
            cold, windows = [], []
            for _ in range(params["samples"]):
                if flush:
                    empty_caches(f"before a {n}-token cold miss")
                fresh = [int(t) for t in rng.integers(1000, vocab, size=prefix_tokens(n, params))]
                dt, _, wall = ttft(fresh + question())
                cold.append(dt)
                windows.append((wall, wall + dt))
            result[f"ttft_cold_{n}_ms"] = 1000 * statistics.median(cold)
            result[f"ttft_cold_{n}_ms_all"] = [round(1000 * t, 2) for t in cold]
            result[f"_cold_windows_{n}"] = windows
    finally:
        if waits:
            result.update(flush_wait_s_max=max(waits), flush_wait_s_all=waits)
        t1 = time.perf_counter()
        engine.shutdown()
        result["engine_shutdown_s"] = round(time.perf_counter() - t1, 2)
        result["requests_s"] = round(t1 - started, 2)
        print(f"[bench] {kind}: requests and flushes {result['requests_s']:.1f} s, shutdown "
              f"{result['engine_shutdown_s']:.1f} s", flush=True)
    return result


MODEL_CONTEXT = 131072  # Llama-3.1-8B's max_position_embeddings (benchmark/models/llama3-8b)
ENGINE_KWARGS = {**LLAMA3_8B_DUMMY, "context_length": 16384, "mem_fraction_static": 0.70,
                 "page_size": 64, "disable_cuda_graph": True}  # one output token: no decode graphs
PARAMS = {"seed": 0, "samples": 3, "question_tokens": 64, "hicache_gb": 16, "vocab": 120000,
          "lengths": list(LENGTHS), "page_size": 64, "model_context": MODEL_CONTEXT,
          "data_streams": 4}
SMOKE_KWARGS = {"device": "cpu", "skip_tokenizer_init": True, "attention_backend": "torch_native",
                "max_total_tokens": 4096, "disable_cuda_graph": True, "page_size": 16}
SMOKE_PARAMS = {"samples": 1, "question_tokens": 8, "hicache_gb": 1, "vocab": 49000,
                "lengths": [320, 640], "page_size": 16, "model_context": 2048,
                "hicache_kwargs": {"hicache_io_backend": "direct", "hicache_mem_layout": "layer_first"}}
VARIANTS = ("vanilla", "vanilla-hicache", "vanilla-file-writer", "vanilla-file",
            "sglang-pic-ptstore-writer",
            "sglang-pic-ptstore", "sglang-pic-ptstore-tcp", "sglang-pic-ptstore-tcp-fastgil",
            "sglang-pic-ptstore-fastgil",
            "sglang-pic-ptstore-staging", "sglang-pic-ptstore-socket")


COLUMNS = {"recompute": "vanilla", "HiCache": "vanilla-hicache", "file": "vanilla-file",
           "PTStore": "sglang-pic-ptstore",
           "PTStore/TCP": "sglang-pic-ptstore-tcp",
           "PTStore/TCP/fastgil": "sglang-pic-ptstore-tcp-fastgil",
           "PTStore/fastgil": "sglang-pic-ptstore-fastgil",
           "PTStore/staging": "sglang-pic-ptstore-staging",
           "PTStore/socket": "sglang-pic-ptstore-socket"}


def plot(report: dict, out: Path) -> Path:
    """TTFT per prefix length, one bar per variant that ran (median, with the samples' range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmark.harness import save_figure

    res, lengths = report["results"], report["params"]["lengths"]
    # (label, variant, metric): each side's loads, then each reader's cold misses where timed
    shown = [(c, v, "ttft") for c, v in COLUMNS.items()
             if all(f"ttft_{n}_ms" in res.get(v, {}) for n in lengths)]
    shown += [(f"{c} cold miss", v, "ttft_cold") for c, v in COLUMNS.items()
              if all(f"ttft_cold_{n}_ms" in res.get(v, {}) for n in lengths)]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / max(len(shown), 1)
    for j, (label, v, metric) in enumerate(shown):
        xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(lengths))]
        med = [res[v][f"{metric}_{n}_ms"] for n in lengths]
        samples = [res[v][f"{metric}_{n}_ms_all"] for n in lengths]
        # the samples are rounded to 0.01 ms, the median is not: clamp the rounding away
        lo = [max(0.0, m - min(a)) for m, a in zip(med, samples, strict=True)]
        hi = [max(0.0, max(a) - m) for m, a in zip(med, samples, strict=True)]
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=label,
               hatch="//" if metric == "ttft_cold" else None)
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" for n in lengths])
    ax.set_xlabel("prefix computed by the other instance (tokens)")
    ax.set_ylabel("TTFT (ms)")
    env = report.get("environment", {})
    ax.set_title(f"TTFT of a stored prefix, Llama-3-8B shape, {env.get('gpu', 'CPU')}, "
                 f"SGLang {env.get('sglang', '')}", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def print_table(report: dict) -> None:
    res, lengths = report["results"], report["params"]["lengths"]
    print(f"\n{'prefix':>8}" + "".join(f"{c:>20}" for c in COLUMNS)
          + f"{'PTStore vs recompute':>22}{'TCP vs recompute':>18}{'vs file':>10}"
          f"{'TCP load GB/s':>15}")
    for n in lengths:
        ms = {c: res.get(v, {}).get(f"ttft_{n}_ms") for c, v in COLUMNS.items()}
        cells = "".join(f"{m:>18.1f}ms" if m else f"{'-':>20}" for m in ms.values())
        rec, fil, pts, tcp = ms["recompute"], ms["file"], ms["PTStore"], ms["PTStore/TCP"]
        ratio = f"{rec / pts:>21.2f}x" if rec and pts else f"{'-':>22}"
        vs_tcp = f"{rec / tcp:>17.2f}x" if rec and tcp else f"{'-':>18}"
        vs_file = f"{fil / pts:>9.2f}x" if fil and pts else f"{'-':>10}"
        gbps = res.get("sglang-pic-ptstore-tcp", {}).get(f"load_gbps_{n}")
        load = f"{gbps:>15.2f}" if gbps else f"{'-':>15}"
        print(f"{n:>8}{cells}{ratio}{vs_tcp}{vs_file}{load}")
    for n in lengths:  # where the TCP reader's TTFT went (backend trace, median sample)
        tcp = res.get("sglang-pic-ptstore-tcp", {})
        ph = split_medians(tcp.get(f"phases_{n}_all") or []) or tcp.get(f"phases_{n}")
        if ph:
            print(f"TCP {n}: " + ", ".join(f"{k.removesuffix('_ms')} {v:.1f} ms"
                                           for k, v in ph.items()))
    for n in lengths:  # every side's samples, with the tokens each found in storage
        for v, r in res.items():
            if f"ttft_{n}_ms_all" in r:
                got = r.get(f"storage_hit_{n}_all", [])
                print(f"{v}, {n}: {r[f'ttft_{n}_ms']:.1f} ms (samples "
                      f"{', '.join(f'{t:.1f}' for t in r[f'ttft_{n}_ms_all'])})"
                      + (f", storage hits {got}" if any(got) else ""))
    for v, r in res.items():  # a prefix the store never saw, against recomputing it in vanilla
        for n in lengths:
            cold, rec = r.get(f"ttft_cold_{n}_ms"), res.get("vanilla", {}).get(f"ttft_{n}_ms")
            if cold and rec:
                print(f"cold miss, {v}, {n}: {cold:.1f} ms vs {rec:.1f} ms recompute "
                      f"({100 * (cold / rec - 1):+.1f} %)")
            cold_ph = split_medians(r.get(f"cold_phases_{n}_all") or []) \
                or r.get(f"cold_phases_{n}")
            if cold_ph:
                print(f"  cold {n}: " + ", ".join(
                    f"{k.removesuffix('_ms')} {x:.1f}" for k, x in cold_ph.items()))
    ref = report.get("transport_reference") or report.get("params", {}).get(
        "transport_reference")
    if ref:
        print(f"\ncopy rates, {ref['pages']} x {ref['page_bytes'] >> 20} MiB over loopback "
              "(GB/s, median):")
        for key, r in ref.items():
            if isinstance(r, dict):
                print(f"  {key:<32}" + (f"{r['gbps_median']:.2f}" if "gbps_median" in r
                                          else r.get("error", "-")))


def transport_reference(endpoints: list[str], token: str, pages: int, page: int, samples: int,
                        streams: int) -> dict:
    """The copy rates a load is compared with, measured on this machine in this run: a raw TCP
    loopback copy between two processes (``bench_transport``'s ``tcp-1`` / ``tcp-4``), and
    PTStore's client reading the same bytes from the store servers (not inside SGLang) over the
    TCP data plane (1, ``streams`` and twice that many connections per server) and over the
    CURVE socket; and the rate of the page checksum a TCP load verifies every page with, on one
    thread and on ``streams`` threads (a load's streams hash in parallel)."""
    import numpy as np
    from sglang_pic.store.client import StoreClient

    from benchmark.store import bench_transport

    out: dict = {"pages": pages, "page_bytes": page, "samples": samples}
    ns = argparse.Namespace(pages=pages, page_bytes=page, samples=samples, timeout=300.0)
    for v in ("tcp-1", "tcp-4"):
        out[f"raw_{v}"] = bench_transport.run_variant(v, ns, None)
    data = np.random.default_rng(1).integers(0, 255, size=pages * page, dtype=np.uint8)
    mv = memoryview(data).cast("B")
    # the check every page of a TCP load gets (datapath._stream: one XXH3 call per page, which
    # lets go of the GIL), on one thread and on as many threads as a load has streams per server
    from benchmark.store import bench_checksum_threads

    views_in = [mv[i * page:(i + 1) * page] for i in range(pages)]
    for key, threads in (("xxh3_one_thread", 1), (f"xxh3_{streams}_threads", streams)):
        rates = [bench_checksum_threads.rate(bench_checksum_threads.whole_page_call, views_in,
                                             threads) for _ in range(samples)]
        out[key] = {"gbps_median": statistics.median(rates), "gbps_samples": rates}
    ids = [f"bench-reference-{i}" for i in range(pages)]
    put = StoreClient(endpoints, token, timeout_ms=60_000)
    put.batch_set(list(zip(ids, views_in, strict=True)))
    put.close()
    dest = np.zeros_like(data)
    dv = memoryview(dest).cast("B")
    views = [dv[i * page:(i + 1) * page] for i in range(pages)]
    # beside: nothing; a thread looping in Python without pause (SGLang's scheduler while a
    # request waits for its prefetch); the same loop napping as --hicache-storage-idle-yield-us
    # makes it (store/idle_yield.py)
    cases = [("tcp", 1, None), ("tcp", streams, None), ("tcp", min(64, 2 * streams), None),
             ("zmq", 1, None), ("tcp", streams, 0.0), ("tcp", streams, 100e-6)]
    for mode, k, nap in cases:
        client = StoreClient(endpoints, token, timeout_ms=60_000, data_plane=mode,
                             data_streams=k)
        try:
            ok = client.batch_get_into(ids, views)  # warm-up, verified
            verified = all(ok) and bool((dest == data).all())
            rates = []
            for _ in range(samples):
                dest.fill(0)
                with _python_loop_beside(nap):
                    t0 = time.perf_counter()
                    ok = client.batch_get_into(ids, views)
                    rates.append(pages * page / (time.perf_counter() - t0) / 1e9)
                verified = verified and all(ok)
            key = f"ptstore_tcp_{k}" if mode == "tcp" else "ptstore_zmq_curve"
            key += "" if nap is None else "_spinning_yield" if nap else "_spinning"
            out[key] = {"gbps_median": statistics.median(rates), "gbps_samples": rates,
                        "verified": verified}
        finally:
            client.close()
    return out


@contextlib.contextmanager
def _python_loop_beside(nap_s: float | None):
    """A thread running a Python loop (naps of ``nap_s`` per pass; 0: none) while the block
    runs; None: no thread."""
    if nap_s is None:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        work: dict[int, int] = {}
        while not stop.is_set():
            for j in range(200):  # about one idle pass of SGLang's scheduler in Python
                work[j] = 2 * j
            if nap_s:
                time.sleep(nap_s)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def main() -> None:
    from benchmark.harness import _write_report, run_side_by_side, smoke_dir, start_store_servers

    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--replot", default=None, help="table and plot of a report JSON, no run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default=None,
                    help="report name (default store_ttft_h200, or store_ttft_cpu_smoke)")
    ap.add_argument("--samples", type=int, default=None,
                    help=f"per length and side (default {PARAMS['samples']}; --smoke: 1)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help=f"nominal prefix lengths (default {' '.join(map(str, LENGTHS))}); "
                         "e.g. 8192 32768 131072")
    ap.add_argument("--flush", action="store_true",
                    help="one stored prefix per length; every side empties its device and host "
                         "caches before each request (each sample loads or recomputes again)")
    ap.add_argument("--cold-lengths", type=int, nargs="*", default=[],
                    help="PTStore readers also time prefixes the store never saw (cold misses)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--stores", type=int, default=3)
    ap.add_argument("--store-gb", type=float, default=None,
                    help="memory of each store server (default 16, or 32 beyond 8K prefixes)")
    ap.add_argument("--hicache-gb", type=float, default=None,
                    help="HiCache host pool (default 16, or 24 beyond 8K prefixes)")
    ap.add_argument("--data-streams", type=int, default=PARAMS["data_streams"],
                    help="TCP connections per store server of the -tcp reader")
    ap.add_argument("--reference-mb", type=int, default=1024,
                    help="bytes moved by the copy-rate reference (0: not measured)")
    ap.add_argument("--gpus", default=None, metavar="WRITER,READER",
                    help="GPU ids: the instances that compute (*-writer) on the first, every "
                         "other on the second (two instances on two GPUs of one host, stores "
                         "between them); default: every instance on the visible GPU")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant this many times, alternating the order (A B, B A, "
                         "...); samples pool over the rounds (the cold-miss bound compares two "
                         "processes run minutes apart: alternating spreads the drift)")
    ap.add_argument("--context-length", type=int, default=None,
                    help="the engines' context length (default: room for the longest prefix "
                         "and its question)")
    ap.add_argument("--smoke", action="store_true", help="CPU, SmolLM2, tiny prefixes")
    args = ap.parse_args()
    if args.replot:
        report = json.loads(Path(args.replot).read_text())
        print_table(report)
        plot(report, REPO / "docs" / "figures" / f"{Path(args.replot).stem}.png")
        return
    if args.samples is not None and args.samples < 1:
        ap.error("--samples must be at least 1")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    variants = tuple(v for v in args.variants.split(",") if v)
    gpus = None
    if args.gpus is not None:
        ids = args.gpus.split(",")
        if len(ids) != 2 or not all(i.strip().isdigit() for i in ids):
            ap.error("--gpus takes two GPU ids, WRITER,READER (e.g. 0,1)")
        gpus = {v: ids[0].strip() if v.endswith("-writer") else ids[1].strip()
                for v in variants}
    unknown = [v for v in variants if v.removesuffix(NO_NAP) not in VARIANTS
               or (v.endswith(NO_NAP) and not v.startswith("sglang-pic-ptstore"))]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)} (a PTStore "
                 f"variant with {NO_NAP}: the idle scheduler's nap off)")
    kwargs, extra, name = dict(ENGINE_KWARGS), {}, "store_ttft_h200"
    page_mb = 4  # a K or V block of a Llama-3-8B page of 64 tokens
    if args.smoke:
        from sglang_pic.cpu.support import enable_cpu_engine
        from sglang_pic.launcher.default_model import ensure_default_model

        enable_cpu_engine()
        kwargs = {"model_path": str(ensure_default_model()), **SMOKE_KWARGS}
        extra, name = dict(SMOKE_PARAMS), "store_ttft_cpu_smoke"
        args.out = args.out or smoke_dir()
        page_mb, args.reference_mb = 1, min(args.reference_mb, 16)
    params = {**PARAMS, **extra, "flush": args.flush, "cold_lengths": list(args.cold_lengths),
              "data_streams": args.data_streams}
    if args.samples is not None:
        params["samples"] = args.samples
    if args.lengths:
        params["lengths"] = list(args.lengths)
    model_dir = Path(kwargs["model_path"])
    model_dir = model_dir if model_dir.is_absolute() else REPO / model_dir
    params["model_context"] = json.loads((model_dir / "config.json").read_text()).get(
        "max_position_embeddings", params["model_context"])
    longest = max(prefix_tokens(n, params) for n in params["lengths"])
    big = longest > 8192
    # beyond 8K: a host pool that takes the 128K prefix (17 GB) and, on the writer, all three
    params["hicache_gb"] = args.hicache_gb or (24 if big else params["hicache_gb"])
    if args.context_length is not None:
        if not longest + params["question_tokens"] < args.context_length \
                <= params["model_context"]:
            ap.error(f"--context-length must exceed the longest prompt "
                     f"({longest + params['question_tokens']} tokens) and be at most the "
                     f"model's {params['model_context']}")
        kwargs["context_length"] = args.context_length
    elif not args.smoke:
        kwargs["context_length"] = min(params["model_context"], max(
            kwargs["context_length"], longest + params["question_tokens"] + params["page_size"]))
    store_gb = args.store_gb or (32 if big else 16)
    params["store_wait_s"] = 300 if big else 120  # write-through of ~22 GB over CURVE puts
    name = args.name or name
    token = "bench-store-ttft-token"  # a throwaway token of loopback servers
    stores, endpoints = start_store_servers(args.stores, token, memory_gb=store_gb)
    try:
        reference = None
        if args.reference_mb > 0:
            page = page_mb << 20
            reference = transport_reference(endpoints, token, max(1, (args.reference_mb << 20)
                                                                  // page), page,
                                            max(3, params["samples"]), args.data_streams)
        with tempfile.TemporaryDirectory() as file_dir:
            params.update(servers=endpoints, token=token, file_dir=file_dir, store_gb=store_gb)
            if reference is not None:  # in params too: the partial reports written after
                params["transport_reference"] = reference  # each variant carry it
            report = run_side_by_side(name, "store.bench_store_ttft", "workload", kwargs, params,
                                      variants=variants, out_dir=args.out, timeout_s=900,
                                      variant_gpus=gpus, rounds=args.rounds)
        if reference is not None:
            report["transport_reference"] = reference
            print(f"[bench] wrote {_write_report(name, args.out, report)}")
    finally:
        for p in stores:
            p.terminate()
    print_table(report)
    figures = Path(args.out) if args.smoke else REPO / "docs" / "figures"
    plot(report, figures / f"{name}.png")


if __name__ == "__main__":
    main()
