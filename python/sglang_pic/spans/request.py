"""Tokenizer-side span handling: markers become a padded prompt plus its piece layout.

Runs in SGLang's TokenizerManager (the HTTP server / `Engine` process), before tokenization:

* the marker strings are added to the tokenizer as special tokens, so any text path (``/generate``
  text, OpenAI completions, chat templates, the frontend DSL) tokenizes each piece on its own and
  the markers come out as single ids that never reach the model;
* in ``input_ids``, ``SSEP_ID`` (-1) and ``PDEP_ID`` (-2) are the markers (for clients that send
  token ids, e.g. ``skip_tokenizer_init``);
* the pieces are padded to page boundaries and the layout travels to the scheduler in
  ``sampling_params["custom_params"]["pic_spans"]`` (a flat int list: start, end, independent).

Bad input raises ``SpanError`` (a ValueError), which SGLang answers with HTTP 400.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from . import config as span_config
from .segments import SpanError, encode_pieces, pad_pieces, split_pieces

SSEP_ID = -1
"""Independent-span marker inside ``input_ids``."""
PDEP_ID = -2
"""Dependent-segment marker inside ``input_ids``."""
LAYOUT_KEY = "pic_spans"
"""``custom_params`` key carrying the padded layout to the scheduler."""
UNIT_RID_PREFIX = "pic-span-"
"""Request ids of internal span sub-requests (``planner.py``); never a client's."""


def add_marker_tokens(tokenizer: Any, cfg: span_config.SpanConfig) -> tuple[int, int]:
    """Register both markers as special tokens of ``tokenizer``; return their ids."""
    tokenizer.add_tokens(list(cfg.markers), special_tokens=True)
    ssep, pdep = (tokenizer.convert_tokens_to_ids(m) for m in cfg.markers)
    return int(ssep), int(pdep)


def span_cache_enabled(server_args: Any) -> bool:
    return getattr(server_args, "radix_cache_backend", None) == span_config.BACKEND


def pad_token_id(tokenizer: Any, cfg: span_config.SpanConfig) -> int:
    if cfg.pad_token_id is not None:
        return cfg.pad_token_id
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if isinstance(value, int):
            return value
    return 0


def layout_prompt(
    ids: Sequence[int],
    *,
    marker_ids: tuple[int, int],
    page_size: int,
    pad_id: int,
) -> tuple[list[int], list[int]] | None:
    """(padded ids, encoded layout) for a prompt with markers, or None when it has none."""
    ssep, pdep = marker_ids
    norm = [SSEP_ID if t == ssep else PDEP_ID if t == pdep else t for t in ids]
    if any(t < 0 and t != SSEP_ID and t != PDEP_ID for t in norm):
        raise SpanError("input_ids contain negative ids other than the span markers -1 and -2")
    pieces = split_pieces(norm, SSEP_ID, PDEP_ID)
    if pieces is None:
        return None
    padded, layout = pad_pieces(pieces, page_size, pad_id)
    return padded, encode_pieces(layout)


class SpanRequestResolver:
    """Turns span markers in a ``GenerateReqInput`` into padded ``input_ids`` + layout."""

    def __init__(self, tokenizer_manager: Any, cfg: span_config.SpanConfig | None = None):
        self.cfg = cfg or span_config.load()
        tm = tokenizer_manager
        self.enabled = span_cache_enabled(tm.server_args)
        self.page_size = max(1, int(getattr(tm.server_args, "page_size", 1) or 1))
        self.context_len = int(getattr(tm, "context_len", 0) or 0)
        self.tokenizer = getattr(tm, "tokenizer", None)
        self.marker_ids = (SSEP_ID, PDEP_ID)
        if self.enabled and self.tokenizer is not None:
            self.marker_ids = add_marker_tokens(self.tokenizer, self.cfg)
        self.pad_id = pad_token_id(self.tokenizer, self.cfg)

    def __call__(self, obj: Any) -> None:
        from sglang_pic.prompt_ids import forget_request_ranges  # server side only

        forget_request_ranges()  # nothing kept from an earlier request (request_id_range)
        params = obj.sampling_params
        for sp in params if isinstance(params, list) else [params]:
            if isinstance(sp, dict) and LAYOUT_KEY in (sp.get("custom_params") or {}):
                raise SpanError(f"custom_params.{LAYOUT_KEY} is set by the server, not by clients")
        if getattr(obj, "input_embeds", None) is not None:
            return
        text, input_ids = obj.text, obj.input_ids
        batched = isinstance(text, list) or (
            isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)
        )
        items = (text if isinstance(text, list) else input_ids) if batched else [text or input_ids]
        if items is None:
            return
        resolved = [self._resolve_one(item, owner=obj) for item in items]
        if all(r is None for r in resolved):
            return
        per_item = params if isinstance(params, list) else [params] * len(items)
        new_ids: list[list[int]] = []
        new_params: list[dict] = []
        for item, r, sp in zip(items, resolved, per_item, strict=True):
            sp = dict(sp or {})
            if r is None:
                new_ids.append(self._tokenize(item))
            else:
                ids, layout = r
                max_new = sp.get("max_new_tokens")
                total = len(ids) + (int(max_new) if isinstance(max_new, int) else 0)
                if self.context_len and total > self.context_len:
                    raise SpanError(
                        f"the spans exceed the context: {len(ids)} prompt tokens after page "
                        f"padding + {max_new or 0} new tokens > context length {self.context_len}"
                    )
                self._check_logprobs(obj, len(new_params), layout)
                custom = dict(sp.get("custom_params") or {})
                custom[LAYOUT_KEY] = layout
                sp["custom_params"] = custom
                new_ids.append(ids)
            new_params.append(sp)
        obj.text = None
        obj.input_ids = new_ids if batched else new_ids[0]
        obj.sampling_params = new_params if batched else new_params[0]

    @staticmethod
    def _check_logprobs(obj: Any, i: int, layout: list[int]) -> None:
        """Input logprobs inside the spans would make SGLang compute them in context."""

        def at(v: Any) -> Any:
            return v[i] if isinstance(v, list) else v

        start = at(getattr(obj, "logprob_start_len", None))
        if (
            at(getattr(obj, "return_logprob", False))
            and isinstance(start, int)
            and 0 <= start < layout[-3]
        ):
            raise SpanError(
                f"logprob_start_len {start} falls before the last dependent segment (token "
                f"{layout[-3]}): input logprobs are only available after the spans"
            )

    @property
    def _marker_set(self) -> frozenset[int]:
        return frozenset(self.marker_ids)

    def _may_hold_markers(self, item: list, owner: Any = None) -> bool:
        """False when ``item`` surely holds no marker and no negative id: its smallest id is not
        negative and its largest is below every marker token (added to the tokenizer, they come
        after its vocabulary). ``id_range``'s C pass instead of Python loops per token: every
        prompt on the server passes here, most of them plain. With ``owner`` (the request) the
        range is kept for ``check_generate_request``, which needs the same one right after
        (``request_id_range``: one pass per prompt, not two)."""
        from sglang_pic.prompt_ids import id_range, request_id_range  # server side only

        bounds = id_range(item) if owner is None else request_id_range(owner, item)
        if bounds is None:  # not all ints, or empty: the full checks decide
            return True
        markers = [t for t in self.marker_ids if t >= 0]
        return bounds[0] < 0 or (bool(markers) and bounds[1] >= min(markers))

    def _tokenize(self, item: Any) -> list[int]:
        if isinstance(item, str):
            if self.tokenizer is None:
                raise SpanError("text prompts need a tokenizer (skip_tokenizer_init is set)")
            return list(self.tokenizer(item)["input_ids"])
        return list(item)

    def _resolve_one(self, item: Any, owner: Any = None) -> tuple[list[int], list[int]] | None:
        if isinstance(item, str):
            if not any(m in item for m in self.cfg.markers):
                return None
            if not self.enabled:
                return None  # vanilla behaviour: marker strings are ordinary text
            ids = self._tokenize(item)
        elif isinstance(item, list):
            # other negative ids are not markers: the span-enabled path refuses them in
            # layout_prompt, request_validation refuses them everywhere
            if not self._may_hold_markers(item, owner):
                return None
            has_sentinel = SSEP_ID in item or PDEP_ID in item
            has_marker = self.enabled and not self._marker_set.isdisjoint(item)
            if not (has_sentinel or has_marker or (self.enabled and _has_negative(item))):
                return None
            ids = item
        else:
            return None
        if not self.enabled:
            raise SpanError(
                "span markers need the span cache: start the server with "
                "`sglang-pic serve --enable-span-cache` (or --radix-cache-backend pic_span)"
            )
        return layout_prompt(
            ids, marker_ids=self.marker_ids, page_size=self.page_size, pad_id=self.pad_id
        )


def _has_negative(ids: list[Any]) -> bool:
    return any(isinstance(t, int) and t < 0 for t in ids)


def accepted_marker_ids(tokenizer_manager: Any) -> frozenset[int]:
    """Ids that stand for span markers in ``input_ids`` on this server, outside the model's
    vocabulary: -1/-2 and the marker tokens added to the tokenizer; none without the span cache."""
    resolver = getattr(tokenizer_manager, "_pic_span_resolver", None)
    if resolver is None or not resolver.enabled:
        return frozenset()
    return frozenset((SSEP_ID, PDEP_ID, *resolver.marker_ids))


def install_resolver(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook for ``TokenizerManager.init_tokenizer_and_processor(self)``.

    Registers the markers with the tokenizer before any request (chat templates tokenize before
    ``generate_request`` is reached).
    """
    self._pic_span_resolver = SpanRequestResolver(self)


def resolve_generate_request(self: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook for ``TokenizerManager.generate_request(self, obj, request=None)``."""
    resolver = getattr(self, "_pic_span_resolver", None)
    if resolver is None:
        resolver = self._pic_span_resolver = SpanRequestResolver(self)
    resolver(obj)


def spans_to_prompt(spans: Any, markers: tuple[str, str] | None = None) -> str | list[int]:
    """The prompt (text with marker strings, or ids with -1/-2) for a ``spans`` list.

    ``spans`` is ``[{"text": str} | {"input_ids": [int]}, "mode": "independent"|"dependent"}]``;
    mode defaults to dependent. Text-only lists give text, any token-id item gives ids (text items
    are then not allowed, since tokenizing them is the server's job).
    """
    ssep, pdep = markers or span_config.load().markers
    if not isinstance(spans, list) or not spans:
        raise SpanError("'spans' must be a non-empty list of {text|input_ids, mode} objects")
    texts: list[str] = []
    ids: list[int] = []
    kinds: set[str] = set()
    for i, item in enumerate(spans):
        if not isinstance(item, dict):
            raise SpanError(f"spans[{i}] must be an object, got {type(item).__name__}")
        unknown = set(item) - {"text", "input_ids", "mode"}
        if unknown:
            raise SpanError(f"spans[{i}]: unknown field(s) {sorted(unknown)}")
        mode = item.get("mode", "dependent")
        if mode not in ("independent", "dependent", "ssep", "pdep"):
            raise SpanError(f"spans[{i}]: mode must be 'independent' or 'dependent', got {mode!r}")
        independent = mode in ("independent", "ssep")
        if ("text" in item) == ("input_ids" in item):
            raise SpanError(f"spans[{i}] needs exactly one of 'text' and 'input_ids'")
        if "text" in item:
            value = item["text"]
            if not isinstance(value, str):
                raise SpanError(f"spans[{i}].text must be a string")
            if ssep in value or pdep in value:
                raise SpanError(f"spans[{i}] contains a span marker; markers cannot be nested")
            if independent and not value:
                raise SpanError(f"spans[{i}] is an empty independent span")
            kinds.add("text")
            texts.append((ssep if independent else pdep if i else "") + value)
        else:
            value = item["input_ids"]
            if not isinstance(value, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in value
            ):
                raise SpanError(f"spans[{i}].input_ids must be a list of token ids")
            if any(t < 0 for t in value):
                raise SpanError(f"spans[{i}] contains a negative id (a span marker)")
            if independent and not value:
                raise SpanError(f"spans[{i}] is an empty independent span")
            kinds.add("ids")
            ids += ([SSEP_ID] if independent else [PDEP_ID] if i else []) + value
    if len(kinds) > 1:
        raise SpanError("spans must be all text or all input_ids, not a mix")
    return "".join(texts) if "text" in kinds else ids


def with_spans(body: dict, prompt_field: str) -> dict:
    """Request JSON with its ``spans`` extension field turned into ``prompt_field``."""
    body = copy.copy(body)
    spans = body.pop("spans")
    if body.get(prompt_field) or body.get("text") or body.get("input_ids"):
        raise SpanError(f"give either 'spans' or '{prompt_field}', not both")
    prompt = spans_to_prompt(spans)
    body.pop("text", None)
    body.pop("input_ids", None)
    if prompt_field == "text":
        body["text" if isinstance(prompt, str) else "input_ids"] = prompt
    else:
        body[prompt_field] = prompt
    return body
