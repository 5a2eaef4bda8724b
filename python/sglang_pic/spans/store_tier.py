"""Span pages in PTStore: a span computed by one instance is loaded by another, at any offset.

HiCache does not combine with the span cache (its host and storage tiers key pages by SGLang's
token-prefix hash chain, which cannot name a span reused at another offset), so span units get their own
path to the store, keyed by **span-aware block hashes**:

* a segment's blocks chain from a root made of the model tag and the segment's radix namespace, so
  an independent span (SSEP: the request's base namespace, a chain of its own) gets the same
  block keys whatever precedes it, and a dependent piece (PDEP: a namespace digesting everything
  before it) gets keys that change with the whole preceding prompt;
* the model tag names what the bytes mean (model, KV dtype, layers, heads, head dim, block size,
  TP rank, and the key layout: rotated where computed), so another model or layout never reads
  them.

A loaded block's keys were rotated where the unit computed them: from 0 for an independent span
(computed alone), from the segment's offset for a dependent piece; ``load`` records those
positions for the slots it fills (``position_free.stored_positions``).

The store holds a span in **blocks** of ``block_tokens`` tokens (a whole number of pool pages, about
``BLOCK_BYTES`` each; the last block of a span is shorter), not in pool pages: with SGLang's page
size of 1 a pool page is one token (128 KiB for Llama-3-8B), and a store entry, key, checksum and
message frame per token cost more Python than the bytes cost to move. A block is
``[tokens, layers, 2 (K, V), kv_heads, head_dim]`` of the KV pool's dtype (token-major, so a run of
blocks is one contiguous copy).

Saving runs off the scheduler's critical path: when a span unit's prefill is cached
(``SpanPlanner._finish_unit``) the scheduler thread only launches the gather (per layer, into a
device staging buffer, then one asynchronous copy into pinned host memory, on the scheduler's
stream: ``PoolRows``) and records an event; the writer thread waits for
the event and sends the blocks. Before a span unit is prefilled (``SpanPlanner._plan``) its
remaining blocks are looked up and, when every one is stored, read into pinned host memory, copied
to the device in one transfer per staging group, scattered into freshly allocated pool slots and
inserted into the radix tree, so no prefill runs. Checksums are checked on every block
(``StoreClient``); any failure is a miss and the unit is prefilled.

Turned on by ``sglang-pic serve --enable-span-cache --ptstore ENDPOINTS`` (``SGLANG_PIC_SPAN_STORE``
in the environment: ``{"servers": [...], "server_key": ...}``; the token is
``$SGLANG_PIC_PTSTORE_TOKEN``, never in that JSON).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from queue import Queue
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sglang_pic import environment
from sglang_pic.compat.radix_api import matched_indices
from sglang_pic.position_free import stored_positions

if TYPE_CHECKING:
    from sglang_pic.metrics import Counters
    from sglang_pic.store.client import StoreClient
    from sglang_pic.store.config import PTStoreConfig

logger = logging.getLogger(__name__)

COUNTERS = {  # SpanStoreTier.stats key -> (metric name, help)
    "saved_blocks": ("sglang_pic:span_store_saved_blocks",
                     "Span blocks queued for PTStore (blocks it already holds are not sent)."),
    "saved_bytes": ("sglang_pic:span_store_saved_bytes", "Bytes of the span blocks queued."),
    "dropped_units": ("sglang_pic:span_store_dropped_units",
                      "Span units not saved: the writer thread was behind (1 GiB queued)."),
    "failed_blocks": ("sglang_pic:span_store_failed_blocks",
                      "Span blocks PTStore did not store (a server down or full)."),
    "loaded_units": ("sglang_pic:span_store_loaded_units",
                     "Span units loaded from PTStore instead of prefilled."),
    "loaded_tokens": ("sglang_pic:span_store_loaded_tokens",
                      "Tokens of the span units loaded from PTStore."),
    "missed_units": ("sglang_pic:span_store_missed_units",
                     "Span units looked up in PTStore and not all there (prefilled)."),
}
"""What the tier counts (``SpanStoreTier.stats``), on ``/metrics`` with ``--enable-metrics``."""

ENV = "SGLANG_PIC_SPAN_STORE"
KEY_PREFIX = "span-"


def block_keys(tokens: Sequence[int], namespace: str | None, block_tokens: int,
               tag: str) -> list[str]:
    """Store ids of the blocks of a segment's key ``tokens`` in radix ``namespace``: one per
    ``block_tokens`` tokens, the last one shorter when the key does not fill it. Each id chains
    from the ones before it, so a block's id names the whole key up to its end."""
    h = hashlib.blake2b(f"{tag}\x1f{namespace or ''}".encode(), digest_size=16).digest()
    keys = []
    for lo in range(0, len(tokens), block_tokens):
        block = array("q", tokens[lo : lo + block_tokens]).tobytes()
        h = hashlib.blake2b(h + block, digest_size=16).digest()
        keys.append(KEY_PREFIX + h.hex())
    return keys


BLOCK_BYTES = 4 << 20
"""About this many bytes per stored block (rounded down to whole pool pages, at least one)."""
MAX_BLOCK_BYTES = 64 << 20
"""A block must fit the store server's tensor limit (``protocol.Limits``)."""
STAGE_BYTES = 64 << 20
"""Device memory a save or load stages at a time beside the pool."""
QUEUED_BYTES = 1 << 30
"""Host bytes of span units waiting for the writer thread; beyond that a save is dropped (the
store is slow or down, and each waiting unit holds a pinned host copy of its KV)."""


def block_tokens_for(token_bytes: int, page_size: int) -> int:
    """Tokens per stored block: a whole number of pool pages of about ``BLOCK_BYTES``."""
    return max(1, BLOCK_BYTES // (token_bytes * page_size)) * page_size


def unsupported_pool(pool: Any) -> str | None:
    """Why the tier cannot copy ``pool``'s KV token row by token row (None: it can)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if type(pool) is not MHATokenToKVPool:  # page-major, FP4/MXFP8 scales, unified, MLA, ...
        return f"needs SGLang's plain MHA KV pool, got {type(pool).__name__}"
    if getattr(pool, "kv_cache_layout", "nhd") != "nhd" or getattr(pool, "use_hnd", False):
        return f"needs the NHD KV layout, got {getattr(pool, 'kv_cache_layout', 'hnd')}"
    k, v = pool.k_buffer[0], pool.v_buffer[0]
    if k.dim() != 3 or k.shape != v.shape:
        return f"needs K and V rows of one shape, got {tuple(k.shape)} and {tuple(v.shape)}"
    return None


def config_from_env() -> PTStoreConfig | None:
    """The tier's ``store.config.PTStoreConfig`` from ``SGLANG_PIC_SPAN_STORE`` (JSON, checked
    as strictly as the HiCache extra config), or None when it is not set."""
    raw = environment.read(ENV)
    if not raw:
        return None
    from sglang_pic.store.config import PTStoreConfig

    cfg = json.loads(raw)
    if not isinstance(cfg, dict):
        raise ValueError(f"{ENV} must be a JSON object with a non-empty 'servers' list")
    return PTStoreConfig.from_extra(cfg)


class PoolRows:
    """Copies token rows of an MHA KV pool to and from host memory in the block layout
    ``[tokens, layers, 2, kv_heads, head_dim]``.

    On a GPU the host side is pinned and both directions go through a device staging buffer of
    at most ``STAGE_BYTES`` on the calling thread's current stream: SGLang's scheduler processes
    a batch's results once its forward is done, and every later forward waits for the scheduler's
    stream, so a copy sees the rows the forward wrote and no later forward overwrites them before
    it ran. The calling thread never waits for the GPU: ``gather`` returns an event the consumer
    waits on, ``scatter`` returns once the copies are queued (the caching host allocator keeps
    the pinned buffer until they ran)."""

    def __init__(self, pool: Any):
        self.k, self.v = pool.k_buffer, pool.v_buffer
        self.device = self.k[0].device
        self.dtype = self.k[0].dtype
        self.row_shape = (len(self.k), 2, *self.k[0].shape[1:])
        self.token_bytes = self.k[0].element_size() * 2 * len(self.k) * self.k[0][0].numel()
        self.on_gpu = self.device.type == "cuda"
        self.group = max(1, STAGE_BYTES // self.token_bytes)

    def host(self, tokens: int) -> torch.Tensor:
        """An empty host buffer for ``tokens`` rows (pinned on a GPU)."""
        return torch.empty((tokens, *self.row_shape), dtype=self.dtype, pin_memory=self.on_gpu)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``(host, event)``: the pool rows ``rows`` copied into a new host buffer, complete once
        ``event`` (None on CPU, where the copy is done on return) has fired."""
        rows = rows.to(self.device)
        out = self.host(len(rows))
        for lo in range(0, len(rows), self.group):
            part = rows[lo : lo + self.group]
            stage = out[lo : lo + len(part)] if not self.on_gpu else torch.empty(
                (len(part), *self.row_shape), dtype=self.dtype, device=self.device)
            for layer in range(len(self.k)):
                stage[:, layer, 0] = self.k[layer][part]
                stage[:, layer, 1] = self.v[layer][part]
            if self.on_gpu:
                out[lo : lo + len(part)].copy_(stage, non_blocking=True)
        if not self.on_gpu:
            return out, None
        event = torch.cuda.Event()
        event.record()
        return out, event

    def scatter(self, host: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the host rows ``host`` into the pool rows ``rows``."""
        rows = rows.to(self.device)
        for lo in range(0, len(rows), self.group):
            part = rows[lo : lo + self.group]
            stage = host[lo : lo + len(part)].to(self.device, non_blocking=True)
            for layer in range(len(self.k)):
                self.k[layer][part] = stage[:, layer, 0]
                self.v[layer][part] = stage[:, layer, 1]


class SpanStoreTier:
    """Saves span units' blocks to PTStore and loads them back into the KV pool.

    ``cache``: the ``SpanRadixCache`` (its allocator, KV pool and tree); ``client``: a
    ``StoreClient``; ``block_tokens``: tokens per stored block (None: about ``BLOCK_BYTES``).
    Only the scheduler thread calls ``save`` and ``load``; the writer thread only waits for the
    gathers it was handed and sends their bytes."""

    KNOWN_BLOCKS = 1 << 16
    """Bound on the block ids remembered as stored (skipped by ``save``)."""
    RETRY_AFTER_S = 10.0
    """After a lookup a store server did not answer (each costs the client's time-out on the
    scheduler thread), loads are skipped - units are prefilled - for this long."""

    def __init__(self, cache: RadixCache, client: StoreClient, model: str,
                 block_tokens: int | None = None, counters: Counters | None = None):
        self.cache = cache
        self.stats: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        """What the tier did (``COUNTERS``' keys), also on ``/metrics`` with
        ``--enable-metrics`` (``counters``)."""
        self.counters = counters
        self.client = client
        self.page_size = cache.page_size
        pool = cache.token_to_kv_pool_allocator.get_kvcache()
        problem = unsupported_pool(pool)
        if problem:
            raise ValueError(f"span pages in PTStore: {problem}")
        self.rows = PoolRows(pool)
        self.block_tokens = block_tokens or block_tokens_for(self.rows.token_bytes,
                                                             self.page_size)
        if self.block_tokens % self.page_size:
            raise ValueError(f"span pages in PTStore: a block of {self.block_tokens} tokens is "
                             f"not a whole number of {self.page_size}-token pages")
        self.block_bytes = self.rows.token_bytes * self.block_tokens
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise ValueError(f"span pages in PTStore: a block is {self.block_bytes} B, over the "
                             f"store's {MAX_BLOCK_BYTES} B tensor limit (use a smaller page size)")
        k = pool.k_buffer[0]
        self.tag = (f"{model}|{pool.dtype}/{k.dtype}|layers{getattr(pool, 'start_layer', 0)}+"
                    f"{len(pool.k_buffer)}|{tuple(k.shape[1:])}|B{self.block_tokens}|tp0of1"
                    "|token-major|keys-rotated-where-computed")
        self.known: OrderedDict[str, None] = OrderedDict()
        self.skip_loads_until = 0.0
        self._warned_at = float("-inf")
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self._jobs: Queue[tuple[list[str], list[int], torch.Tensor, Any] | None] = Queue()
        self._writer = threading.Thread(target=self._write_loop, name="span-store-writer",
                                        daemon=True)
        self._writer.start()

    def _count(self, **counts: int) -> None:
        """Add ``counts`` (``COUNTERS``' keys) to ``stats``, under one lock (the writer thread
        counts too), and to the Prometheus counters."""
        with self._lock:
            for key, n in counts.items():
                self.stats[key] += n
        if self.counters is not None:
            for key, n in counts.items():
                self.counters.inc(key, n)

    def pending_bytes(self) -> int:
        """Host bytes of saved units the writer thread has not finished sending."""
        with self._lock:
            return self._queued_bytes

    def _blocks(self, key_tokens: int) -> list[tuple[int, int]]:
        """``(start, end)`` token offsets of the blocks of a key of ``key_tokens`` tokens."""
        b = self.block_tokens
        return [(lo, min(lo + b, key_tokens)) for lo in range(0, key_tokens, b)]

    # ---- saving ----------------------------------------------------------------------------
    def save(self, ids: Sequence[int], namespace: str | None, start: int, end: int) -> int:
        """Queue the cached blocks of key ``ids[start:end]`` in ``namespace`` for the store;
        returns how many blocks were queued (blocks known to be stored are skipped). Never
        raises: it runs inside the scheduler's caching of a finished request."""
        try:
            return self._save(ids, namespace, start, end)
        except Exception:  # noqa: BLE001 - the store is an optimisation, never a failure
            logger.exception("span store: save failed")
            return 0

    def _save(self, ids: Sequence[int], namespace: str | None, start: int, end: int) -> int:
        n = (end - start) // self.page_size * self.page_size
        if n == 0:
            return 0
        got = matched_indices(self.cache, RadixCache.match_prefix(
            self.cache, MatchPrefixParams(key=RadixKey(ids[start : start + n], namespace))))
        if len(got) < n:  # evicted meanwhile: nothing to save that a load could use
            return 0
        keys = block_keys(ids[start : start + n], namespace, self.block_tokens, self.tag)
        todo = [j for j, k in enumerate(keys) if not self._is_known(k)]
        if not todo:
            return 0
        blocks = self._blocks(n)
        rows = torch.cat([got[blocks[j][0] : blocks[j][1]] for j in todo])
        nbytes = len(rows) * self.rows.token_bytes
        with self._lock:
            full = self._queued_bytes + nbytes > QUEUED_BYTES
            if not full:
                self._queued_bytes += nbytes
        if full:
            self._count(dropped_units=1)
            self._warn("span store: the writer is behind; a span unit is not saved")
            return 0
        host, event = self.rows.gather(rows)
        sizes = [blocks[j][1] - blocks[j][0] for j in todo]
        self._jobs.put_nowait(([keys[j] for j in todo], sizes, host, event))
        for j in todo:
            self._remember(keys[j])
        self._count(saved_blocks=len(todo), saved_bytes=nbytes)
        return len(todo)

    def close(self) -> None:
        """Stop the writer thread once it has sent what is queued, then close the store client
        (the tier, its KV pool included, is then free to go; a ZMQ context left to the garbage
        collector can block whichever thread collects it)."""
        self._jobs.put(None)
        self._writer.join()
        self.client.close()

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            keys, sizes, host, event = job
            try:
                self._write(keys, sizes, host, event)
            finally:
                with self._lock:
                    self._queued_bytes -= host.nbytes  # what _save reserved for it

    def _write(self, keys: list[str], sizes: list[int], host: torch.Tensor, event: Any) -> None:
        if event is not None:
            event.synchronize()  # the gather ran; waits without the GIL
        # one view of the rows, sliced without torch: a torch op per block would give up the GIL
        # and wait to get it back beside the busy scheduler thread, a wait per block
        flat = memoryview(host.view(len(host), -1).view(torch.uint8).numpy())
        items, lo = [], 0
        for key, size in zip(keys, sizes, strict=True):
            items.append((key, flat[lo : lo + size].cast("B")))
            lo += size
        try:
            self.client.batch_set(items)
            failed = set(self.client.last_failed)
        except Exception:  # noqa: BLE001 - a store problem must never reach the scheduler
            logger.exception("span store: put failed")
            failed = set(keys)
        self._forget(failed)  # not stored: a later save may try again
        if failed:
            self._count(failed_blocks=len(failed))
            self._warn(f"span store: {len(failed)} blocks were not stored (server down, "
                       "full, or a wrong PTStore token)")

    def _warn(self, message: str) -> None:
        """Log ``message`` at most once per ``RETRY_AFTER_S``."""
        now = time.monotonic()
        if now >= self._warned_at + self.RETRY_AFTER_S:
            self._warned_at = now
            logger.warning(message)

    def _remember(self, key: str) -> None:
        with self._lock:
            self.known[key] = None
            self.known.move_to_end(key)
            if len(self.known) > self.KNOWN_BLOCKS:
                self.known.popitem(last=False)

    def _forget(self, keys) -> None:
        with self._lock:
            for k in keys:
                self.known.pop(k, None)

    def _is_known(self, key: str) -> bool:
        with self._lock:
            return key in self.known

    # ---- loading ---------------------------------------------------------------------------
    def load(self, ids: Sequence[int], namespace: str | None, start: int, end: int,
             first_position: int) -> bool:
        """Bring the blocks of key ``ids[start:end]`` in ``namespace`` that the tree lacks in
        from the store; True when the whole key is cached afterwards. All or nothing: a partial
        hit loads nothing (the unit's prefill recomputes the span anyway). Never raises.
        ``first_position``: where the unit computed the key's first token."""
        if time.monotonic() < self.skip_loads_until or (end - start) % self.page_size:
            return False
        try:
            return self._load(ids, namespace, start, end, first_position)
        except Exception:  # noqa: BLE001 - a store problem is a miss, never an error
            logger.exception("span store: load failed")
            return False

    def _load(self, ids: Sequence[int], namespace: str | None, start: int, end: int,
              first_position: int) -> bool:
        key = RadixKey(ids[start:end], namespace)
        match = RadixCache.match_prefix(self.cache, MatchPrefixParams(key=key))
        have = matched_indices(self.cache, match)
        if len(have) == end - start:
            return True
        done = len(have) // self.block_tokens  # whole blocks the tree holds
        keys = block_keys(ids[start:end], namespace, self.block_tokens, self.tag)[done:]
        found = self.client.batch_exists(keys)
        if self.client.last_failed:
            self._back_off("a store server did not answer")
        if not all(found):
            # evicted or lost by the store: the next save must send them again
            self._forget(k for k, f in zip(keys, found, strict=True) if not f)
            self._count(missed_units=1)
            return False
        first = done * self.block_tokens
        host = self.rows.host(end - start - first)
        flat = host.view(len(host), -1).view(torch.uint8)
        views = [memoryview(flat[lo - first : hi - first].numpy()).cast("B")
                 for lo, hi in self._blocks(end - start)[done:]]
        if not all(self.client.batch_get_into(keys, views)):
            self._back_off("stored blocks could not be read")
            return False
        node = match.last_device_node
        self.cache.inc_lock_ref(node)
        try:  # the matched part is locked: making room must not evict it
            rows = self._alloc(len(host))
            if rows is None:
                return False
            try:
                self.rows.scatter(host, rows)
                stored_positions.record_run(rows, first_position + first)
                values = torch.cat([have[:first], rows.to(device=have.device, dtype=have.dtype)])
                prefix = self.cache.insert(InsertParams(key=key, value=values)).prefix_len
            except Exception:
                self.cache.token_to_kv_pool_allocator.free(rows)
                raise
        finally:
            self.cache.dec_lock_ref(node)
        dup = prefix - first  # tokens the tree held past the whole blocks: their slots go back
        if dup > 0:
            self.cache.token_to_kv_pool_allocator.free(rows[:dup])
        for k in keys:
            self._remember(k)
        self._count(loaded_units=1, loaded_tokens=len(host))
        return True

    def _back_off(self, why: str) -> None:
        self.skip_loads_until = time.monotonic() + self.RETRY_AFTER_S
        logger.warning("span store: %s; span units are prefilled for the next %.0f s", why,
                       self.RETRY_AFTER_S)

    def _alloc(self, n: int) -> torch.Tensor | None:
        allocator = self.cache.token_to_kv_pool_allocator
        rows = allocator.alloc(n)
        if rows is None and allocator.available_size() + self.cache.evictable_size() >= n:
            self.cache.evict(EvictParams(num_tokens=n))
            rows = allocator.alloc(n)
        return rows


def create_span_store(cache: RadixCache, model: str, tp_size: int = 1,
                      pp_size: int = 1, counters: Counters | None = None
                      ) -> SpanStoreTier | None:
    """The tier configured by ``SGLANG_PIC_SPAN_STORE``, or None when it is not set. Refuses
    tensor / pipeline parallelism: every rank would decide on its own whether a span loads, and
    ranks that disagree run different batches (HiCache all-reduces its hit counts for this)."""
    cfg = config_from_env()
    if cfg is None:
        return None
    if tp_size > 1 or pp_size > 1:
        raise ValueError("span pages in PTStore (--ptstore with --enable-span-cache) need "
                         f"--tp-size 1 and --pp-size 1, got {tp_size} and {pp_size}")
    from sglang_pic.store.auth import SERVE_TOKEN_ENV, client_token
    from sglang_pic.store.client import StoreClient

    client = StoreClient(list(cfg.servers), token=client_token(None, SERVE_TOKEN_ENV),
                         server_key=cfg.server_key, timeout_ms=cfg.timeout_ms, shm=False)
    tier = SpanStoreTier(cache, client, model, counters=counters)
    logger.info("span store: span blocks go to PTStore %s (%d tokens, %d B per block)",
                list(cfg.servers), tier.block_tokens,
                tier.block_bytes)
    return tier
