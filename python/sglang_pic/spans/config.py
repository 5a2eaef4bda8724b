"""Span-cache settings, read from the environment so every SGLang process sees the same values.

The launcher checks the flags (`--span-schedule`, `--span-pad-token-id`, `--span-markers`,
`--span-recompute-tokens`) and hands them over as `SGLANG_PIC_SPAN_*` variables before SGLang
starts its tokenizer and scheduler processes, which inherit them (`sglang_pic.launcher.server_flags`, which
also parses them back here). Standard library only: client programs import this (`sglang_pic.lang`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_pic.launcher.server_flags import setting

BACKEND = "pic_span"
"""Name of our radix-cache backend (`--radix-cache-backend pic_span`)."""


@dataclass(frozen=True)
class SpanConfig:
    ssep_marker: str = "<|ssep|>"
    """Starts an independent span: a new hash chain, computed as if it stood alone."""
    pdep_marker: str = "<|pdep|>"
    """Starts a dependent segment: its pages depend on the whole prompt before it."""
    pad_token_id: int | None = None
    """Token that pads each segment to a page boundary (None: the tokenizer's pad, else eos)."""
    schedule: str = "isps"
    """`isps`: span prefills interleave with everything else; `ready-first`: `isps`, with requests
    whose spans are cached batched ahead of waiting span prefills; `barrier`: final prompts wait
    until no span prefill is pending."""
    recompute_tokens: int = 0
    """EPIC-style link recompute: the first k tokens of every span are recomputed in context."""

    @property
    def markers(self) -> tuple[str, str]:
        return (self.ssep_marker, self.pdep_marker)


def load() -> SpanConfig:
    """The settings of this process (a bad variable raises ``ValueError`` naming it and its
    flag; the launcher has refused such values already)."""
    ssep, pdep = setting("--span-markers")
    return SpanConfig(
        ssep_marker=ssep,
        pdep_marker=pdep,
        pad_token_id=setting("--span-pad-token-id"),
        schedule=setting("--span-schedule"),
        recompute_tokens=setting("--span-recompute-tokens"),
    )
