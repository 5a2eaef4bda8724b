"""Token types of a served prompt, from the chat template's role headers.

SAECache weighs blocks by token type (system prompt, user turn, assistant turn, tool output,
chain-of-thought, decode). In the server the radix cache sees token ids only, so the types are
recovered from the prompt the chat template produced: each role header (``<|im_start|>system`` in
ChatML - Qwen, SmolLM -, ``<|start_header_id|>system<|end_header_id|>`` in Llama 3) opens a
segment of that role; ``<think>`` ... ``</think>`` inside an assistant turn is chain-of-thought.
Headers are matched as token sequences of the server's own tokenizer; a template with none of
these markers leaves the whole prompt ``user`` (the previous default).

Application type and session come from the request when the client gives them
(``sampling_params.custom_params``: ``{"app_type": "chat"|"agent"|"single", "session_id": ...}``,
also through the OpenAI endpoints' ``custom_params``), else SGLang's ``session_id``, else inferred.
"""

from __future__ import annotations

from typing import Any

from .context import APP_TYPES

_HEADERS = {
    "system": ("<|im_start|>system", "<|start_header_id|>system<|end_header_id|>"),
    "user": ("<|im_start|>user", "<|start_header_id|>user<|end_header_id|>"),
    "assistant": ("<|im_start|>assistant", "<|start_header_id|>assistant<|end_header_id|>"),
    "tool": ("<|im_start|>tool", "<|start_header_id|>ipython<|end_header_id|>",
             "<|start_header_id|>tool<|end_header_id|>"),
    "cot": ("<think>",),
    "assistant-after-cot": ("</think>",),
}


class ChatSegmenter:
    """``segments(ids) -> [(start, token_type)]`` for one tokenizer (built once per scheduler)."""

    def __init__(self, tokenizer: Any):
        self.by_first: dict[int, list[tuple[tuple[int, ...], str]]] = {}
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        for role, strings in _HEADERS.items():
            for text in strings:
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                first = text.split(">", 1)[0] + ">"
                # role headers: only templates whose header starts with one special token of
                # this vocabulary; think tags also as plain text (not special in every model)
                if not ids or (role in ("system", "user", "assistant", "tool")
                               and vocab.get(first) != ids[0]):
                    continue
                kind = "assistant" if role == "assistant-after-cot" else role
                self.by_first.setdefault(ids[0], []).append((ids, kind))

    def segments(self, ids: Any) -> list[tuple[int, str]]:
        if not self.by_first:
            return [(0, "user")]
        out: list[tuple[int, str]] = [(0, "user")]
        n = len(ids)
        for i in range(n):
            cands = self.by_first.get(ids[i])
            if not cands:
                continue
            for seq, kind in cands:
                if tuple(ids[i : i + len(seq)]) == seq:
                    if out[-1][0] == i:
                        out[-1] = (i, kind)
                    elif out[-1][1] != kind:
                        out.append((i, kind))
                    break
        return out


_segmenters: dict[int, ChatSegmenter] = {}


def segments_for(req: Any) -> list[tuple[int, str]]:
    """Token-type segments of ``req``'s prompt (``user`` throughout without a tokenizer)."""
    tok = getattr(req, "tokenizer", None)
    if tok is None:
        return [(0, "user")]
    seg = _segmenters.get(id(tok))
    if seg is None:
        seg = _segmenters[id(tok)] = ChatSegmenter(tok)
    return seg.segments(req.origin_input_ids)


def client_hints(req: Any) -> tuple[str | None, str | None]:
    """``(session_id, app_type)`` the client put in ``custom_params`` (None when absent/invalid)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    session = params.get("session_id")
    app = params.get("app_type")
    return (str(session) if session is not None else None,
            app if app in APP_TYPES else None)
