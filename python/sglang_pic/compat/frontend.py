"""Seams in SGLang's frontend language (``sglang`` programs run by clients)."""

from __future__ import annotations

from .seam import Seam

TITLE = "Frontend language"

ROWS: tuple[Seam, ...] = (
    Seam("sglang.span", "sglang_pic.lang:span", "attribute", "frontend-dsl",
         why="`sgl.span` for frontend programs: the DSL's namespace, not a function to wrap"),
)
