"""`/generate` sampling-params validation (unit level; the HTTP level is in test_server_cpu)."""

from __future__ import annotations

import pytest
from sglang_pic.request_validation import validate_sampling_params


@pytest.mark.parametrize("params", [
    None,
    {},
    {"max_new_tokens": 8, "temperature": 0, "top_p": 0.9, "stop": ["\n"], "ignore_eos": True},
    {"max_new_tokens": None, "stop": "x", "stop_token_ids": [1, 2], "logit_bias": {"5": -1.0}},
    [{"max_new_tokens": 1}, {"temperature": 0.5}],
])
def test_valid_params_pass(params):
    validate_sampling_params(params)


@pytest.mark.parametrize("params,needle", [
    ({"max_new_tokens": "abc"}, "max_new_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"foo": 1}, "unknown sampling parameter 'foo'"),
    ({"stop": 5}, "stop"),
    ([{"max_new_tokens": 1}, {"top_k": "x"}], "top_k"),
    ("max_new_tokens=3", "must be an object"),
    ({"stop_strs": ["x"]}, "unknown"),  # internal field, not API input
])
def test_invalid_params_raise_value_error(params, needle):
    with pytest.raises(ValueError, match=needle):
        validate_sampling_params(params)
