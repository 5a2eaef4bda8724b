"""Knobs of sparse decoding in SGLang, read from ``SGLANG_PIC_SPARSE_*`` variables.

``sglang-pic serve --sparse-decode pariskv --sparse-topk 100 ...`` sets them in the launcher;
SGLang's scheduler processes inherit the environment, and the attention backend reads them when
it is created. A plain ``python -m sglang.launch_server --attention-backend pariskv_triton``
uses the defaults (or whatever the variables say).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

ENV_PREFIX = "SGLANG_PIC_SPARSE_"


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

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> SparseDecodeConfig:
        env = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            raw = env.get(cls.env_name(f.name))
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
        for name in ("topk", "candidates", "local", "update", "max_requests"):
            if getattr(self, name) < 1:
                raise SparseDecodeUnsupported(f"sparse {name} must be >= 1, got "
                                              f"{getattr(self, name)}")
        if self.offload not in (0, 1):
            raise SparseDecodeUnsupported(f"sparse offload must be 0 or 1, got {self.offload}")
        if self.sink < 0 or self.max_context < 0:
            raise SparseDecodeUnsupported("sparse sink and max_context must be >= 0")
        if self.candidates < self.topk:
            raise SparseDecodeUnsupported(
                f"sparse candidates ({self.candidates}) must be >= topk ({self.topk})")
        if self.threshold < self.sink + self.local + self.update:
            raise SparseDecodeUnsupported(
                f"sparse threshold ({self.threshold}) must be >= sink + local + update "
                f"({self.sink + self.local + self.update}): shorter contexts fit the dense "
                "window anyway")

    @property
    def attended(self) -> int:
        """Key slots a sparse request attends per KV head and step (sink, retrieved, window)."""
        return self.sink + self.topk + self.local + self.update

    @staticmethod
    def env_name(field: str) -> str:
        """The variable that sets ``field`` (``topk`` -> ``SGLANG_PIC_SPARSE_TOPK``)."""
        return ENV_PREFIX + field.upper()
