"""The PTStore tier's settings, read from SGLang's HiCache storage extra config (JSON) strictly.

Why strict: the extra config is one JSON object that SGLang, its `dynamic` backend factory and
we all read. A key we do not know is refused, naming it and the keys we take (a misspelt
``"data_tsl": true`` would otherwise serve without TLS), and every value must have its JSON
type: ``"false"`` (a string) is not a boolean.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .datapath import MODES

SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name",  # the `dynamic` backend factory
    "interface_v1", "allocator",  # the host pool and the zero-copy interface
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",  # HiCache's prefetch policy
})
"""Keys SGLang itself reads from the same object: passed through, not ours to check."""


@dataclass(frozen=True)
class PTStoreConfig:
    """``servers``: store endpoints (``tcp://host:port``); ``server_key``: the servers' CURVE
    public key (None: plain TCP, loopback only); ``timeout_ms``: per request; ``local``: the
    endpoint on this node, if any; ``replicate_after``: reads of a page from a remote server
    before it is copied to ``local``; ``shm`` / ``shm_mb``: a shared-memory staging segment for
    same-node servers; ``data_plane``: how loaded pages travel (``datapath.MODES``);
    ``data_streams``: TCP streams per server; ``data_tls``: TLS streams only;
    ``gil_switch_ms``: the interpreter's switch interval while the tier runs (None: Python's);
    ``interface_v1``: the zero-copy interface (host-pool indices, not page tensors)."""

    servers: tuple[str, ...]
    server_key: str | None = None
    timeout_ms: int = 2000
    local: str | None = None
    replicate_after: int = 2
    shm: bool = True
    shm_mb: float = 256.0
    data_plane: str = "auto"
    data_streams: int = 4
    data_tls: bool = False
    gil_switch_ms: float | None = None
    interface_v1: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> PTStoreConfig:
        """Our settings from the extra config ``extra``; ``ValueError`` naming the key on a
        key neither we nor SGLang read, a value of the wrong type, or one out of range."""
        extra = dict(extra or {})
        if "token" in extra:
            raise ValueError("PTStore: no token in the extra config (/get_server_info shows "
                             "it): use sglang-pic serve --ptstore-token-file PATH or "
                             "$SGLANG_PIC_PTSTORE_TOKEN")
        ours = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - ours - SGLANG_KEYS)
        if unknown:
            raise ValueError(f"PTStore: unknown key(s) {unknown} in the storage extra config; "
                             f"PTStore takes {sorted(ours)}")
        servers = extra.get("servers")
        if (not isinstance(servers, list) or not servers
                or not all(isinstance(s, str) and s for s in servers)):
            raise ValueError("PTStore: the extra config needs a non-empty 'servers' list of "
                             "endpoints such as \"tcp://host:7400\"")
        values: dict[str, Any] = {"servers": tuple(servers)}
        for name, kind in (("server_key", str), ("local", str), ("data_plane", str),
                           ("timeout_ms", int), ("replicate_after", int),
                           ("data_streams", int), ("shm", bool), ("data_tls", bool),
                           ("interface_v1", bool), ("shm_mb", float),
                           ("gil_switch_ms", float)):
            if name in extra and extra[name] is not None:
                values[name] = _typed(name, extra[name], kind)
        config = cls(**values)
        config._check_ranges()
        return config

    def _check_ranges(self) -> None:
        if self.data_plane not in MODES:
            raise ValueError(f"PTStore: data_plane must be one of {', '.join(MODES)}, "
                             f"got {self.data_plane!r}")
        bounds = {"timeout_ms": (1, 600_000), "replicate_after": (1, 1 << 30),
                  "data_streams": (1, 64), "shm_mb": (1, 1 << 20)}
        for name, (lo, hi) in bounds.items():
            if not lo <= getattr(self, name) <= hi:
                raise ValueError(f"PTStore: {name} must be within {lo}..{hi}, "
                                 f"got {getattr(self, name)}")
        if self.gil_switch_ms is not None and not 0.05 <= self.gil_switch_ms <= 5.0:
            raise ValueError(f"PTStore: gil_switch_ms must be within [0.05, 5], "
                             f"got {self.gil_switch_ms}")


def _typed(name: str, value: Any, kind: type) -> Any:
    """``value`` as ``kind``, which its JSON type must already be (an integer passes for a
    float; 0 and 1 pass for a boolean, as SGLang's own ``interface_v1`` takes them)."""
    if kind is bool:
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, kind):
        return value
    raise ValueError(f"PTStore: {name} must be a JSON {kind.__name__}, got {value!r}")
