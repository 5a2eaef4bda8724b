"""The main job on CPU: `sglang-pic serve` with the embedded SmolLM2 answers every API."""

from __future__ import annotations

import json

import pytest


def test_generate(server):
    r = server.post("/generate", json={"text": "The capital of France is",
                                        "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["text"]
    assert body["meta_info"]["completion_tokens"] == 8


def test_completions(server):
    r = server.post("/v1/completions", json={"model": "default", "prompt": "The capital of France is",
                                              "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 8


def test_chat_completions(server):
    r = server.post("/v1/chat/completions", json={
        "model": "default", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert "Paris" in msg["content"]


def test_chat_streaming_matches_non_streaming(server):
    req = {"model": "default", "max_tokens": 12, "temperature": 0,
           "messages": [{"role": "user", "content": "Name a color."}]}
    full = server.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    r = server.post("/v1/chat/completions", json={**req, "stream": True}, stream=True)
    assert r.status_code == 200
    pieces, done = [], False
    for line in r.iter_lines():
        if not line:
            continue
        data = line.decode().removeprefix("data: ")
        if data == "[DONE]":
            done = True
            break
        delta = json.loads(data)["choices"][0]["delta"]
        pieces.append(delta.get("content") or "")
    assert done
    assert len([p for p in pieces if p]) > 1, "expected several streamed chunks"
    assert "".join(pieces) == full


def test_repeated_prompt_reports_cached_tokens(server):
    text = "Caching test: " + "the same long prefix is sent twice. " * 10
    sp = {"max_new_tokens": 4, "temperature": 0}
    first = server.post("/generate", json={"text": text, "sampling_params": sp}).json()
    second = server.post("/generate", json={"text": text, "sampling_params": sp}).json()
    n = second["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] < n // 2
    assert second["meta_info"]["cached_tokens"] >= n - 1
    assert first["text"] == second["text"]


BAD_GENERATE = [
    ("malformed json", b"{bad json", "JSON"),
    ("empty prompt", {"text": "", "sampling_params": {"max_new_tokens": 4}}, "empty"),
    ("negative max_new_tokens", {"text": "hi", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ("wrong-typed max_new_tokens", {"text": "hi", "sampling_params": {"max_new_tokens": "abc"}}, "max_new_tokens"),
    ("wrong-typed temperature", {"text": "hi", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ("unknown sampling field", {"text": "hi", "sampling_params": {"foo": 1}}, "foo"),
    ("wrong-typed text", {"text": 123}, "text"),
    ("over-long prompt", {"text": "hello " * 20000, "sampling_params": {"max_new_tokens": 4}}, "context length"),
]

BAD_OPENAI = [
    ("/v1/completions", {"model": "default", "prompt": "", "max_tokens": 4}, "empty"),
    ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": "x"}, "max_tokens"),
    ("/v1/chat/completions", {"model": "default", "messages": "notalist"}, "messages"),
    ("/v1/chat/completions", {"model": "default", "messages": []}, "empty"),
    ("/v1/chat/completions", {"model": "default", "max_tokens": -5,
                              "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
]


@pytest.mark.parametrize("name,payload,needle", BAD_GENERATE, ids=[b[0] for b in BAD_GENERATE])
def test_bad_generate_requests_get_4xx(server, name, payload, needle):
    if isinstance(payload, bytes):
        r = server.post("/generate", data=payload, headers={"content-type": "application/json"})
    else:
        r = server.post("/generate", json=payload)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert needle.lower() in r.text.lower()
    assert server.healthy()


@pytest.mark.parametrize("path,payload,needle", BAD_OPENAI)
def test_bad_openai_requests_get_4xx(server, path, payload, needle):
    r = server.post(path, json=payload)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert needle.lower() in r.text.lower()
    assert server.healthy()


def test_server_still_answers_after_bad_requests(server):
    r = server.post("/generate", json={"text": "1, 2, 3,", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200
    assert r.json()["meta_info"]["completion_tokens"] == 4
