"""Span pages in PTStore: a span computed by one instance is loaded by another, at any offset.

HiCache does not combine with the span cache (its host and storage tiers key pages by SGLang's
token-prefix hash chain, which cannot name a span reused at another offset), so span units get their own
path to the store, keyed by **span-aware page hashes**:

* a segment's pages chain from a root made of the model tag and the segment's radix namespace, so
  an independent span (SSEP: the request's base namespace, a chain of its own) gets the same
  page keys whatever precedes it, and a dependent piece (PDEP: a namespace digesting everything
  before it) gets keys that change with the whole preceding prompt;
* the model tag names what the bytes mean (model, KV dtype, layers, heads, head dim, page size,
  TP rank, and the key layout: rotated where computed), so another model or layout never reads
  them.

A loaded page's keys were rotated where the unit computed them: from 0 for an independent span
(computed alone), from the segment's offset for a dependent piece; ``load`` records those
positions for the slots it fills (``position_free.stored_positions``).

A page is ``[layers, 2 (K, V), page_size, kv_heads, head_dim]`` of the KV pool's dtype, copied out
of the pool when a span unit's prefill has been cached (``SpanPlanner._finish_unit``) and sent by a
background thread (the scheduler only pays the gather); before a span unit is prefilled
(``SpanPlanner._plan``) its remaining pages are looked up and, when every one is stored, loaded
into freshly allocated pool slots and inserted into the radix tree, so no prefill runs. Checksums
are checked on every page (``StoreClient``); any failure is a miss and the unit is prefilled.

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
from sglang_pic.position_free import stored_positions

if TYPE_CHECKING:
    from sglang_pic.store.client import StoreClient
    from sglang_pic.store.config import PTStoreConfig

logger = logging.getLogger(__name__)

ENV = "SGLANG_PIC_SPAN_STORE"
KEY_PREFIX = "span-"


def page_keys(tokens: Sequence[int], namespace: str | None, page_size: int, tag: str) -> list[str]:
    """Store ids of the full pages of a segment's key ``tokens`` in radix ``namespace``."""
    h = hashlib.blake2b(f"{tag}\x1f{namespace or ''}".encode(), digest_size=16).digest()
    keys = []
    for j in range(len(tokens) // page_size):
        page = array("q", tokens[j * page_size : (j + 1) * page_size]).tobytes()
        h = hashlib.blake2b(h + page, digest_size=16).digest()
        keys.append(KEY_PREFIX + h.hex())
    return keys


MAX_PAGE_BYTES = 64 << 20
"""A page must fit the store server's tensor limit (``protocol.Limits``)."""
PUT_CHUNK_BYTES = 256 << 20
"""Pages per put message are capped at this many bytes (the server caps messages at 1 GiB)."""
QUEUED_SAVES = 8
"""Span units waiting for the writer thread; beyond that a save is dropped (the store is slow or
down, and each waiting unit holds a host copy of its KV)."""


def unsupported_pool(pool: Any) -> str | None:
    """Why the tier cannot copy pages of ``pool`` token row by token row (None: it can)."""
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


class SpanStoreTier:
    """Saves span units' pages to PTStore and loads them back into the KV pool.

    ``cache``: the ``SpanRadixCache`` (its allocator, KV pool and tree); ``client``: a
    ``StoreClient``. Only the scheduler thread calls ``save`` and ``load``; the writer thread
    only sends bytes it was handed."""

    KNOWN_PAGES = 1 << 18
    """Bound on the page ids remembered as stored (skipped by ``save``)."""
    RETRY_AFTER_S = 10.0
    """After a lookup a store server did not answer (each costs the client's time-out on the
    scheduler thread), loads are skipped - units are prefilled - for this long."""

    def __init__(self, cache: RadixCache, client: StoreClient, model: str):
        self.cache = cache
        self.client = client
        self.page_size = cache.page_size
        pool = cache.token_to_kv_pool_allocator.get_kvcache()
        problem = unsupported_pool(pool)
        if problem:
            raise ValueError(f"span pages in PTStore: {problem}")
        self.pool = pool
        self.layers = len(pool.k_buffer)
        k = pool.k_buffer[0]
        self.page_shape = (self.layers, 2, self.page_size, *k.shape[1:])
        self.dtype = k.dtype
        self.page_bytes = k.element_size() * self.page_size * 2 * self.layers * k[0].numel()
        if self.page_bytes > MAX_PAGE_BYTES:
            raise ValueError(f"span pages in PTStore: a page is {self.page_bytes} B, over the "
                             f"store's {MAX_PAGE_BYTES} B tensor limit (use a smaller page size)")
        self.tag = (f"{model}|{pool.dtype}/{k.dtype}|layers{getattr(pool, 'start_layer', 0)}+"
                    f"{self.layers}|{tuple(k.shape[1:])}|P{self.page_size}|tp0of1"
                    "|keys-rotated-where-computed")
        self.known: OrderedDict[str, None] = OrderedDict()
        self.skip_loads_until = 0.0
        self._warned_at = float("-inf")
        self._lock = threading.Lock()
        self._jobs: Queue[tuple[list[str], torch.Tensor]] = Queue(QUEUED_SAVES)
        self._writer = threading.Thread(target=self._write_loop, name="span-store-writer",
                                        daemon=True)
        self._writer.start()

    # ---- saving ----------------------------------------------------------------------------
    def save(self, ids: Sequence[int], namespace: str | None, start: int, end: int) -> int:
        """Queue the cached pages of key ``ids[start:end]`` in ``namespace`` for the store;
        returns how many pages were queued (pages known to be stored are skipped). Never raises:
        it runs inside the scheduler's ``cache_finished_req``."""
        try:
            return self._save(ids, namespace, start, end)
        except Exception:  # noqa: BLE001 - the store is an optimisation, never a failure
            logger.exception("span store: save failed")
            return 0

    def _save(self, ids: Sequence[int], namespace: str | None, start: int, end: int) -> int:
        keys = page_keys(ids[start:end], namespace, self.page_size, self.tag)
        if not keys or self._jobs.full():
            if keys:
                self._warn("span store: the writer is behind; a span unit is not saved")
            return 0
        got = RadixCache.match_prefix(
            self.cache,
            MatchPrefixParams(key=RadixKey(ids[start : start + len(keys) * self.page_size],
                                           namespace)),
        ).device_indices
        n = min(len(keys), len(got) // self.page_size)
        todo = [j for j in range(n) if not self._is_known(keys[j])]
        if not todo:
            return 0
        rows = torch.cat([got[j * self.page_size : (j + 1) * self.page_size] for j in todo])
        self._jobs.put_nowait(([keys[j] for j in todo], self._gather(rows)))
        for j in todo:
            self._remember(keys[j])
        return len(todo)

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """``[pages, layers, 2, page, heads, dim]`` host copy of the pool rows ``rows``."""
        n = len(rows) // self.page_size
        rows = rows.to(self.pool.k_buffer[0].device)
        out = torch.empty((n, *self.page_shape), dtype=self.dtype, device="cpu")
        for layer in range(self.layers):
            for kv, buf in enumerate((self.pool.k_buffer, self.pool.v_buffer)):
                out[:, layer, kv] = buf[layer][rows].view(n, self.page_size,
                                                          *self.page_shape[3:]).cpu()
        return out

    def _write_loop(self) -> None:
        per_put = max(1, PUT_CHUNK_BYTES // self.page_bytes)
        while True:
            keys, pages = self._jobs.get()
            failed: set[str] = set()
            flat = pages.view(len(keys), -1).view(torch.uint8)
            for lo in range(0, len(keys), per_put):
                chunk = keys[lo : lo + per_put]
                try:
                    self.client.batch_set([(k, memoryview(flat[lo + i].numpy()))
                                           for i, k in enumerate(chunk)])
                    failed |= set(self.client.last_failed)
                except Exception:  # noqa: BLE001 - a store problem must never reach the scheduler
                    logger.exception("span store: put failed")
                    failed |= set(chunk)
            self._forget(failed)  # not stored: a later save may try again
            if failed:
                self._warn(f"span store: {len(failed)} pages were not stored (server down, "
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
            if len(self.known) > self.KNOWN_PAGES:
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
        """Bring the pages of key ``ids[start:end]`` in ``namespace`` that the tree lacks in from
        the store; True when the whole key is cached afterwards. All or nothing: a partial hit
        loads nothing (the unit's prefill recomputes the span anyway). Never raises.
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
        have = match.device_indices
        done = len(have) // self.page_size
        keys = page_keys(ids[start:end], namespace, self.page_size, self.tag)[done:]
        if not keys:
            return len(have) == end - start
        found = self.client.batch_exists(keys)
        if self.client.last_failed:
            self._back_off("a store server did not answer")
        if not all(found):
            # evicted or lost by the store: the next save must send them again
            self._forget(k for k, f in zip(keys, found, strict=True) if not f)
            return False
        pages = torch.empty((len(keys), *self.page_shape), dtype=self.dtype)
        flat = pages.view(len(keys), -1).view(torch.uint8)
        if not all(self.client.batch_get_into(keys, [memoryview(flat[i].numpy())
                                                     for i in range(len(keys))])):
            self._back_off("stored pages could not be read")
            return False
        node = match.last_device_node
        self.cache.inc_lock_ref(node)
        try:  # the matched part is locked: making room must not evict it
            rows = self._alloc(len(keys) * self.page_size)
            if rows is None:
                return False
            try:
                self._scatter(pages, rows)
                stored_positions.record_run(rows, first_position + done * self.page_size)
                values = torch.cat([have[: done * self.page_size],
                                    rows.to(device=have.device, dtype=have.dtype)])
                prefix = self.cache.insert(InsertParams(key=key, value=values)).prefix_len
            except Exception:
                self.cache.token_to_kv_pool_allocator.free(rows)
                raise
        finally:
            self.cache.dec_lock_ref(node)
        dup = prefix - done * self.page_size  # pages the tree gained meanwhile (none: one thread)
        if dup > 0:
            self.cache.token_to_kv_pool_allocator.free(rows[:dup])
        for k in keys:
            self._remember(k)
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

    def _scatter(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``pages`` (host) into the pool rows ``rows``, one layer's K or V at a time (the
        device never holds more than one layer's share of the span beside the pool)."""
        device = self.pool.k_buffer[0].device
        rows = rows.to(device)
        n = len(pages)
        for layer in range(self.layers):
            for kv, buf in enumerate((self.pool.k_buffer, self.pool.v_buffer)):
                src = pages[:, layer, kv].reshape(n * self.page_size, *self.page_shape[3:])
                buf[layer][rows] = src.to(device, non_blocking=False)


def create_span_store(cache: RadixCache, model: str, tp_size: int = 1,
                      pp_size: int = 1) -> SpanStoreTier | None:
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
    tier = SpanStoreTier(cache, client, model)
    logger.info("span store: span pages go to PTStore %s (%d B per page)", list(cfg.servers),
                tier.page_bytes)
    return tier
