"""Reject malformed `/generate` sampling parameters with HTTP 400 instead of a 500.

SGLang 0.5.17's `/generate` passes `sampling_params` through as a plain dict: an unknown key
(`{"foo": 1}`) fails in `SamplingParams(**kwargs)` with a TypeError, and a value of the wrong type
(`{"max_new_tokens": "abc"}`) fails later in arithmetic; both surface as "500 Internal Server
Error". The OpenAI endpoints validate through pydantic and are unaffected.

We check each key against `SamplingParams`' own msgspec field types before the request is
tokenized (a BEFORE hook on `TokenizerManager.generate_request`) and raise `ValueError`, which
SGLang's HTTP layer already turns into a 400 with the message.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

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
            msgspec.convert(value, fields[key], strict=False)
        except msgspec.ValidationError as e:
            raise ValueError(f"sampling parameter {key!r}: {e} (got {value!r})") from None


def check_generate_request(self, obj, *args, **kwargs) -> None:
    """BEFORE hook for `TokenizerManager.generate_request(self, obj, request=None)`."""
    validate_sampling_params(getattr(obj, "sampling_params", None))


HOOK_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
