"""Request validation at unit level: sampling params, token ids, logprob parameters, constrained
decoding, reserved request ids, OpenAI bodies through the front door's schema (the HTTP level is in test_server_cpu and
test/server/security/test_http_security.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang_pic.prompt_ids import id_range
from sglang_pic.security.request_validation import (
    MAX_TOP_LOGPROBS,
    constrained_decoding_available,
    constrained_field,
    validate_logprob_params,
    validate_rid,
    validate_sampling_ids,
    validate_sampling_params,
    validate_token_ids,
)


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


@pytest.mark.parametrize("params,needle", [
    # a value SGLang's SamplingParams takes as it is: a string the scheduler then compares with
    # an int (stream_interval), reads as true ("false"), or sums (n)
    ({"stream_interval": "2"}, "stream_interval"),
    ({"ignore_eos": "false"}, "ignore_eos"),
    ({"n": "3"}, "'n'"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stream_interval": 0}, r"stream_interval.*\[1, "),
    ({"n": 10_000_000}, r"'n' must be in \[1, 128\]"),
    ({"n": 0}, "'n' must be"),
    ({"sampling_seed": 10**30}, "sampling_seed"),
    ({"sampling_seed": -1}, "sampling_seed"),
    ({"temperature": float("nan")}, "finite"),
    ({"top_p": float("inf")}, "finite"),
    ({"logit_bias": {"5": float("nan")}}, "biases must be in"),
    ({"logit_bias": {"5": 1e300}}, "biases must be in"),
])
def test_values_the_scheduler_cannot_take_are_refused(params, needle):
    with pytest.raises(ValueError, match=needle):
        validate_sampling_params(params)


def test_values_in_range_pass():
    validate_sampling_params({"n": 1, "stream_interval": 1, "sampling_seed": 2**63 - 1,
                              "temperature": 1, "logit_bias": {"5": -100}})
    validate_sampling_ids({"stop_token_ids": [0, 999], "logit_bias": {"0": 1.0, "999": -1.0}},
                          1000)
    validate_sampling_ids([{"max_new_tokens": 3}, None], 1000)


@pytest.mark.parametrize("params,needle", [
    ({"stop_token_ids": [1000]}, "stop_token_ids contains token id 1000"),
    ({"stop_token_ids": [-5]}, "stop_token_ids contains token id -5"),
    ({"stop_token_ids": [10**30]}, "stop_token_ids contains token id"),
    ({"stop_token_ids": list(range(1001))}, "more than the vocabulary"),
    ([{}, {"stop_token_ids": [2000]}], "2000"),
    ({"logit_bias": {"1000": 1.0}}, "logit_bias key '1000'"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias key '-1'"),
    ({"logit_bias": {"²": 1.0}}, "logit_bias key"),
])
def test_sampling_token_ids_outside_the_vocabulary_are_refused(params, needle):
    """SGLang indexes tensors of the vocabulary's size with these in the scheduler: an id
    outside it is an out-of-bounds index there (a device-side assert on CUDA)."""
    with pytest.raises(ValueError, match=needle):
        validate_sampling_ids(params, 1000)


# ---- ids, logprobs, constrained decoding, OpenAI bodies (issue 21, items 10-11) -------------------

VOCAB = 1000


@pytest.mark.parametrize("ids", [None, [], [0, 1, 999], [[1, 2], [998, 0]]])
def test_ids_in_vocabulary_pass(ids):
    validate_token_ids("input_ids", ids, VOCAB)


@pytest.mark.parametrize("ids,bad", [
    ([1, 2, 1000], "1000"),
    ([1, -3, 2], "-3"),
    ([[1, 2], [3, 999999]], "999999"),
    ([1, "2"], "'2'"),
    ([1, 2.0, 3], "2.0"),
    ([1, None], "None"),
    ([1, 2**70], str(2**70)),
])
def test_ids_outside_vocabulary_raise(ids, bad):
    with pytest.raises(ValueError, match=f"input_ids.*{bad}"):
        validate_token_ids("input_ids", ids, VOCAB)


def test_id_range_is_the_bounds_of_an_all_int_list_and_none_otherwise():
    assert id_range([5, 0, 17, 3]) == (0, 17)
    assert id_range([True, 4]) == (1, 4)  # bool is an int, as isinstance says
    assert id_range([-2, 9]) == (-2, 9)
    for bad in ([], [1, 2.0], [1, "2"], [1, None], [2**64]):
        assert id_range(bad) is None


def test_span_markers_pass_only_where_accepted():
    validate_token_ids("input_ids", [5, -1, 6, -2, 7, 1001], VOCAB, frozenset({-1, -2, 1001}))
    with pytest.raises(ValueError, match="-3"):
        validate_token_ids("input_ids", [5, -1, 6, -3], VOCAB, frozenset({-1, -2}))
    with pytest.raises(ValueError, match="-1"):
        validate_token_ids("input_ids", [5, -1, 6], VOCAB)


def _req(**fields):
    return SimpleNamespace(**{"top_logprobs_num": None, "token_ids_logprob": None, **fields})


@pytest.mark.parametrize("fields", [
    {}, {"top_logprobs_num": 0}, {"top_logprobs_num": 20}, {"top_logprobs_num": [5, 20]},
    {"token_ids_logprob": [0, 5, 999]}, {"token_ids_logprob": [[1], [2, 3]]},
])
def test_logprob_params_pass(fields):
    validate_logprob_params(_req(**fields), VOCAB)


@pytest.mark.parametrize("fields,needle", [
    ({"top_logprobs_num": 100000}, "top_logprobs_num"),
    ({"top_logprobs_num": 21}, r"\[0, 20\]"),
    ({"top_logprobs_num": -1}, "top_logprobs_num"),
    ({"top_logprobs_num": [1, 5000]}, "5000"),
    ({"top_logprobs_num": 3}, r"\[0, 2\]"),  # with a vocabulary of 2 (below)
    ({"token_ids_logprob": [1, 999999]}, "token_ids_logprob.*999999"),
    ({"token_ids_logprob": [[1], [-4]]}, "-4"),
    ({"token_ids_logprob": [1] * 1001}, "more than the vocabulary"),
])
def test_logprob_params_raise(fields, needle):
    vocab = 2 if fields.get("top_logprobs_num") == 3 else VOCAB
    with pytest.raises(ValueError, match=needle):
        validate_logprob_params(_req(**fields), vocab)


def test_logprob_entries_count_prompt_and_new_tokens_and_copies():
    """Tokens from ``logprob_start_len`` on and new tokens, x (1 + top + named), x the copies
    ``n`` makes (the prompt prefilled once more), summed over a batch; a text prompt counts its
    UTF-8 bytes over 4 before tokenization, its tokens after."""
    from sglang_pic.security.request_validation import (
        MAX_LOGPROB_ENTRIES,
        check_tokenized_logprobs,
        logprob_entries,
    )

    def req(**fields):
        return _req(**{"return_logprob": True, "logprob_start_len": 0, "text": None,
                       "input_ids": None, "sampling_params": {"max_new_tokens": 0}, **fields})

    assert logprob_entries(req(input_ids=[1] * 100, top_logprobs_num=4)) == 500
    assert logprob_entries(req(input_ids=[1] * 100, logprob_start_len=-1)) == 0
    assert logprob_entries(req(input_ids=[1] * 100, return_logprob=False)) == 0
    assert logprob_entries(req(text="é" * 10, logprob_start_len=6)) == 5  # 20 bytes / 4
    assert logprob_entries(req(input_ids=[1] * 10, sampling_params={"n": 4})) == 5 * 10 + 4 * 128
    assert logprob_entries(req(input_ids=[1] * 10, sampling_params={"max_new_tokens": None}),
                           context_len=50) == 10 + 40
    batch = req(input_ids=[[1] * 10, [1] * 20], return_logprob=[True, False],
                logprob_start_len=[2, 0], token_ids_logprob=[[1, 2], [3]],
                sampling_params=[{"max_new_tokens": 3}, {}])
    assert logprob_entries(batch) == (8 + 3) * 3
    tokens = MAX_LOGPROB_ENTRIES // 21 + 1  # a prompt of this many, 20 alternatives each
    validate_logprob_params(req(input_ids=[1] * (tokens - 1), top_logprobs_num=20), VOCAB)
    with pytest.raises(ValueError, match="logprob entries"):
        validate_logprob_params(req(input_ids=[1] * tokens, top_logprobs_num=20), VOCAB)
    with pytest.raises(ValueError, match="logprob entries"):  # over a batch
        validate_logprob_params(req(input_ids=[[1] * (tokens // 2 + 1)] * 2,
                                    top_logprobs_num=[20, 20]), VOCAB)
    with pytest.raises(ValueError, match="logprob entries"):  # n copies
        validate_logprob_params(req(input_ids=[1] * (tokens // 100), top_logprobs_num=20,
                                    sampling_params={"n": 128, "max_new_tokens": 0}), VOCAB)
    # after tokenization: a text prompt's exact tokens, and what its context leaves for new ones
    manager = SimpleNamespace(context_len=tokens + 10)
    check_tokenized_logprobs(manager, req(text="x", logprob_start_len=tokens - 8,
                                          top_logprobs_num=20), [1] * tokens)
    with pytest.raises(ValueError, match="logprob entries"):
        check_tokenized_logprobs(manager, req(text="x", top_logprobs_num=20), [1] * tokens)
    with pytest.raises(ValueError, match="logprob entries"):
        check_tokenized_logprobs(SimpleNamespace(context_len=10 * tokens), req(
            text="x", top_logprobs_num=20, logprob_start_len=-1,
            sampling_params={"max_new_tokens": None}), [1] * 8)


def test_top_logprobs_cap_applies_to_large_vocabularies():
    validate_logprob_params(_req(top_logprobs_num=MAX_TOP_LOGPROBS), 10**6)
    with pytest.raises(ValueError, match="top_logprobs_num"):
        validate_logprob_params(_req(top_logprobs_num=MAX_TOP_LOGPROBS + 1), 10**6)


def test_constrained_field_and_availability():
    assert constrained_field({"max_new_tokens": 3}) is None
    assert constrained_field({"regex": "[0-9]+"}) == "regex"
    assert constrained_field([{}, {"json_schema": "{}"}]) == "json_schema"
    assert constrained_decoding_available(SimpleNamespace(device="cuda", grammar_backend="xgrammar"))
    # CPU without cpu_grammar's hooks registered in this (test) process: refused
    assert not constrained_decoding_available(SimpleNamespace(device="cpu", grammar_backend="xgrammar"))


def test_reserved_request_ids():
    validate_rid("my-request")
    validate_rid(["a", "b"])
    with pytest.raises(ValueError, match="reserved"):
        validate_rid("pic-span-0123")
    with pytest.raises(ValueError, match="reserved"):
        validate_rid(["a", "pic-span-x"])
    with pytest.raises(ValueError, match="reserved"):
        validate_rid("pic")  # aborting it would abort every span sub-request (prefix match)


@pytest.mark.parametrize("body,needle", [
    (b'"hello"', "must be a JSON object"),
    (b"[1, 2]", "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (b'{not json', "not valid JSON"),
    (b'{"model": "m", "messages": "not a list"}', "messages"),
    (b'{"model": "m", "messages": [], "response_format": "x"}', "malformed"),
])
def test_openai_bodies_that_crash_sglang_are_refused(body, needle):
    """The front door's schema for the chat route: SGLang's validators raised AttributeError on
    some of these (a 500); every one is a BodyError (400) naming the problem."""
    from sglang_pic.frontdoor.schemas import BodyError, check_body

    with pytest.raises(BodyError, match=needle):
        check_body("/v1/chat/completions", body, lambda: 100)
    check_body("/v1/chat/completions",
               b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', lambda: 100)
