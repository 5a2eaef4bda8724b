"""Refuse malformed or hostile requests with HTTP 400 before they reach SGLang's scheduler.

SGLang 0.5.17 trusts much of a request. Some mistakes surface as "500 Internal Server Error", and
some kill the scheduler process, which takes every other client's request and the server with it:

* ``sampling_params`` of `/generate` is a plain dict: an unknown key fails in
  ``SamplingParams(**kwargs)`` (TypeError), a value of the wrong type later in arithmetic (500s);
* ``input_ids`` outside ``[0, vocab)`` (``[1, 2, 999999]``, a negative id) index the embedding
  table out of range in the scheduler (crash);
* ``top_logprobs_num`` beyond the vocabulary makes ``topk`` fail in the scheduler (crash); a large
  one within it makes every output token carry that many logprobs, hence the cap
  ``MAX_TOP_LOGPROBS``;
* constrained decoding (``regex``, ``json_schema``, ``ebnf``, ``structural_tag``; the OpenAI
  ``response_format``/tools become these) needs accelerator memory in SGLang's xgrammar backend
  (crash on the CPU engine, unless ``cpu_grammar``'s hooks are registered);
* a client ``rid`` that starts like our internal span sub-requests' (``pic-span-``) would have its
  output hidden as one of theirs; one that is a prefix of theirs could abort them all; any
  client ``rid`` gets a random suffix (``unique_rids``), since SGLang aborts by id prefix;
* span markers (``<|ssep|>`` / ``<|pdep|>``, or ``--span-markers``) in a prompt sent to a server
  without the span cache would be read as ordinary text, silently giving the model another prompt
  than the client meant: refused, naming ``--enable-span-cache``.

``check_generate_request`` runs as a BEFORE hook on ``TokenizerManager.generate_request``, the one
function every generation entry point goes through (``/generate``, the OpenAI and Anthropic
endpoints, ``Engine.generate``), after the span resolver (so ``input_ids`` carry no span markers
by then; on a span server they are accepted anyway, in case the order changes). It raises
``ValueError``, which SGLang's HTTP layer answers with a 400 and the message.
The HTTP front door (``sglang_pic.frontdoor``) checks every body against its endpoint's schema
first; this hook is the second line, and the only one for ``Engine``. The front door also calls
``refuse_openai_span_markers`` for the OpenAI and Anthropic bodies: SGLang applies the chat
template and tokenizes before ``generate_request``, so the hook sees only token ids there.
"""

from __future__ import annotations

import math
import secrets
from functools import cache
from typing import Any

import msgspec

from sglang_pic.prompt_ids import forget_request_ranges, id_range, request_id_range

# Fields of SamplingParams that SGLang fills in itself (normalize()/__post_init__), not API input.
_INTERNAL_FIELDS = frozenset(
    {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized"}
)


@cache
def _api_fields() -> dict[str, Any]:
    from sglang.srt.sampling.sampling_params import SamplingParams

    return {
        f.name: f.type
        for f in msgspec.structs.fields(SamplingParams)
        if f.name not in _INTERNAL_FIELDS
    }


def validate_sampling_params(params: Any) -> None:
    """Raise ValueError naming the first bad key of a sampling-params dict (or list of dicts)."""
    if params is None:
        return
    if isinstance(params, list):
        for item in params:
            validate_sampling_params(item)
        return
    if not isinstance(params, dict):
        raise ValueError(f"sampling_params must be an object, got {type(params).__name__}")
    fields = _api_fields()
    for key, value in params.items():
        if key not in fields:
            raise ValueError(
                f"unknown sampling parameter {key!r}; expected one of: {', '.join(sorted(fields))}"
            )
        if value is None:
            continue
        try:
            # strict: the value goes on to SGLang as sent, so it must already be of the type
            # (a lax check let "2" pass for stream_interval, and the scheduler's ``> 1`` on it
            # raised TypeError, taking every client's requests down with it)
            msgspec.convert(value, fields[key], strict=True)
        except msgspec.ValidationError as e:
            raise ValueError(f"sampling parameter {key!r}: {e} (got {value!r})") from None
        check = _RANGES.get(key)
        if check is not None:
            check(key, value)


MAX_N = 128
"""Most completions one request may ask for (``n``; OpenAI's limit): SGLang copies the request
``n`` times in a loop of the tokenizer's event loop, without yielding."""
INT32_MAX = 2**31 - 1
"""``top_k`` and token counts must fit the int32 tensors SGLang puts them in."""
MAX_SEED = 2**63
"""``sampling_seed`` must fit the int64 tensor SGLang puts it in."""


def _finite(key: str, value: Any) -> None:
    if not math.isfinite(value):
        raise ValueError(f"sampling parameter {key!r} must be finite, got {value!r}")


def _in_range(lo: int, hi: int):
    def check(key: str, value: Any) -> None:
        if not lo <= value <= hi:
            raise ValueError(f"sampling parameter {key!r} must be in [{lo}, {hi}], got {value!r}")

    return check


MAX_BIAS = 100.0
"""Largest logit bias (OpenAI's range): beyond float32's range SGLang's scheduler raises on it."""


def _finite_bias(key: str, value: dict) -> None:
    bad = next((v for v in value.values() if not -MAX_BIAS <= v <= MAX_BIAS), None)
    if bad is not None:
        raise ValueError(f"sampling parameter {key!r}: biases must be in [-{MAX_BIAS:g}, "
                         f"{MAX_BIAS:g}], got {bad!r}")


_RANGES = {
    # what SGLang's own ``verify`` leaves unchecked and the scheduler then trips on
    **dict.fromkeys(("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"), _finite),
    "n": _in_range(1, MAX_N),
    "top_k": _in_range(-1, INT32_MAX),
    "max_new_tokens": _in_range(0, INT32_MAX),
    "min_new_tokens": _in_range(0, INT32_MAX),
    "stream_interval": _in_range(1, 1 << 20),
    "sampling_seed": _in_range(0, MAX_SEED - 1),
    "logit_bias": _finite_bias,
}
"""Per-key checks after the type's (``validate_sampling_params``); vocabulary-dependent ones
(``stop_token_ids``, ``logit_bias``'s keys) are in ``validate_sampling_ids``."""


def validate_sampling_ids(params: Any, vocab_size: int) -> None:
    """``stop_token_ids`` and ``logit_bias``'s token ids in ``[0, vocab_size)``, at most the
    vocabulary's size of either: SGLang indexes tensors of the vocabulary's size with them in
    the scheduler (``min_new_tokens`` scatters the stop ids), where an id outside it is an
    out-of-bounds index (a device-side assert on CUDA, which ends the process)."""
    for item in per_item(params):
        if not isinstance(item, dict):
            continue
        stop = item.get("stop_token_ids")
        if stop is not None:
            stop = list(stop)
            if len(stop) > vocab_size:
                raise ValueError(f"stop_token_ids lists {len(stop)} ids, more than the "
                                 f"vocabulary ({vocab_size})")
            validate_token_ids("stop_token_ids", [stop], vocab_size)
        bias = item.get("logit_bias")
        if bias is not None:
            if len(bias) > vocab_size:
                raise ValueError(f"logit_bias has {len(bias)} entries, more than the "
                                 f"vocabulary ({vocab_size})")
            for token in bias:
                if not (token.isascii() and token.isdigit() and int(token) < vocab_size):
                    raise ValueError(f"logit_bias key {token!r} is not a token id in "
                                     f"[0, {vocab_size})")


MAX_TOP_LOGPROBS = 20
"""Most alternatives per token ``top_logprobs_num`` (OpenAI's ``top_logprobs``, ``logprobs``)
may ask for, OpenAI's own bound (and never more than the vocabulary); ``token_ids_logprob`` is
the way to ask for more, named, tokens."""
MAX_LOGPROB_ENTRIES = 1 << 22
"""Most logprob entries one request may ask for: each prompt token from ``logprob_start_len``
on and each new token, times (1 + the top alternatives + the named tokens), times the copies
``n`` makes, summed over a batch. Each entry is a Python object in the scheduler and again in
the tokenizer; a 128K-token prompt with 1024 alternatives a token was 134 million of them."""
DEFAULT_NEW_TOKENS = 128
"""SGLang's ``SamplingParams.max_new_tokens`` when a request names none."""
TEXT_BYTES_PER_TOKEN = 4
"""Before tokenization a text prompt counts its UTF-8 bytes over this (a typical token); after,
its exact tokens (``check_tokenized_logprobs``)."""

CONSTRAINED_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")
"""Sampling parameters that make SGLang constrain decoding with a grammar."""


def per_item(value: Any) -> list[Any]:
    """A field of a possibly batched request as a list of per-request values."""
    return value if isinstance(value, list) else [value]


def _id_lists(ids: Any) -> list[Any]:
    """``input_ids``/``token_ids_logprob`` (flat or batched) as a list of id lists."""
    if not isinstance(ids, list) or not ids:
        return []
    return ids if isinstance(ids[0], list) else [ids]


def validate_token_ids(
    name: str, ids: Any, vocab_size: int, markers: frozenset[int] = frozenset(),
    owner: Any = None,
) -> None:
    """Raise ValueError unless every id of ``ids`` (flat or batched) is an int in
    ``[0, vocab_size)`` or one of ``markers``. With ``owner`` (the request), a prompt's id range
    already computed for it is reused (``request_id_range``)."""
    for seq in _id_lists(ids):
        if not seq:
            continue
        bounds = id_range(seq) if owner is None else request_id_range(owner, seq)
        if bounds is not None and bounds[0] >= 0 and bounds[1] < vocab_size:
            continue
        for t in seq:
            if not isinstance(t, int):
                raise ValueError(f"{name} must be integer token ids, got {t!r}")
        bad = next((t for t in seq if not 0 <= t < vocab_size and t not in markers), None)
        if bad is not None:
            extra = f" (or a span marker {sorted(markers)})" if markers else ""
            raise ValueError(
                f"{name} contains token id {bad}, outside the vocabulary [0, {vocab_size}){extra}"
            )


def validate_logprob_params(obj: Any, vocab_size: int) -> None:
    """``top_logprobs_num`` within ``[0, min(vocab_size, MAX_TOP_LOGPROBS)]``; ``token_ids_logprob``
    in the vocabulary and no longer than it."""
    cap = min(vocab_size, MAX_TOP_LOGPROBS)
    for start in per_item(getattr(obj, "logprob_start_len", None)):
        if start is not None and (not isinstance(start, int) or isinstance(start, bool)
                                  or not -1 <= start <= INT32_MAX):
            raise ValueError(f"logprob_start_len must be an integer >= -1, got {start!r}")
    for n in per_item(getattr(obj, "top_logprobs_num", None)):
        if n is None:
            continue
        if not isinstance(n, int) or not 0 <= n <= cap:
            raise ValueError(f"top_logprobs_num must be an integer in [0, {cap}], got {n!r}")
    wanted = getattr(obj, "token_ids_logprob", None)
    validate_token_ids("token_ids_logprob", wanted, vocab_size)
    for seq in _id_lists(wanted):
        if len(seq) > vocab_size:
            raise ValueError(
                f"token_ids_logprob lists {len(seq)} ids, more than the vocabulary ({vocab_size})"
            )
    entries = logprob_entries(obj)
    if entries > MAX_LOGPROB_ENTRIES:
        raise ValueError(_too_many_logprobs(entries))


def _too_many_logprobs(entries: int) -> str:
    return (f"the request asks for about {entries} logprob entries (tokens from "
            "logprob_start_len on and new tokens, x (1 + top_logprobs_num + named token ids), x "
            f"the copies n makes); at most {MAX_LOGPROB_ENTRIES}: start the prompt logprobs "
            "later, or ask for fewer alternatives, tokens or copies")


def logprob_entries(obj: Any, tokens: list[int] | None = None,
                    context_len: int | None = None) -> int:
    """The logprob entries ``obj`` asks for, summed over its prompts. ``tokens``: each prompt's
    token count once tokenized; without it a prompt given as ids counts its ids and a text
    prompt its UTF-8 bytes over ``TEXT_BYTES_PER_TOKEN``, counted from its start (its
    ``logprob_start_len`` is in tokens). New tokens count ``max_new_tokens`` (SGLang's default
    when absent; with ``context_len`` at most what the context leaves, all of it when null), in
    each of the ``n`` copies; the prompt is prefilled once more than ``n`` when ``n`` > 1."""
    prompts = getattr(obj, "input_ids", None)
    if prompts is None:
        prompts = getattr(obj, "text", None)
    if prompts is None:
        return 0
    batched = isinstance(prompts, list) and bool(prompts) and not isinstance(prompts[0], int)
    prompts = prompts if batched else [prompts]

    def at(name: str, i: int) -> Any:  # prompt i's value of a per-request field
        value = getattr(obj, name, None)
        return value[i] if isinstance(value, list) and batched else value

    named = _id_lists(getattr(obj, "token_ids_logprob", None))
    total = 0
    for i, prompt in enumerate(prompts):
        if not at("return_logprob", i):
            continue
        params = at("sampling_params", i) or {}
        n = params.get("n") if isinstance(params, dict) else getattr(params, "n", None)
        n = n if isinstance(n, int) and n > 1 else 1
        prefills = n + 1 if n > 1 else 1  # SGLang prefills the prompt once, then n copies
        exact = tokens is not None or isinstance(prompt, list)
        length = (tokens[i] if tokens is not None else len(prompt) if exact
                  else len(prompt.encode()) // TEXT_BYTES_PER_TOKEN)
        start = at("logprob_start_len", i)
        from_prompt = 0 if start is None or start < 0 else (
            max(length - start, 0) if exact else length)
        new = (params.get("max_new_tokens", DEFAULT_NEW_TOKENS) if isinstance(params, dict)
               else getattr(params, "max_new_tokens", DEFAULT_NEW_TOKENS))
        if context_len is not None:
            room = max(context_len - length, 0)
            new = room if new is None else min(new, room)
        per_token = 1 + (at("top_logprobs_num", i) or 0) + (
            len(named[i]) if batched and i < len(named) else len(named[0]) if named else 0)
        new = new if isinstance(new, int) else 0
        total += (prefills * from_prompt + n * new) * per_token
    return total


def check_tokenized_logprobs(self, obj, input_ids, *args, **kwargs) -> None:
    """BEFORE hook for ``TokenizerManager._validate_one_request(self, obj, input_ids)``: the
    logprob budget of one prompt, now that its tokens are known (a text prompt was estimated
    before), with the new tokens the context leaves."""
    if not getattr(obj, "return_logprob", False) or input_ids is None:
        return
    entries = logprob_entries(obj, [len(input_ids)], int(self.context_len))
    if entries > MAX_LOGPROB_ENTRIES:
        raise ValueError(_too_many_logprobs(entries))


def constrained_field(params: Any) -> str | None:
    """The first constrained-decoding parameter set in a sampling-params dict (or list)."""
    for item in per_item(params):
        if isinstance(item, dict):
            for key in CONSTRAINED_FIELDS:
                if item.get(key) is not None:
                    return key
    return None


def constrained_decoding_available(server_args: Any) -> bool:
    """Whether this server can run constrained decoding without crashing: any accelerator, or the
    CPU engine with xgrammar and ``cpu_grammar``'s hooks registered in this process."""
    if _resolved(server_args, "device") != "cpu":
        return True
    from sglang_pic.cpu.grammar import cpu_grammar_registered

    return _resolved(server_args, "grammar_backend") == "xgrammar" and cpu_grammar_registered()


def _resolved(server_args: Any, name: str) -> Any:
    """``server_args``' value of field ``name`` as SGLang resolved it: 0.5.23 keeps what its
    resolution decided (a default it chose) beside the record, 0.5.17 writes it on it."""
    try:
        from sglang.srt.arg_groups.overrides import resolution_result
    except ImportError:  # 0.5.17
        return getattr(server_args, name, None)
    return resolution_result(server_args, name)


def validate_rid(rid: Any) -> None:
    """Client request ids may not start like span sub-requests' (their output would be hidden),
    nor be a prefix of that (SGLang aborts by rid prefix: aborting ``"pic"`` would abort every
    span sub-request, failing other clients' span requests)."""
    from sglang_pic.spans.request import UNIT_RID_PREFIX

    for item in per_item(rid):
        if isinstance(item, str) and (
            item.startswith(UNIT_RID_PREFIX) or UNIT_RID_PREFIX.startswith(item)
        ):
            raise ValueError(
                f"request ids starting with {UNIT_RID_PREFIX!r} or a prefix of it are reserved"
            )


RID_SUFFIX_BYTES = 8
"""Random bytes (hex) appended to every client request id (``unique_rids``)."""


def unique_rids(rid: Any) -> Any:
    """Each client ``rid`` with ``-`` and random hex appended. SGLang aborts every request whose
    id *starts with* the aborted one (a disconnect aborts the client's own ``rid``): a client
    that sent ``rid: "0"`` and hung up aborted every request whose id starts with ``0``, other
    clients' included (SGLang's own ids are hex). With a random suffix no client id is a prefix
    of another's; the response's ``meta_info.id`` still starts with the id the client sent."""
    if isinstance(rid, str):
        return f"{rid}-{secrets.token_hex(RID_SUFFIX_BYTES)}"
    if isinstance(rid, list):
        return [unique_rids(r) for r in rid]
    return rid


def _marker_strings() -> tuple[str, str]:
    """The span marker strings this server's processes were given (``--span-markers``)."""
    from sglang_pic.spans import config as span_config

    return span_config.load().markers


def refuse_span_markers(field: str, value: Any) -> None:
    """Raise ValueError when ``value`` (a prompt string or a list of them) contains a span marker.

    Called only where the span cache is off: there the marker would reach the model as ordinary
    text (a 200 with an answer to another prompt than the client meant).
    """
    markers = _marker_strings()
    for i, item in enumerate(per_item(value)):
        if isinstance(item, str) and any(m in item for m in markers):
            where = f"{field}[{i}]" if isinstance(value, list) else field
            raise ValueError(
                f"{where} contains a span marker ({' / '.join(markers)}), but this server runs "
                "without the span cache: start it with `sglang-pic serve --enable-span-cache` "
                "(or --radix-cache-backend pic_span), or remove the markers"
            )


def check_generate_request(self, obj, *args, **kwargs) -> None:
    """BEFORE hook for `TokenizerManager.generate_request(self, obj, request=None)`."""
    from sglang_pic.spans.request import accepted_marker_ids, span_cache_enabled

    params = getattr(obj, "sampling_params", None)
    validate_sampling_params(params)
    validate_rid(getattr(obj, "rid", None))
    obj.rid = unique_rids(getattr(obj, "rid", None))
    if not span_cache_enabled(self.server_args):
        refuse_span_markers("text", getattr(obj, "text", None))
    vocab_size = int(self.model_config.vocab_size)
    validate_sampling_ids(params, vocab_size)
    try:
        validate_token_ids("input_ids", getattr(obj, "input_ids", None), vocab_size,
                           accepted_marker_ids(self), owner=obj)
    finally:
        forget_request_ranges()
    validate_logprob_params(obj, vocab_size)
    key = constrained_field(params)
    if key is not None and not constrained_decoding_available(self.server_args):
        raise ValueError(
            f"constrained decoding ({key}) is not available on this server's CPU engine"
        )


def refuse_openai_span_markers(data: Any) -> None:
    """Span markers in an OpenAI ``prompt``, in any chat message's text or in an Anthropic
    ``system`` prompt are refused (called where the span cache is off)."""
    if not isinstance(data, dict):
        return
    refuse_span_markers("prompt", data.get("prompt"))
    system = data.get("system")
    if isinstance(system, list):
        refuse_span_markers("system", [p.get("text") if isinstance(p, dict) else None
                                       for p in system])
    else:
        refuse_span_markers("system", system)
    messages = data.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
            texts = [p.get("text") if isinstance(p, dict) else None for p in content]
            refuse_span_markers(f"messages[{i}].content", texts)
        else:
            refuse_span_markers(f"messages[{i}].content", content)


