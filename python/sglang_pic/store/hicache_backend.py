"""PTStore as SGLang's HiCache L3 tier, through HiCache's ``dynamic`` storage backend.

    sglang-pic serve --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "ptstore",
        "module_path": "sglang_pic.store.hicache_backend", "class_name": "PTStoreHiCacheStorage",
        "servers": ["tcp://node1:7400", "tcp://node2:7400"]}'

The token is not in the extra config (SGLang returns that from ``/get_server_info`` and logs it):
it comes from ``$SGLANG_PIC_PTSTORE_TOKEN``, which ``sglang-pic serve`` sets from
``--ptstore-token-file`` and SGLang's scheduler processes inherit. ``"server_key"`` (public)
names the servers' key when it is not derived from this token (a server with several tenants).

SGLang's cache controller hands us pages of the host KV pool keyed by its chained page hashes
(``get_hash_str``: equal key = equal prefix up to that page), which is exactly PTStore's tensor
id: a prefix shared by many prompts is stored once, wherever it was computed. Keys get a
model/rank suffix so different models or TP ranks never share pages.

Two interfaces, as SGLang's controller chooses:

* ``"interface_v1": 1`` in the extra config (what ``sglang-pic serve --ptstore`` sets): **zero
  copy**. ``batch_set_v1`` / ``batch_get_v1`` get host-pool indices; the pool's
  ``get_page_buffer_meta`` names the memory of each page (K and V of a page for the
  ``page_first`` layout; one block per layer and K/V for ``layer_first``), which zmq sends
  without a copy and into which received pages are copied once, straight from the socket buffer.
  Each block is one store tensor ``<page hash>@<model>@tp<r>of<n>#<block>``. With the host pool
  in shared memory (``"allocator": "shm"``, which ``--ptstore`` also sets: SGLang's
  ``ShmHostTensorAllocator`` puts it in a memfd), store servers on this node write loaded pages
  straight into their host-pool slots and verify them there: this process copies and hashes
  nothing.
* otherwise the page-copy interface (``batch_get`` / ``batch_set``): SGLang hands flat page
  tensors, which costs a copy on each side.

Where loaded pages travel (``"data_plane"``, ``client.StoreClient``): ``"auto"`` (default) - store
servers on this node write them into the host pool (or a staging segment), the others send them
over ``"data_streams"`` (default 4) parallel TCP connections per server, received straight into
the host-pool slots and verified there (``datapath``); ``"tcp"`` - every server over TCP, no
shared memory; ``"shm"`` - shared memory on this node, the zmq socket otherwise; ``"zmq"`` - the
socket only. ``"data_tls": true`` takes TLS streams only (servers without a certificate answer
over the CURVE socket). SGLang asks ``batch_exists`` before it prefetches anything: a prefix the
store lacks costs one small ``exists`` round trip to the owner of its first page
(``client.leading_found``), and no page moves.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import time
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from sglang_pic.launcher.server_flags import setting

from .auth import SERVE_TOKEN_ENV, client_token
from .client import StoreClient
from .config import PTStoreConfig
from .shm import address_of
from .trace import trace

logger = logging.getLogger(__name__)
TRACE = bool(setting("--ptstore-trace"))  # log each lookup, load and store


def _traced(method):
    """With ``SGLANG_PIC_STORE_TRACE=1``: one stderr line per call (wall clock, duration, pages,
    hits: pages found, loaded or - for ``batch_set_v1`` - stored), to see how much of a load's
    time-to-first-token PTStore itself takes, and which write-backs failed or were slow."""
    if not TRACE:
        return method

    @functools.wraps(method)
    def timed(self, keys, *args, **kwargs):
        t0 = time.time()
        out = method(self, keys, *args, **kwargs)
        hits = out if isinstance(out, int) else sum(map(bool, out))
        trace(method.__name__, t0, f"{len(keys)} pages, {hits} hits, "
              f"{1000 * (time.time() - t0):.1f} ms")
        return out

    return timed


def _never_raise(failure):
    """SGLang calls the backend from its cache controller's threads, whose loops do not survive
    an exception (a dead prefetch thread hangs every later prefetch): a failure becomes a miss
    or a failed write, and is logged. ``failure(keys)`` builds the result."""

    def wrap(method):
        @functools.wraps(method)
        def guarded(self, keys, *args, **kwargs):
            try:
                return method(self, keys, *args, **kwargs)
            except Exception:
                logger.exception("PTStore %s failed; treated as a miss/failed write",
                                 method.__name__)
                return failure(keys)

        return guarded

    return wrap


class PTStoreHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        config = PTStoreConfig.from_extra(storage_config.extra_config)
        self.client = StoreClient(list(config.servers), client_token(None, SERVE_TOKEN_ENV),
                                  server_key=config.server_key, timeout_ms=config.timeout_ms,
                                  local=config.local, replicate_after=config.replicate_after,
                                  shm=config.shm, shm_bytes=int(config.shm_mb * (1 << 20)),
                                  data_plane=config.data_plane,
                                  data_streams=config.data_streams, data_tls=config.data_tls)
        self.client.prepare_shm()  # a no-op with "shm": false
        if config.gil_switch_ms is not None:
            self._set_switch_interval(config.gil_switch_ms)
        model = "-".join((storage_config.model_name or "").split("/"))
        self.suffix = f"@{model}"
        if not storage_config.is_mla_model:
            self.suffix += f"@tp{storage_config.tp_rank}of{storage_config.tp_size}"
        self.zero_copy = config.interface_v1
        self.blocks = 1  # memory blocks per page in the host pool (zero copy)
        self.stats = {"get_pages": 0, "get_hits": 0, "set_pages": 0, "set_bytes": 0}

    @staticmethod
    def _set_switch_interval(ms: float) -> None:
        """Opt-in (``"gil_switch_ms"``): the scheduler's main thread holds the GIL most of the
        time, and every hand-off to a HiCache thread (a load's replies, SGLang's own prefetch
        and write-back steps) waits up to the interpreter's switch interval, 5 ms by default;
        a shorter one hands the GIL over sooner. It is a setting of the whole scheduler
        process, hence not on by default."""
        if not 0.05 <= ms <= 5.0:
            raise ValueError(f"gil_switch_ms must be within [0.05, 5], got {ms}")
        sys.setswitchinterval(ms / 1000)
        logger.info("PTStore: interpreter switch interval set to %.2f ms", ms)

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.zero_copy:
            page = torch.arange(mem_pool_host.page_size, dtype=torch.int64)
            self.blocks = len(mem_pool_host.get_page_buffer_meta(page)[0])
            self._share_pool(mem_pool_host)

    def _share_pool(self, mem_pool_host) -> None:
        """Let same-node servers write into the host pool when SGLang put it in one memfd
        (``ShmHostTensorAllocator``: ``allocator.fds`` / ``allocator.mms``)."""
        alloc = getattr(mem_pool_host, "allocator", None)
        fds, mms = getattr(alloc, "fds", None), getattr(alloc, "mms", None)
        if not (self.client.same_node.enabled and fds and mms and len(fds) == len(mms) == 1):
            return
        try:
            self.client.use_pool(fds[0], address_of(mms[0]), len(mms[0]))
        except Exception:  # never fail SGLang's start-up for a faster path: staging still works
            logger.exception("PTStore: the host pool cannot be shared; loads use staging")
            return
        logger.info("PTStore: same-node servers write into the host pool (%d of %d servers map "
                    "it)", sum(self.client.same_node.pool_ok.values()), len(self.client.servers))

    def _ids(self, keys: list[str]) -> list[str]:
        if not self.zero_copy:
            return [k + self.suffix for k in keys]
        return [f"{k}{self.suffix}#{j}" for k in keys for j in range(self.blocks)]

    def _page_ids(self, keys: list[str]) -> list[str]:
        """One id per page: the page-copy interface (also used in zero-copy mode by SGLang's
        draft-model path) stores flat pages, not host-pool blocks."""
        return [k + self.suffix for k in keys]

    def _page_buffers(self, host_indices: torch.Tensor) -> tuple[list[memoryview], list[int]]:
        """The host pool's memory of the pages at ``host_indices``, as writable byte views
        (``blocks`` per page, in ``_ids`` order), and their addresses."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        return [memoryview((ctypes.c_char * n).from_address(p)).cast("B")
                for p, n in zip(ptrs, sizes, strict=True)], list(ptrs)

    def _per_page(self, ok: list[bool]) -> list[bool]:
        b = self.blocks
        return [all(ok[i:i + b]) for i in range(0, len(ok), b)]

    # ---- what SGLang's cache controller calls -------------------------------------------
    @_traced
    @_never_raise(lambda keys: 0)
    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        # a page's blocks are contiguous in _ids: whole pages are the leading ids // blocks
        return self.client.leading_found(self._ids(keys)) // self.blocks

    @_never_raise(lambda keys: [None] * len(keys))
    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        data = self.client.batch_get(self._page_ids(keys))
        out: list[torch.Tensor | None] = []
        targets = target_locations or [None] * len(keys)
        for blob, target in zip(data, targets, strict=True):
            if blob is None or target is None:
                out.append(None)
                continue
            flat = target.view(torch.uint8)
            if len(blob) != flat.numel():  # a page of another shape: treat as a miss
                out.append(None)
                continue
            flat.numpy()[:] = np.frombuffer(blob, dtype=np.uint8)  # one copy, into the page
            out.append(target)
        self.stats["get_pages"] += len(keys)
        self.stats["get_hits"] += sum(o is not None for o in out)
        return out

    @_never_raise(lambda keys: False)
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        items = [(tid, v.contiguous().view(torch.uint8).numpy().tobytes())
                 for tid, v in zip(self._page_ids(keys), values, strict=True)]
        added = self.client.batch_set(items)
        self.stats["set_pages"] += len(items)
        self.stats["set_bytes"] += added
        return not self.client.last_failed

    @_traced
    @_never_raise(lambda keys: [False] * len(keys))
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info=None) -> list[bool]:
        ok = self._per_page(self.client.batch_get_into(self._ids(keys),
                                                       *self._page_buffers(host_indices)))
        self.stats["get_pages"] += len(keys)
        self.stats["get_hits"] += sum(ok)
        return ok

    @_traced
    @_never_raise(lambda keys: [False] * len(keys))
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info=None) -> list[bool]:
        ids = self._ids(keys)
        added = self.client.batch_set(list(zip(ids, self._page_buffers(host_indices)[0],
                                               strict=True)))
        failed = set(self.client.last_failed)
        self.stats["set_pages"] += len(keys)
        self.stats["set_bytes"] += added
        return self._per_page([t not in failed for t in ids])

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get_stats(self):
        return dict(self.stats)

    def close(self) -> None:
        self.client.close()
