"""Span-cache settings, read from the environment so every SGLang process sees the same values.

`sglang-pic serve` turns its flags (`--enable-span-cache`, `--span-schedule`, `--span-pad-token-id`,
`--span-markers`, `--span-recompute-tokens`) into these variables before SGLang starts its
tokenizer and scheduler processes, which inherit them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

BACKEND = "pic_span"
"""Name of our radix-cache backend (`--radix-cache-backend pic_span`)."""

SCHEDULES = ("isps", "barrier")


@dataclass(frozen=True)
class SpanConfig:
    ssep_marker: str = "<|ssep|>"
    """Starts an independent span: a new hash chain, computed as if it stood alone."""
    pdep_marker: str = "<|pdep|>"
    """Starts a dependent segment: its pages depend on the whole prompt before it."""
    pad_token_id: int | None = None
    """Token that pads each segment to a page boundary (None: the tokenizer's pad, else eos)."""
    schedule: str = "isps"
    """`isps`: span prefills interleave with everything else; `barrier`: final prompts wait until
    no span prefill is pending."""
    recompute_tokens: int = 0
    """EPIC-style link recompute: the first k tokens of every span are recomputed in context."""

    @property
    def markers(self) -> tuple[str, str]:
        return (self.ssep_marker, self.pdep_marker)


def load() -> SpanConfig:
    markers = os.environ.get("SGLANG_PIC_SPAN_MARKERS", "")
    ssep, pdep = (markers.split(",", 1) + [""])[:2] if markers else ("", "")
    pad = os.environ.get("SGLANG_PIC_SPAN_PAD_TOKEN_ID", "")
    schedule = os.environ.get("SGLANG_PIC_SPAN_SCHEDULE", "isps")
    if schedule not in SCHEDULES:
        raise ValueError(f"SGLANG_PIC_SPAN_SCHEDULE must be one of {SCHEDULES}, got {schedule!r}")
    recompute = int(os.environ.get("SGLANG_PIC_SPAN_RECOMPUTE_TOKENS", "0") or 0)
    if recompute < 0:
        raise ValueError(f"--span-recompute-tokens must be >= 0, got {recompute}")
    defaults = SpanConfig()
    return SpanConfig(
        ssep_marker=ssep or defaults.ssep_marker,
        pdep_marker=pdep or defaults.pdep_marker,
        pad_token_id=int(pad) if pad else None,
        schedule=schedule,
        recompute_tokens=recompute,
    )
