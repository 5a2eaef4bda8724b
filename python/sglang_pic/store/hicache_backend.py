"""PTStore as SGLang's HiCache L3 tier, through HiCache's ``dynamic`` storage backend.

    sglang-pic serve --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "ptstore",
        "module_path": "sglang_pic.store.hicache_backend", "class_name": "PTStoreHiCacheStorage",
        "servers": ["tcp://node1:7400", "tcp://node2:7400"], "token": "..."}'

SGLang's cache controller hands us pages of the host KV pool keyed by its chained page hashes
(``get_hash_str``: equal key = equal prefix up to that page), which is exactly PTStore's tensor
id: a prefix shared by many prompts is stored once, wherever it was computed. Keys get a
model/rank suffix so different models or TP ranks never share pages. This uses the page-copy
interface (``batch_get`` / ``batch_set`` / ``batch_exists``); the zero-copy ``interface_v1`` into
the host pool is the next step.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from .client import StoreClient

logger = logging.getLogger(__name__)


class PTStoreHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        extra = storage_config.extra_config or {}
        servers = extra.get("servers")
        if not servers or not isinstance(servers, list):
            raise ValueError("PTStore backend: extra_config needs 'servers': [endpoints]")
        self.client = StoreClient(servers, extra.get("token"),
                                  timeout_ms=int(extra.get("timeout_ms", 2000)),
                                  local=extra.get("local"),
                                  replicate_after=int(extra.get("replicate_after", 2)))
        model = "-".join((storage_config.model_name or "").split("/"))
        self.suffix = f"@{model}"
        if not storage_config.is_mla_model:
            self.suffix += f"@tp{storage_config.tp_rank}of{storage_config.tp_size}"
        self.stats = {"get_pages": 0, "get_hits": 0, "set_pages": 0, "set_bytes": 0}

    def _ids(self, keys: list[str]) -> list[str]:
        return [k + self.suffix for k in keys]

    # ---- what SGLang's cache controller calls -------------------------------------------
    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        found = self.client.batch_exists(self._ids(keys))
        for i, f in enumerate(found):
            if not f:
                return i
        return len(keys)

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        data = self.client.batch_get(self._ids(keys))
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

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        items = [(tid, v.contiguous().view(torch.uint8).numpy().tobytes())
                 for tid, v in zip(self._ids(keys), values, strict=True)]
        added = self.client.batch_set(items)
        self.stats["set_pages"] += len(items)
        self.stats["set_bytes"] += added
        return not self.client.last_failed

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
