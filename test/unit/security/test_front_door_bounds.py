"""Front-door bounds that need no server: custom_params, grammar sizes, media parts, nesting,
logprob alternatives, admin file names, and health checks shared by concurrent probes."""

from __future__ import annotations

import asyncio
import json

import pytest
from sglang_pic.frontdoor import paths
from sglang_pic.frontdoor.refusal import Refused
from sglang_pic.frontdoor.schemas import (
    MAX_DEPTH,
    MAX_GRAMMAR_CHARS,
    MAX_TOOLS_CHARS,
    BodyError,
    check_body,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "f", "description": "d" * 40, "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}}}}
"""A tool definition of about 140 characters."""


def deep_schema(levels: int) -> dict:
    """A JSON schema of ``levels`` nested nullable objects (4 levels of JSON each)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": {"anyOf": [schema, {"type": "null"}]}}}
    return schema


def check(path: str, body: dict) -> None:
    check_body(path, json.dumps(body).encode(), lambda: 1000)


def nested(levels: int) -> list:
    out: list = []
    for _ in range(levels - 1):
        out = [out]
    return out


@pytest.mark.parametrize("path,body,needle", [
    ("/generate", {"text": "hi", "sampling_params": {"custom_params": {"session_id": "s" * 257}}},
     "session_id"),
    ("/generate", {"text": "hi", "sampling_params": {"custom_params": {"x": 1}}},
     "custom_params.x is not accepted"),
    ("/generate", {"text": "hi", "sampling_params": {"custom_params": {"app_type": "batch"}}},
     "app_type"),
    ("/generate", {"text": "hi", "sampling_params": {"custom_params": {"pic_spans": [0, 1, 1]}}},
     "set by the server"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": "a" * (MAX_GRAMMAR_CHARS + 1)}},
     "json_schema"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21},
     "top_logprobs_num"),
    ("/v1/chat/completions", {**CHAT, "custom_params": {"session_id": "s" * 1000}}, "session_id"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": 21, "echo": True}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": nested(MAX_DEPTH)}, f"deeper than {MAX_DEPTH}"),
    ("/v1/chat/completions", {**CHAT, "tools": nested(300)}, f"deeper than {MAX_DEPTH}"),
    ("/v1/chat/completions", {"model": "m", "tool_choice": "required", "messages": [
        {"role": "system", "content": "s", "tools": [TOOL] * (MAX_TOOLS_CHARS // 100)},
        {"role": "user", "content": "hi"}]}, "tool definitions are .* at most"),
    ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "description": "d" * MAX_GRAMMAR_CHARS}}}},
     "'response_format' is .* at most"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}]}]},
     r"messages\[0\].content\[1\] is a 'image_url' part: media are not served"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "file:///etc/passwd"}}]}]}, "video_url"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://10.0.0.1/"}}]}]}, "'image'"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://10.0.0.1/"}}]}]}]},
     r"content\[0\].content\[0\] is a 'image'"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "search_result", "source": "s", "title": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://10.0.0.1/"}}]}]}]},
     r"content\[0\].content\[0\] is a 'image'"),
])
def test_unbounded_or_media_fields_are_a_400(path, body, needle):
    with pytest.raises(BodyError, match=needle):
        check(path, body)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "hi", "sampling_params": {"custom_params": {
        "session_id": "conv-1", "app_type": "chat"}}}),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 20,
                   "sampling_params": {"regex": "[0-9]{1,3}"}}),
    ("/v1/chat/completions", {**CHAT, "custom_params": {"session_id": "conv-1"},
                              "logprobs": True, "top_logprobs": 20,
                              "tools": [{"type": "function", "function": {
                                  "name": "f", "parameters": {"type": "object", "properties": {
                                      "a": {"type": "array", "items": {"type": "string"}}}}}}]}),
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"},
                                          {"type": "text", "text": "hello"}]},
        {"role": "user", "content": "and then?"}]}),
    # an agent's many tools, and a strict schema of 12 nested nullable objects
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL] * 500}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": deep_schema(12)}}}),
    ("/generate", {"text": "hi", "sampling_params": {"custom_params": {"session_id": 42}}}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "system": [{"type": "text", "text": "s"}],
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
])
def test_what_clients_send_passes(path, body):
    check(path, body)


BIG = 2**64  # one past the unsigned 64-bit range; -(2**63) - 1 is one below the signed one


@pytest.mark.parametrize("path,body", [
    ("/v1/detokenize", {"tokens": [1, 2], "response_format": BIG}),  # found by the fuzzer
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "maximum": BIG}}}}),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "minimum": -(2**63) - 1}}}]}),
    ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": "hi", "name": "n", "weight": BIG}]}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "seed": BIG}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "metadata": {"n": [BIG]},
                      "messages": [{"role": "user", "content": "hi"}]}),
])
def test_an_integer_orjson_cannot_write_is_a_400_wherever_it_is(path, body):
    """orjson (SGLang's and our re-serialisation) raises on integers outside 64 bits: a body
    holding one, in a field typed ``Any`` too, is refused instead of failing with a 500."""
    import orjson

    with pytest.raises(TypeError):
        orjson.dumps(body)
    with pytest.raises(BodyError, match="outside the 64-bit range"):
        check(path, body)


def test_the_64_bit_extremes_pass():
    schema = {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}
    check("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})


def test_profile_names_may_not_lead_out_of_the_output_folder(tmp_path):
    def body(**fields) -> bytes:
        return json.dumps({"output_dir": str(tmp_path), **fields}).encode()

    roots = paths.roots([str(tmp_path)])
    names = ("profile_prefix", "profile_id")
    paths.check_admin_body(body(profile_prefix="run-1", profile_id="a"), ("output_dir",), roots,
                           names)
    for bad in ("../../etc/cron.d/x", "/tmp/x", "a/b", ".."):
        with pytest.raises(Refused, match="plain name"):
            paths.check_admin_body(body(profile_prefix=bad), ("output_dir",), roots, names)
    with pytest.raises(Refused, match="plain name"):
        paths.check_admin_body(body(profile_id=5), ("output_dir",), roots, names)


def test_every_path_field_of_a_corpus_is_confined(tmp_path):
    from sglang_pic.frontdoor.endpoints import ADMIN_PATHS

    fields = ADMIN_PATHS["/add_external_corpus"]
    assert "file_path" in fields
    with pytest.raises(Refused, match="outside"):
        paths.check_admin_body(json.dumps({"file_path": "/etc/passwd"}).encode(), fields,
                               paths.roots([str(tmp_path)]))


class _SlowHealth:
    """An ASGI app whose health check takes a while; counts the checks it ran."""

    def __init__(self, status: int = 200, fail: bool = False) -> None:
        self.calls, self.status, self.fail = 0, status, fail

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1
        await asyncio.sleep(0.05)
        if self.fail:
            raise RuntimeError("scheduler gone")
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _door(app):
    from sglang_pic.frontdoor.middleware import FrontDoor, FrontDoorConfig

    return FrontDoor(app, FrontDoorConfig(1 << 20, 5.0, None, (), False, False, lambda: 1000))


async def _probe(door) -> int:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await door({"type": "http", "method": "GET", "path": "/health", "headers": []}, receive,
               send)
    return sent[0]["status"]


@pytest.mark.parametrize("status", [200, 503])
def test_concurrent_probes_share_one_health_check(status):
    """A flood of keyless probes runs one check at a time: no probe is turned away for want
    of a slot, and a passing answer serves the probes of the next second too."""
    app = _SlowHealth(status)

    async def run():
        door = _door(app)
        first = await asyncio.gather(*(_probe(door) for _ in range(50)))
        again = await _probe(door)
        return first, again

    first, again = asyncio.run(run())
    assert first == [status] * 50 and again == status
    assert app.calls == (1 if status == 200 else 2)  # a failed check is not reused


def test_a_health_check_that_raises_is_a_503_for_every_waiting_probe():
    app = _SlowHealth(fail=True)

    async def run():
        door = _door(app)
        return await asyncio.gather(*(_probe(door) for _ in range(5)))

    assert asyncio.run(run()) == [503] * 5 and app.calls == 1
