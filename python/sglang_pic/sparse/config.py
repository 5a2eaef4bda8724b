"""Knobs of sparse decoding in SGLang, handed over in ``SGLANG_PIC_SPARSE_*`` variables.

``sglang-pic serve --sparse-decode pariskv --sparse-topk 100 ...`` checks the flags and sets the
variables in the launcher (``sglang_pic.launcher.server_flags``); SGLang's scheduler processes inherit the
environment, and the attention backend reads them when it is created. SGLang's own launcher takes
the same flags through our plugin; the Python ``Engine`` has no flags of ours and reads whatever
the variables say. Standard library only: the launcher imports this before SGLang.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields

from sglang_pic import environment

ENV_PREFIX = "SGLANG_PIC_SPARSE_"
HOST_MEMORY_SHARE = 0.9
"""Most of the available host memory the ``--sparse-offload`` region may take (the rest is
left to the processes around it)."""
MINIMUM = {"threshold": 0, "topk": 1, "candidates": 1, "sink": 0, "local": 1, "update": 1,
           "max_requests": 1, "max_context": 0, "offload": 0, "reselect_interval": 1,
           "vote_interval": 1}
"""The smallest value of each integer knob; the cross-knob ranges are in ``validate``."""
MAX_RESELECT_INTERVAL = 64
"""Most decode steps one selection (or one vote, ``vote_interval``) may serve: the window's
newest token is attended densely, but what the query needs from the retrieval region drifts as
the answer goes on."""
MAX_CANDIDATES = 32768
"""Most candidates a KV head may keep: the top-k kernel holds one head's candidates in one
program's registers and packs their counts 16 bits apart (``TOPK_PACKED_MAX_CP`` of
``sglang_pic_kernel.pariskv.select``; beyond it the kernel's compile alone takes minutes)."""


class SparseDecodeUnsupported(ValueError):
    """The model or a server setting cannot run with sparse decoding."""


@dataclass(frozen=True)
class SparseDecodeConfig:
    threshold: int = 32768
    """A request decodes sparsely once its context exceeds this many tokens; shorter ones decode
    densely (below ~32K the dense kernel is as fast, see docs/sparse-decode.md)."""
    topk: int = 100
    """Keys retrieved per KV head and step from the retrieval region."""
    candidates: int = 4096
    """Keys kept by collision voting for the 4-bit rerank (``C``)."""
    sink: int = 16
    """First tokens always attended (attention sinks)."""
    local: int = 512
    """Most recent tokens always attended."""
    update: int = 128
    """Tokens moved from the local window into the retrieval region at once."""
    max_requests: int = 4
    """Requests that can decode sparsely at the same time (the retrieval metadata of each is
    allocated at start-up, for ``max_context`` tokens)."""
    max_context: int = 0
    """Longest context a sparse request may reach; 0: the model's context length."""
    offload: int = 0
    """1: a sparse request's retrieval-region KV moves to pinned host memory and its GPU pool
    slots are freed (``--sparse-offload``, ``offload.py``); needs ``--disable-radix-cache``."""
    reselect_interval: int = 1
    """Decode steps one selection serves: with ``n > 1`` a request selects its keys at one step
    in ``n`` and attends the same retrieval-region rows (plus its dense window) at the steps
    between, as LServe's reusable page selector does (adjacent steps' queries are alike). A
    request also selects at its first step and whenever keys moved into its region."""
    vote_interval: int = 1
    """Decode steps one vote serves: with ``n > 1`` a request runs the collision votes (the
    pass over every key of its region, which grows with the context) at one step in ``n``, as
    ``reselect_interval`` does, but every step between reranks that vote's ``candidates``,
    moved on by a row a step, with its own query and takes its own top-k: only the vote is
    reused, not the selection. Same extra selections as ``reselect_interval`` (first step,
    keys entering the region); the two are not combined."""

    @classmethod
    def current(cls) -> SparseDecodeConfig:
        """``from_env()`` of this process, parsed once per distinct set of values (a hook that
        asks on every request reads the variables, not a new parse)."""
        return _parsed(cls, tuple(environment.read(cls.env_name(f.name)) for f in fields(cls)))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> SparseDecodeConfig:
        env = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            raw = environment.read(cls.env_name(f.name), env)
            if raw is None:
                continue
            try:
                values[f.name] = int(raw)
            except ValueError:
                raise SparseDecodeUnsupported(
                    f"{cls.env_name(f.name)}={raw!r} is not an integer") from None
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Refuse values no request could decode with, naming the flags that set them."""
        for name, lowest in MINIMUM.items():
            if getattr(self, name) < lowest:
                raise SparseDecodeUnsupported(
                    f"{self.flag(name)} must be >= {lowest}, got {getattr(self, name)}")
        if self.offload not in (0, 1):
            raise SparseDecodeUnsupported(f"sparse offload must be 0 or 1, got {self.offload}")
        if self.reselect_interval > MAX_RESELECT_INTERVAL:
            raise SparseDecodeUnsupported(
                f"{self.flag('reselect_interval')} must be <= {MAX_RESELECT_INTERVAL}, got "
                f"{self.reselect_interval}")
        if self.vote_interval > MAX_RESELECT_INTERVAL:
            raise SparseDecodeUnsupported(
                f"{self.flag('vote_interval')} must be <= {MAX_RESELECT_INTERVAL}, got "
                f"{self.vote_interval}")
        if self.vote_interval > 1 and self.reselect_interval > 1:
            raise SparseDecodeUnsupported(
                f"{self.flag('vote_interval')} and {self.flag('reselect_interval')} are "
                "alternatives: set one of them")
        if self.candidates > MAX_CANDIDATES:
            raise SparseDecodeUnsupported(
                f"{self.flag('candidates')} must be <= {MAX_CANDIDATES}, got {self.candidates}")
        if self.candidates < self.topk:
            raise SparseDecodeUnsupported(
                f"{self.flag('candidates')} ({self.candidates}) must be >= "
                f"{self.flag('topk')} ({self.topk})")
        if self.threshold < self.sink + self.local + self.update:
            raise SparseDecodeUnsupported(
                f"{self.flag('threshold')} ({self.threshold}) must be >= sink + local + update "
                f"({self.sink + self.local + self.update}): shorter contexts fit the dense "
                "window anyway")
        if self.max_context and self.max_context <= self.threshold:
            raise SparseDecodeUnsupported(
                f"{self.flag('max_context')} ({self.max_context}) must be over "
                f"{self.flag('threshold')} ({self.threshold}): nothing would decode sparsely")

    @property
    def attended(self) -> int:
        """Key slots a sparse request attends per KV head and step (sink, retrieved, window)."""
        return self.sink + self.topk + self.local + self.update

    @staticmethod
    def env_name(field: str) -> str:
        """The variable that sets ``field`` (``topk`` -> ``SGLANG_PIC_SPARSE_TOPK``)."""
        return ENV_PREFIX + field.upper()

    @staticmethod
    def flag(field: str) -> str:
        """The ``sglang-pic serve`` flag that sets ``field`` (``max_context`` ->
        ``--sparse-max-context``)."""
        return "--sparse-" + field.replace("_", "-")


def host_kv_bytes(layers: int, kv_heads: int, head_dim: int, itemsize: int, tokens: int) -> int:
    """Host memory for the K and V of ``tokens`` tokens over every layer (``--sparse-offload``
    keeps a sparse request's retrieval region there, token-major like SGLang's pool)."""
    return 2 * layers * kv_heads * head_dim * itemsize * tokens


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            raw = f.read().split()
    except OSError:
        return None
    return int(raw[0]) if raw and raw[0].isdigit() else None


def _stat(path: str, key: str) -> int:
    """``key``'s value in a cgroup ``memory.stat`` file (0 when absent)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


def host_memory_available(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> int:
    """Bytes of host memory this process can still take: the kernel's ``MemAvailable``, lowered
    to what the memory cgroup mounted at ``cgroup`` (a container's own: v2 ``memory.max``, or v1
    ``memory.limit_in_bytes``) leaves, since a container over its limit is killed whatever the
    host has free. The cgroup's usage counts its page cache; the inactive file pages are
    reclaimed before anything is killed, so they count as free (the working set, as container
    runtimes report it)."""
    available = None
    try:
        with open(f"{proc}/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file, usage_file, stat_file, inactive in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
             "memory/memory.stat", "total_inactive_file")):
        limit = _read_int(f"{cgroup}/{limit_file}")  # None for "max" (no limit) or no file
        if limit is None:
            continue
        usage = (_read_int(f"{cgroup}/{usage_file}") or 0) - _stat(f"{cgroup}/{stat_file}",
                                                                      inactive)
        available = min(available, max(0, limit - max(0, usage)))
    return available


@functools.lru_cache(maxsize=8)
def _parsed(cls: type[SparseDecodeConfig], values: tuple[str | None, ...]) -> SparseDecodeConfig:
    env = {cls.env_name(f.name): v for f, v in zip(fields(cls), values, strict=True)
           if v is not None}
    return cls.from_env(env)


# the variables of the fields and of --sparse-offload, readable through the registry in any
# process that imports this module (the launcher's flag table declares them too)
for _field in [*(f.name for f in fields(SparseDecodeConfig)), "offload"]:
    environment.declare(SparseDecodeConfig.env_name(_field), "sparse.config.SparseDecodeConfig")
