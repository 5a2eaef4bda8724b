"""One strict schema per endpoint body, checked before SGLang sees the body.

Why: SGLang parses bodies into permissive types (``GenerateReqInput`` is a dataclass whose
per-request fields take a value *or* a list; ``sampling_params`` is a plain dict), and values it
does not expect reach the scheduler, where an exception ends the process for every client
(``top_k`` of 2**31, ``logprob_start_len`` of -5, a list where a single request takes a value).
Checking field by field after each report did not converge, so every body now goes through a
schema that states, per field: its type, whether it may be a list (only in a batch, with the
batch's length), and its range. The rule for fields the schema does not name: **refused** (400,
naming the field), as OpenAI's own API does.

* ``/generate``: ``GenerateBody``, built from ``GenerateReqInput``'s fields: ``CLIENT_FIELDS`` are
  accepted with the types below, ``REFUSED_FIELDS`` (internal, multimodal, code-carrying) are not,
  ``ROUTER_FIELDS`` only with the values SGLang's router sends.
  Every field of ``GenerateReqInput`` is in one of the two (a test checks), so a field SGLang
  adds is refused until it is classified. ``sampling_params`` is ``SamplingBody``, derived from
  ``SamplingParams``'s fields with the ranges of ``SAMPLING_RANGES``.
* OpenAI and Anthropic routes: SGLang's own pydantic models (the types), keys outside the model
  or in ``REFUSED_OPENAI_FIELDS`` refused, and ``OPENAI_RANGES`` on the values.
* ``/v1/detokenize``: token ids inside the vocabulary.

Bodies are decoded with msgspec, which refuses what is not JSON (``NaN``, ``Infinity``, which
Python's parser, SGLang's, takes) and integers beyond 64 bits. Token ids in the vocabulary and the
rest of what needs the model are checked again by ``request_validation`` in the tokenizer, the one
function every generation goes through (``Engine`` too).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from sglang_pic.eviction.context import APP_TYPES
from sglang_pic.security.request_validation import MAX_TOP_LOGPROBS, per_item
from sglang_pic.spans.request import LAYOUT_KEY

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_BATCH = 1024
"""Most prompts one ``/generate`` batch may hold: SGLang builds each one's request on the
tokenizer's event loop, without yielding."""
MAX_N = 128
"""Most completions one request may ask for (OpenAI's limit)."""
MAX_NAMED_LOGPROBS = 1024
"""Most tokens ``token_ids_logprob`` may name per prompt."""
MAX_STOPS = 64
"""Stop strings or regexes per request (each is searched in every decoded step's text)."""
MAX_STOP_CHARS = 1024
MAX_ID_CHARS = 256
"""Longest ``rid``, ``extra_key``, label or name a client may send."""
MAX_GRAMMAR_CHARS = 1 << 16
"""Longest grammar a request may carry (``regex``, ``json_schema``, ``ebnf``,
``structural_tag``; the OpenAI ``response_format`` as JSON): SGLang compiles it on a grammar
thread that nothing cancels."""
MAX_TOOLS_CHARS = 1 << 20
"""Most characters of tool definitions (``tools`` and ``tool_choice``, and the ``tools`` of
system and developer messages, as JSON) a request may carry: agent clients send dozens of
tools, and SGLang compiles them into one grammar when a call is required."""
MAX_DEPTH = 128
"""Deepest nesting of arrays and objects an OpenAI or Anthropic body may have (a JSON schema in
``response_format`` or a tool's parameters is the deepest legitimate part; SGLang re-serialises
bodies with orjson, which raises past 255)."""


class BodyError(ValueError):
    """A body the schema refuses; the message names the field."""


# ---- /generate --------------------------------------------------------------------------------

Int32 = Annotated[int, Meta(ge=-INT32_MAX - 1, le=INT32_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Name = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
Rid = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
TokenId = int
"""A token id: its range (the vocabulary; -1 / -2, the span markers of a span server) is checked
by ``request_validation`` in the tokenizer, which knows both."""
StopText = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
Stops = StopText | Annotated[list[StopText], Meta(max_length=MAX_STOPS)]
LogprobStart = Annotated[int, Meta(ge=-1, le=INT32_MAX)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]

Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
"""A logit bias (OpenAI's range): past float32's range SGLang's scheduler raised on it, and large
ones with a low temperature make NaN probabilities."""


class CustomParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``custom_params``: what a client may put there, the eviction policy's hints
    (docs/eviction.md). SGLang hands the dict to custom logit processors, which are refused;
    anything else in it would only be stored per request (unbounded: one request of a 1 MB
    ``session_id`` after another grew the session index by a megabyte each)."""

    session_id: Name | Annotated[int, Meta(ge=-INT64_MAX - 1, le=INT64_MAX)] | None = None
    app_type: Literal[APP_TYPES] | None = None


MAX_STOP_REGEX_WIDTH = 256
"""Longest match a ``stop_regex`` may have: SGLang searches the decoded text's tail of that many
characters at every step, on the scheduler's thread."""

SAMPLING_RANGES: dict[str, Any] = {
    "max_new_tokens": Count | None,
    "min_new_tokens": Count,
    "top_k": Annotated[int, Meta(ge=-1, le=INT32_MAX)],
    "n": Annotated[int, Meta(ge=1, le=MAX_N)],
    "stream_interval": Annotated[int, Meta(ge=1, le=1 << 20)] | None,
    "sampling_seed": Annotated[int, Meta(ge=0, le=INT64_MAX)] | None,
    "stop": Stops | None,
    "stop_regex": Stops | None,
    "stop_token_ids": Annotated[list[Annotated[int, Meta(ge=0, le=INT32_MAX)]],
                                         Meta(max_length=1 << 20)] | None,
    "logit_bias": dict[Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")], Bias] | None,
    **dict.fromkeys(("regex", "json_schema", "ebnf", "structural_tag"),
                    Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] | None),
    "custom_params": CustomParams | None,
}
"""Types of ``SamplingParams`` fields narrower than SGLang's own (None: refused)."""

_INTERNAL_SAMPLING = frozenset({"stop_strs", "stop_regex_strs", "stop_str_max_len",
                                "stop_regex_max_len", "is_normalized"})


@cache
def sampling_body() -> type:
    """``SamplingBody``: ``SamplingParams``'s API fields, each optional (absent: SGLang's
    default) but ``null`` only where SGLang's type takes it, with our ranges."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    fields = []
    for f in msgspec.structs.fields(SamplingParams):
        if f.name in _INTERNAL_SAMPLING:
            continue
        kind = SAMPLING_RANGES.get(f.name, f.type)
        if kind is None:
            continue
        fields.append((f.name, kind, None))
    return msgspec.defstruct("SamplingBody", fields, forbid_unknown_fields=True,
                             omit_defaults=True)


def _per_request(kind: Any) -> Any:
    """A per-request field: the value, or (in a batch) a list of values."""
    return kind | list[kind] | None


CLIENT_FIELDS: dict[str, Any] = {
    "text": str | list[str] | None,
    "input_ids": msgspec.Raw,  # decoded by ``prompt_ids``: one pass of typed ints
    "rid": Rid | list[Rid] | None,
    "return_logprob": _per_request(bool),
    "logprob_start_len": _per_request(LogprobStart),
    "top_logprobs_num": _per_request(TopLogprobs),
    "token_ids_logprob": Annotated[list[TokenId | Annotated[list[TokenId],
                                                            Meta(max_length=MAX_NAMED_LOGPROBS)]],
                                   Meta(max_length=MAX_BATCH)] | None,
    "return_text_in_logprobs": bool,
    "return_flat_raw_top_logprobs": bool,
    "return_flat_raw_top_logprobs_b64": bool,
    "stream": bool,
    "log_metrics": bool,
    "return_hidden_states": bool,
    "lora_path": _per_request(Name | None),
    "routing_key": Name | None,
    "conversation_id": Name | None,
    "require_reasoning": bool,
    "max_thinking_tokens": Count | None,
    "priority": Int32 | None,
    "extra_key": _per_request(Name),
    "no_logs": bool,
    "session_id": Name | None,
    "return_bytes": bool,
    "return_entropy": bool,
    "return_prompt_token_ids": bool,
    # SGLang 0.5.23's (the schema takes only the installed release's fields: ``generate_body``)
    "cache_salt": _per_request(Name),
    "return_flat_raw_output_top_logprobs": bool,
    "sampling_logprobs_mode": _per_request(Literal["selected", "support"]),
}
"""``GenerateReqInput`` fields a client may send, with their types (``sampling_params`` apart);
``null`` only where SGLang's own default is None."""

REFUSED_FIELDS: dict[str, str] = {
    **dict.fromkeys(("input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
                     "use_audio_in_video", "modalities", "num_items_assigned",
                     "mm_data_mooncake", "encoder_urls", "need_wait_for_mm_inputs",
                     "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
                     "video_max_dynamic_patch", "images_config", "multi_item_delimiter_indices",
                     "mm_content_hashes", "mm_processor_kwargs", "video_config",
                     "token_indices_to_pool"),
                    "multimodal and embedding inputs are not served (text models only)"),
    "kv_hints": "KV placement hints are not served",
    "watermark": "watermarking is not served",
    "custom_logit_processor": "custom logit processors run client code on the server",
    "session_params": "sessions are not served",
    "custom_labels": "metrics labels are the operator's to set",
    "return_sampling_mask": "sampling masks (a vocabulary per token) are not served",
    "lora_id": "set by SGLang from lora_path",
    **dict.fromkeys(("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
                     "decode_tp_size", "routed_dp_rank", "disagg_prefill_dp_rank",
                     "http_worker_ipc", "received_time", "external_trace_header",
                     "positional_embed_overrides", "background", "data_parallel_rank"),
                    "set by SGLang's own components, not by clients"),
    **dict.fromkeys(("return_routed_experts", "routed_experts_start_len",
                     "return_indexer_topk"), "MoE introspection is not served"),
}
"""``GenerateReqInput`` fields refused, with the reason the 400 gives."""

ROUTER_FIELDS: dict[str, Any] = {
    "model": Name | None,
    "background": bool,
}
"""Fields SGLang's router (``sglang-router``, what ``sglang-pic fleet`` puts in front of its
instances) adds to every ``/generate`` body it forwards: it re-serialises the body from its own
typed request, with ``"model": null`` and ``"background": false``. SGLang ignores ``model`` on
``/generate``; ``background`` stays refused unless false (its default: the router's value), for
the reason ``REFUSED_FIELDS`` gives."""

BATCHED = ("rid", "return_logprob", "logprob_start_len", "top_logprobs_num", "lora_path",
           "extra_key", "cache_salt", "sampling_logprobs_mode", "sampling_params")
"""Per-request fields: a list only in a batch, and then one entry per prompt."""


@cache
def generate_body() -> type:
    """``GenerateBody``: the ``CLIENT_FIELDS`` the installed ``GenerateReqInput`` has (a field
    of another release is unknown here), the router's, and ``sampling_params``."""
    import dataclasses

    from sglang.srt.managers.io_struct import GenerateReqInput

    sampling = sampling_body()
    release = {f.name for f in dataclasses.fields(GenerateReqInput)}
    fields = [(name, kind, None) for name, kind in CLIENT_FIELDS.items() if name in release]
    fields += [(name, kind, None) for name, kind in ROUTER_FIELDS.items()]
    fields.append(("sampling_params", _per_request(sampling), None))
    return msgspec.defstruct("GenerateBody", fields, forbid_unknown_fields=True,
                             omit_defaults=True)


def _decode(raw: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        message = str(e)
        unknown = re.match(r"Object contains unknown field `([^`]*)`(?: - at `([^`]*)`)?$",
                           message)
        if unknown and unknown.group(2) in (None, "$"):
            raise BodyError(_unknown_message(unknown.group(1))) from None
        if unknown and unknown.group(2).endswith(".custom_params"):
            name = unknown.group(1)
            reason = ("set by the server, not by clients" if name == LAYOUT_KEY else
                      "custom_params takes session_id and app_type (the eviction policy's hints)")
            raise BodyError(f"custom_params.{name} is not accepted: {reason}") from None
        raise BodyError(f"invalid request body: {message}") from None
    except msgspec.DecodeError as e:
        raise BodyError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BodyError(TOO_DEEP) from None


TOO_DEEP = "the request body is nested too deeply (depth limit exceeded)"


def _unknown_message(name: str) -> str:
    reason = REFUSED_FIELDS.get(name)
    if reason:
        return f"field {name!r} is not accepted: {reason}"
    return f"unknown field {name!r}"


_FLAT_IDS = msgspec.json.Decoder(list[int])
_BATCH_IDS = msgspec.json.Decoder(list[list[int]])


def prompt_ids(raw: msgspec.Raw | None) -> list | None:
    """``input_ids`` as a list of ints or a list of such lists (None: absent or null). Decoded
    as one of the two typed shapes: a list of ``int | list[int]`` costs ~150 ns an id in
    msgspec, a typed one a few (128K ids: 19 ms against ~1 ms)."""
    if raw is None or bytes(raw).strip() == b"null":
        return None
    try:
        return _FLAT_IDS.decode(raw)
    except msgspec.ValidationError:
        pass
    try:
        return _BATCH_IDS.decode(raw)
    except msgspec.ValidationError as e:
        raise BodyError("invalid request body: 'input_ids' must be a list of token ids or a "
                        f"list of such lists ({e})") from None


def check_generate(raw: bytes) -> None:
    """``/generate``: the schema, then the batch's shape."""
    body = _decode(raw, generate_body())
    if body.background:
        raise BodyError(_unknown_message("background"))
    body.input_ids = prompt_ids(body.input_ids)
    prompts = [name for name in ("text", "input_ids") if getattr(body, name) is not None]
    if len(prompts) != 1:
        raise BodyError("give exactly one of 'text' and 'input_ids' (or 'spans' on a span "
                        f"server); got {', '.join(prompts) or 'none'}")
    _refuse_empty_text("text", body.text)
    batch = _batch_size(body)
    for name in BATCHED:
        value = getattr(body, name, None)  # a field of another release: absent
        if isinstance(value, list):
            if batch is None:
                raise BodyError(f"{name!r} is a list, but the request is a single prompt: a "
                                "list is only for a batch (a list of prompts)")
            if len(value) != batch:
                raise BodyError(f"{name!r} has {len(value)} entries for a batch of {batch} "
                                "prompts")
        elif batch is not None and name == "rid" and value is not None:
            raise BodyError("'rid' of a batch is a list with one id per prompt")
    _check_id_lists("token_ids_logprob", body.token_ids_logprob, batch, empty_ok=True)
    for params in per_item(body.sampling_params):
        if params is not None:
            _check_sampling(params)
    copies = (batch or 1) * max((p.n for p in per_item(body.sampling_params)
                                 if p is not None and p.n is not None), default=1)
    if copies > MAX_BATCH:
        raise BodyError(f"the request asks for {copies} completions (prompts x n); at most "
                        f"{MAX_BATCH}")


def _refuse_empty_text(name: str, text: Any) -> None:
    """An empty prompt is refused here, on every release: SGLang 0.5.17 refuses it, and 0.5.23
    schedules a prefill of no token, which stops its scheduler (the server dies)."""
    if text == "" or text == []:
        raise BodyError(f"{name!r} is empty")
    if isinstance(text, list) and any(t == "" or t == [] for t in text):
        raise BodyError(f"{name!r} holds an empty prompt")


def _batch_size(body: Any) -> int | None:
    """The number of prompts of a batch; None for a single prompt."""
    if isinstance(body.text, list):
        size = len(body.text)
    elif body.input_ids is not None:
        if not body.input_ids:
            raise BodyError("'input_ids' is empty")
        if not isinstance(body.input_ids[0], list):
            return None
        size = len(body.input_ids)
        if any(not ids for ids in body.input_ids):
            raise BodyError("'input_ids' holds an empty prompt")
    else:
        return None
    if not 1 <= size <= MAX_BATCH:
        raise BodyError(f"a batch holds 1 to {MAX_BATCH} prompts, got {size}")
    return size


def _check_id_lists(name: str, ids: Any, batch: int | None, empty_ok: bool) -> None:
    if ids is None:
        return
    nested = [x for x in ids if isinstance(x, list)]
    if nested and len(nested) != len(ids):
        raise BodyError(f"{name!r} mixes ids and lists of ids")
    if nested and batch is None:
        raise BodyError(f"{name!r} is a list of lists, but the request is a single prompt")
    if ids and not nested and batch is not None:
        raise BodyError(f"{name!r} of a batch is a list of id lists, one per prompt")
    if nested and len(nested) != batch:
        raise BodyError(f"{name!r} has {len(nested)} entries for a batch of {batch} prompts")
    if not empty_ok and (not ids or any(not x for x in nested)):
        raise BodyError(f"{name!r} holds an empty list")


def check_stop_regex(pattern: str) -> None:
    """A ``stop_regex`` SGLang can search at every decode step without stalling the scheduler:
    valid, a bounded match width (SGLang searches the whole output for an unbounded one), and no
    repetition inside a repetition (``(a+)+``: exponential backtracking)."""
    from re import _parser as sre_parse  # the stdlib's own parser: what ``re`` compiles

    try:
        parsed = sre_parse.parse(pattern)
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        raise BodyError(f"sampling parameter 'stop_regex': {pattern!r} is not a valid "
                        f"regular expression ({e})") from None
    if parsed.getwidth()[1] > MAX_STOP_REGEX_WIDTH:
        raise BodyError(f"sampling parameter 'stop_regex': {pattern!r} may match more than "
                        f"{MAX_STOP_REGEX_WIDTH} characters (bound every repetition: "
                        "x{0,20}, not x* or x+)")
    if _nested_repeat(parsed, inside=False):
        raise BodyError(f"sampling parameter 'stop_regex': {pattern!r} repeats a repetition, "
                        "which backtracks exponentially")


_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")


def _nested_repeat(parsed: Any, inside: bool) -> bool:
    for op, arg in parsed:
        name = str(op)
        if name in _REPEATS:
            if inside:
                return True
            if _nested_repeat(arg[2], inside=True):
                return True
        elif name == "SUBPATTERN":
            if _nested_repeat(arg[-1], inside):
                return True
        elif name == "BRANCH":
            if any(_nested_repeat(branch, inside) for branch in arg[1]):
                return True
        elif name in ("ASSERT", "ASSERT_NOT"):
            if _nested_repeat(arg[1], inside):
                return True
    return False


def _check_sampling(params: Any) -> None:
    for pattern in per_item(params.stop_regex or []):
        check_stop_regex(pattern)
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty"):
        value = getattr(params, name, None)
        if value is not None and not abs(value) < float("inf"):
            raise BodyError(f"sampling parameter {name!r} must be finite")


# ---- OpenAI and Anthropic routes ----------------------------------------------------------------

REFUSED_OPENAI_FIELDS: dict[str, str] = {
    name: reason for name, reason in REFUSED_FIELDS.items() if name != "lora_id"
} | {
    "data_parallel_rank": "set by SGLang's own components, not by clients",
    "cache_salt": "not served",
}

_Finite = Annotated[float, Meta(ge=-1e30, le=1e30)]
TEMPLATE_KWARGS = ("enable_thinking", "thinking", "reasoning_effort")
"""``chat_template_kwargs`` a client may set: SGLang passes the dict to ``apply_chat_template``,
where ``chat_template`` would replace the template (code run on the event loop) and other keys
are the template's own arguments."""
OPENAI_RANGES: dict[str, Any] = {
    "n": Annotated[int, Meta(ge=1, le=MAX_N)],
    "best_of": Annotated[int, Meta(ge=1, le=MAX_N)] | None,
    "top_k": Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None,
    "logprobs": bool | Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None,
    "top_logprobs": Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None,
    "max_tokens": Count | None,
    "max_completion_tokens": Count | None,
    "min_tokens": Count | None,
    "seed": Annotated[int, Meta(ge=-INT64_MAX - 1, le=INT64_MAX)] | None,
    "stop": Stops | None,
    "stop_sequences": Annotated[list[StopText], Meta(max_length=MAX_STOPS)] | None,
    "stop_regex": Stops | None,
    "stop_token_ids": list[Annotated[int, Meta(ge=0, le=INT32_MAX)]] | None,
    "rid": Rid | None,
    "extra_key": Name | None,
    "priority": Int32 | None,
    "user": Name | None,
    "lora_path": Name | None,
    "logit_bias": dict[Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")], Bias] | None,
    "chat_template_kwargs": Annotated[dict[Literal[TEMPLATE_KWARGS], bool | Name],
                                      Meta(max_length=4)] | None,
    "session_id": Name | None,
    "custom_params": CustomParams | None,
    "prompt": str | list[str | TokenId | list[TokenId]] | None,
    **dict.fromkeys(("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"), _Finite | None),
}
"""Value ranges of OpenAI/Anthropic fields that SGLang's models type but do not bound."""


@cache
def _openai_models() -> dict[str, Any]:
    from sglang.srt.entrypoints.anthropic import protocol as anthropic
    from sglang.srt.entrypoints.openai import protocol as openai

    return {
        "/v1/completions": openai.CompletionRequest,
        "/v1/chat/completions": openai.ChatCompletionRequest,
        "/v1/tokenize": openai.TokenizeRequest,
        "/tokenize": openai.TokenizeRequest,
        "/v1/detokenize": openai.DetokenizeRequest,
        "/detokenize": openai.DetokenizeRequest,
        "/v1/messages": anthropic.AnthropicMessagesRequest,
        "/v1/messages/count_tokens": anthropic.AnthropicCountTokensRequest,
    }


@cache
def _ranges_struct(path: str) -> type:
    """A msgspec struct of the model's fields that ``OPENAI_RANGES`` bounds (others: Any)."""
    model = _openai_models()[path]
    names = {f.alias or name for name, f in model.model_fields.items()}
    fields = [(n, OPENAI_RANGES.get(n, Any), None) for n in sorted(names)]
    return msgspec.defstruct(f"Ranges{abs(hash(path))}", fields, forbid_unknown_fields=True)


def check_openai(path: str, raw: bytes, vocab_size: Callable[[], int | None]) -> dict:
    """An OpenAI/Anthropic body: a JSON object of the model's fields (none refused), in range,
    that SGLang's model validates. Returns it, parsed."""
    from pydantic import ValidationError

    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise BodyError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BodyError(TOO_DEEP) from None
    if not isinstance(data, dict):
        raise BodyError("the request body must be a JSON object")
    for name in data:
        if name in REFUSED_OPENAI_FIELDS:
            raise BodyError(f"field {name!r} is not accepted: {REFUSED_OPENAI_FIELDS[name]}")
    _check_values(data)
    _check_grammar_sizes(data)
    _refuse_media(path, data)
    _decode(raw, _ranges_struct(path))
    try:
        request = _openai_models()[path].model_validate(data)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise BodyError(f"invalid {path} request: {where}: {first.get('msg', e)}") from None
    except RecursionError:
        raise BodyError(TOO_DEEP) from None
    except Exception as e:  # a validator of SGLang's that assumed another shape
        raise BodyError(f"malformed {path} request: a field has the wrong type "
                        f"({type(e).__name__}: {e})") from None
    if path.endswith("detokenize"):
        _check_vocab("tokens", request.tokens, vocab_size())
    for pattern in per_item(data.get("stop_regex") or []):
        check_stop_regex(pattern)
    prompt = data.get("prompt")
    if path == "/v1/completions" and "prompt" in data:
        _refuse_empty_text("prompt", prompt)
    batch = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(
        prompt[0], int) else 1
    if batch * max(1, data.get("n") or 1) > MAX_BATCH:
        raise BodyError(f"the request asks for {batch} prompts x n={data.get('n')} "
                        f"completions; at most {MAX_BATCH}")
    return data


FLAT_FIELDS = ("prompt", "tokens", "input_ids")
"""Top-level fields whose shape the schema bounds already (prompts, token ids, checked against
the vocabulary): the walk of ``_check_values`` skips them, so a 128K-token prompt is not walked
id by id."""

JSON_INTS = (-(2**63), 2**64 - 1)
"""Integers orjson writes (signed and unsigned 64-bit). A JSON number parses to any Python int;
SGLang and our checks re-serialise bodies with orjson, which raises on one outside this range."""


def _check_values(data: dict) -> None:
    """Refuse what orjson cannot write back, anywhere in the body (the fields typed ``Any`` -
    a ``response_format``'s schema, ``tools``, ``metadata`` - included): nesting deeper than
    ``MAX_DEPTH`` (orjson raises past 255 levels) and integers outside ``JSON_INTS``. Either
    was a 500 and a traceback per request."""
    low, high = JSON_INTS
    stack = [(v, 1) for k, v in data.items() if k not in FLAT_FIELDS]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, int) and not low <= value <= high:
            raise BodyError(f"the request body holds the integer {str(value)[:40]}, outside "
                            "the 64-bit range")
        if not isinstance(value, dict | list):
            continue
        if depth + 1 > MAX_DEPTH:
            raise BodyError(f"the request body is nested deeper than {MAX_DEPTH} levels")
        items = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in items)


GRAMMAR_FIELDS = ("response_format", "regex", "json_schema", "ebnf", "structural_tag")


def _check_grammar_sizes(data: dict) -> None:
    import orjson

    def size(value: Any) -> int:
        return 0 if value is None else len(value) if isinstance(value, str) else len(
            orjson.dumps(value))

    for name in GRAMMAR_FIELDS:
        if size(data.get(name)) > MAX_GRAMMAR_CHARS:
            raise BodyError(f"{name!r} is {size(data.get(name))} characters long; at most "
                            f"{MAX_GRAMMAR_CHARS} (a grammar is compiled on a thread that "
                            "nothing cancels)")
    messages = data.get("messages") if isinstance(data.get("messages"), list) else []
    tools = size(data.get("tools")) + size(data.get("tool_choice")) + sum(
        size(m.get("tools")) for m in messages if isinstance(m, dict))
    if tools > MAX_TOOLS_CHARS:
        raise BodyError(f"the request's tool definitions are {tools} characters long; at most "
                        f"{MAX_TOOLS_CHARS}")


MEDIA_FREE_PARTS = {
    "/v1/chat/completions": frozenset({"text", "thinking", "reasoning", "tool_reference"}),
    **dict.fromkeys(("/v1/messages", "/v1/messages/count_tokens"), frozenset({
        "text", "thinking", "redacted_thinking", "tool_use", "tool_result", "search_result",
        "tool_reference"})),
}
"""Content part types a message may hold, per route: all SGLang takes but media. SGLang's
loaders would fetch an ``image_url`` / ``video_url`` / ``audio_url`` part's URL (any address the
server reaches), open a local file, or decode ``input_audio`` for a multimodal model; the models
served here are text models."""
NESTED_PARTS = ("tool_result", "search_result")
"""Parts that hold content parts of their own."""


def _refuse_media(path: str, data: dict) -> None:
    allowed = MEDIA_FREE_PARTS.get(path)
    if allowed is None:
        return
    messages = data.get("messages")
    parts = [(f"messages[{i}]", m.get("content")) for i, m in enumerate(messages)
             if isinstance(m, dict)] if isinstance(messages, list) else []
    parts.append(("system", data.get("system")))
    while parts:
        where, content = parts.pop()
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            kind = part.get("type")
            if kind not in allowed:
                raise BodyError(f"{where}.content[{j}] is a {kind!r} part: media are not served "
                                f"(text models; parts of type {', '.join(sorted(allowed))})")
            if kind in NESTED_PARTS:
                parts.append((f"{where}.content[{j}]", part.get("content")))


def _check_vocab(name: str, ids: Any, vocab: int | None) -> None:
    if vocab is None:
        return
    for seq in ids if ids and isinstance(ids[0], list) else [ids]:
        bad = next((t for t in seq if not 0 <= t < vocab), None)
        if bad is not None:
            raise BodyError(f"{name!r} holds token id {bad}, outside the vocabulary [0, {vocab})")


BODY_ROUTES: dict[str, Literal["generate", "openai"]] = {
    "/generate": "generate",
    **dict.fromkeys(("/v1/completions", "/v1/chat/completions", "/v1/tokenize", "/tokenize",
                     "/v1/detokenize", "/detokenize", "/v1/messages",
                     "/v1/messages/count_tokens"), "openai"),
}
"""Routes whose bodies are checked, and by which schema."""


def check_body(path: str, raw: bytes, vocab_size: Callable[[], int | None]) -> dict | None:
    """Raise ``BodyError`` unless ``raw`` is a body ``path`` accepts; an OpenAI or Anthropic
    body is returned parsed (None for ``/generate``)."""
    kind = BODY_ROUTES.get(path)
    if kind == "generate":
        check_generate(raw)
    elif kind == "openai":
        return check_openai(path, raw, vocab_size)
    return None
