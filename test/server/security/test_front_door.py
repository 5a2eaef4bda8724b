"""The HTTP front door against an attacker (issue 54): every test names the attack it stops.

1. code execution through ``/update_weights_from_tensor`` (SGLang unpickles its body) with the
   normal key, and with the admin key unless ``--enable-weights-from-tensor``;
2. admin endpoints (logging, profiling, dumps, abort, pause, weights) open to the normal key;
3. single requests that killed the scheduler (``top_k`` 2**31, ``logprob_start_len`` -5, lists
   in single requests, empty prompts, internal fields);
4. keys in request dumps; idle and slow connections exhausting file descriptors; bodies of any
   size; the 500s of malformed bodies.

Unit tests check the schemas and tables directly; the rest run against one server started with
an admin key, a path root and small limits. Every refusal is a 4xx with a message, and the server
answers the probe with the same greedy output afterwards.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pickle
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import Server, start_server, stop_server
from sglang_pic.frontdoor import endpoints, paths, schemas
from sglang_pic.frontdoor.endpoints import Access
from sglang_pic.security.redaction import REDACTED, redact_argv

PROBE = {"text": "The capital of France is",
         "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
RCE = base64.b64encode(b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR"
                       b"(S'touch PWNED'\ntR0]." ).decode()
KILLERS = [  # each ended the server for every client (issue 54, item 3)
    {"text": "hi", "sampling_params": {"max_new_tokens": 2, "top_k": 2147483648}},
    {"text": "hi there friend", "return_logprob": True, "logprob_start_len": -5,
     "sampling_params": {"max_new_tokens": 2}},
    {"text": "hi", "return_logprob": True, "logprob_start_len": [0]},
    {"text": "hi", "return_logprob": True, "top_logprobs_num": [5]},
    {"text": "hi", "extra_key": ["a"]},
    {"text": "hi", "return_hidden_states": [False]},
    {"input_ids": [[]]},
    {"text": "hi", "positional_embed_overrides": {"x": 1}},
    # found by red-teaming the front door
    {"text": "hi", "sampling_params": {"logit_bias": {"5": 1e300}}},  # float32 overflow
    {"text": "hi", "sampling_params": {"stop_regex": "(.+)+#", "max_new_tokens": 200}},  # ReDoS
    {"text": ["a"] * 1024, "token_ids_logprob": list(range(1000)),  # copied 131,072 times
     "sampling_params": {"n": 128}},
    {"text": "hi", "lora_id": "x"},  # an internal id: an assert in the scheduler
    {"text": "hi", "custom_labels": {"x": "y"}},  # with --enable-metrics: an unknown label
    {"text": "hi", "return_sampling_mask": True, "sampling_params": {"top_k": 2000000000}},
    # SGLang 0.5.23: a prefill of no token stops its scheduler
    {"text": "", "sampling_params": {"max_new_tokens": 4}},
    {"text": ["hi", ""]},
    # SGLang 0.5.23's fields of unvalidated shape
    {"text": "hi", "watermark": {"key": [1] * 8}},
    {"text": "hi", "kv_hints": {"x": 1}},
    {"text": "hi", "data_parallel_rank": 7},
]
FIVE_HUNDREDS = [  # each was a 500 (issue 54, item 4)
    ("/generate", {"text": "hi", "sampling_params": {"stop_regex": "("}}),
    ("/generate", {"text": "hi", "sampling_params": [{"max_new_tokens": 1}]}),
    ("/generate", {"text": "hi", "rid": ["a"]}),
    ("/generate", {"input_embeds": []}),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]}),
    ("/generate", {"input_ids": [[1], []]}),
    ("/v1/detokenize", {"tokens": [-1]}),
    ("/api/chat", {"model": "m", "messages": [], "options": {"num_predict": 2}}),
    ("/vertex_generate", {"instances": [{"text": "hi"}]}),
    ("/parse_function_call", {"text": "x", "tool_call_parser": "nope", "tools": []}),
    ("/separate_reasoning", {"text": "x", "reasoning_parser": "nope"}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "top_k": 2147483648}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "top_k": 2147483648}),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "top_k": 2147483648,
                      "messages": [{"role": "user", "content": "hi"}]}),
    # found by red-teaming the front door
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"chat_template": "{{ 'x' * 10**10 }}"}}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "logit_bias": {"5": 1e300}}),
    ("/v1/completions", {"model": "m", "prompt": ["a"] * 1024, "n": 128, "max_tokens": 1}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "lora_path": ["a", "b"]}),
]
VOCAB = 49152


# ---- tables and schemas, no server ---------------------------------------------------------------


def test_every_generate_field_is_classified():
    """A field SGLang adds to GenerateReqInput is refused until it is named here: the schema is
    derived from the dataclass, not from the cases reported so far."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    fields = {f.name for f in dataclasses.fields(GenerateReqInput)}
    known = set(schemas.CLIENT_FIELDS) | set(schemas.REFUSED_FIELDS) | {"sampling_params"}
    assert fields - known == set()
    assert set(schemas.CLIENT_FIELDS) & set(schemas.REFUSED_FIELDS) == set()


def test_a_field_of_another_release_is_unknown():
    """``cache_salt`` (0.5.23's per-tenant prefix-cache namespace) is taken where the installed
    ``GenerateReqInput`` has it, and refused as unknown where it does not."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    body = json.dumps({"text": "hi", "cache_salt": "tenant-7"}).encode()
    if "cache_salt" in {f.name for f in dataclasses.fields(GenerateReqInput)}:
        schemas.check_body("/generate", body, lambda: VOCAB)
    else:
        with pytest.raises(schemas.BodyError, match="unknown field 'cache_salt'"):
            schemas.check_body("/generate", body, lambda: VOCAB)


@pytest.mark.parametrize("body", KILLERS)
def test_scheduler_killers_fail_the_schema(body):
    with pytest.raises(schemas.BodyError):
        schemas.check_body("/generate", json.dumps(body).encode(), lambda: VOCAB)


@pytest.mark.parametrize("path,body", [c for c in FIVE_HUNDREDS if c[0] in schemas.BODY_ROUTES])
def test_malformed_bodies_fail_the_schema(path, body):
    with pytest.raises(schemas.BodyError):
        schemas.check_body(path, json.dumps(body).encode(), lambda: VOCAB)


@pytest.mark.parametrize("path,body", [
    ("/generate", PROBE),
    ("/generate", {"input_ids": [[1, 2], [3]], "sampling_params": [{}, {"max_new_tokens": 1}],
                   "rid": ["a", "b"], "return_logprob": [True, False]}),
    ("/generate", {"text": "x", "return_logprob": True, "logprob_start_len": -1,
                   "top_logprobs_num": 3, "token_ids_logprob": [1, 2], "stream": True}),
    # what SGLang's router (sglang-router 0.3.2, `sglang-pic fleet`) forwards
    ("/generate", {"text": "hi", "model": None, "sampling_params": {"max_new_tokens": 8},
                   "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                   "return_hidden_states": False, "background": False, "no_logs": False,
                   "return_bytes": False, "return_entropy": False}),
    ("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 2}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 2, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "system": "be brief",
                      "messages": [{"role": "user", "content": [{"type": "text",
                                                                  "text": "hi"}]}]}),
    ("/v1/tokenize", {"prompt": "hi"}),
    ("/v1/detokenize", {"tokens": [[1, 2], [3]]}),
])
def test_valid_bodies_pass(path, body):
    schemas.check_body(path, json.dumps(body).encode(), lambda: VOCAB)


@pytest.mark.parametrize("raw,needle", [
    (b'{"text": "hi", "sampling_params": {"temperature": NaN}}', "not valid JSON"),
    (b'{"text": "hi", "unknown": 1}', "unknown field 'unknown'"),
    (b'{"text": "hi", "custom_logit_processor": "x"}', "run client code"),
    (b'{"text": "hi", "background": true}', "'background' is not accepted"),
    (b'{"text": "hi", "sampling_params": {"n": 1000}}', "<= 128"),
    (b'{"input_ids": [1, "2"]}', "invalid request body"),
    (b'{"text": ["a"], "rid": "x"}', "one id per prompt"),
    (b'{"text": "a", "input_ids": [1]}', "exactly one of"),
    (b'[1]', "invalid request body"),
])
def test_schema_messages_name_the_problem(raw, needle):
    with pytest.raises(schemas.BodyError, match=needle):
        schemas.check_body("/generate", raw, lambda: VOCAB)


@pytest.mark.parametrize("pattern,ok", [
    ("\\n\\n", True), ("(yes|no)[.]", True), ("a{0,20}b", True), ("(.+)+#", False),
    ("x*", False), ("(a{1,5}){1,5}", False), ("(?:a|b+){2}", False), ("(", False),
    ("a{0,300}", False),
])
def test_stop_regexes_the_scheduler_can_search(pattern, ok):
    """SGLang searches a stop regex at every decode step on the scheduler's thread: unbounded
    or nested repetitions would stall every client."""
    if ok:
        schemas.check_stop_regex(pattern)
    else:
        with pytest.raises(schemas.BodyError):
            schemas.check_stop_regex(pattern)


def test_routing_headers_are_dropped():
    from sglang_pic.frontdoor.middleware import _without_routing_headers

    scope = {"headers": [(b"x-data-parallel-rank", b"7"), (b"x-smg-routing-key", b"k" * 9999),
                         (b"x-override-priority", b"9"), (b"authorization", b"Bearer x")]}
    assert _without_routing_headers(scope)["headers"] == [(b"authorization", b"Bearer x")]


def test_the_allowlist():
    assert endpoints.access("POST", "/generate") is Access.INFERENCE
    assert endpoints.access("GET", "/v1/models/SmolLM2") is Access.INFERENCE
    assert endpoints.access("GET", "/v1/models/") is Access.UNKNOWN
    for path in endpoints.ADMIN:
        assert endpoints.access("POST", path) is Access.ADMIN
    for path in ("/generate/", "//generate", "/v1/responses", "/api/generate", "/docs",
                 "/openapi.json", "/vertex_generate", "/encode"):
        assert endpoints.access("POST", path) is Access.UNKNOWN, path
        assert endpoints.access("GET", path) is Access.UNKNOWN, path
    assert endpoints.PICKLED <= endpoints.ADMIN and set(endpoints.ADMIN_PATHS) <= endpoints.ADMIN


def test_every_sglang_route_is_classified():
    """SGLang's app routes are each inference, admin, or refused on purpose: a route a new
    SGLang adds answers 404 until it is placed (this lists what is refused, for review)."""
    from sglang.srt.entrypoints.http_server import app

    refused = set()
    for route in app.routes:
        for method in getattr(route, "methods", None) or ():
            if endpoints.access(method, route.path) is Access.UNKNOWN:
                refused.add(route.path)
    assert {"/generate", "/v1/chat/completions"}.isdisjoint(refused)
    assert "/update_weights_from_tensor" not in refused  # admin, not forgotten
    assert refused >= {"/vertex_generate", "/api/chat", "/parse_function_call", "/v1/responses"}


def test_admin_paths_are_confined(tmp_path):
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    (root / "link").symlink_to("/etc")
    allowed = paths.roots([str(root)])
    assert paths.confined(str(root / "ok" / "dump"), allowed)
    assert paths.confined(str(root), allowed)
    for bad in ("/tmp", str(root / ".." / "x"), str(root / "link" / "passwd"),
                str(root) + "-sibling", "", "a\x00b"):
        assert not paths.confined(bad, allowed), bad


def test_secrets_leave_the_dumped_command_line():
    argv = ["x", "--api-key", "K1", "--admin-api-key=K2", "--ssl-keyfile-password", "P",
            "--port", "1"]
    assert redact_argv(argv) == ["x", "--api-key", REDACTED, f"--admin-api-key={REDACTED}",
                                 "--ssl-keyfile-password", REDACTED, "--port", "1"]


# ---- a server with the admin API on, small limits -------------------------------------------------


ADMIN_KEY = "admin-" + "k" * 26
LIMITS = ["--max-request-mb", "1", "--http-header-timeout-s", "2", "--max-connections", "64",
          "--request-body-timeout-s", "3", "--http-write-timeout-s", "2"]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> Server:
    base = tmp_path_factory.mktemp("frontdoor")
    key_file = base / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    key_file.chmod(0o600)
    root = base / "root"
    root.mkdir()
    srv = start_server(["--max-total-tokens", "4096", "--admin-api-key-file", str(key_file),
                        "--admin-path-root", str(root), *LIMITS], base / "server.log")
    srv.root = root
    srv.baseline = srv.post("/generate", json=PROBE).json()["output_ids"]
    yield srv
    stop_server(srv)


def survived(srv: Server) -> None:
    assert srv.proc.poll() is None, srv.log.read_text()[-3000:]
    assert srv.post("/generate", json=PROBE).json()["output_ids"] == srv.baseline


def admin(srv: Server, path: str, **kwargs) -> requests.Response:
    return requests.post(srv.url + path, timeout=60,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **kwargs)


def test_weights_from_tensor_never_unpickles(guarded, tmp_path, monkeypatch):
    body = {"serialized_named_tensors": [RCE], "flush_cache": False}
    monkeypatch.chdir(tmp_path)
    r = guarded.post("/update_weights_from_tensor", json=body)
    assert r.status_code in (401, 403), r.text
    r = admin(guarded, "/update_weights_from_tensor", json=body)
    assert r.status_code == 403 and "--enable-weights-from-tensor" in r.text
    assert not list(Path(guarded.log.parent).rglob("PWNED")) and not Path("PWNED").exists()
    survived(guarded)


def test_no_admin_endpoint_answers_the_normal_key(guarded):
    for path in sorted(endpoints.ADMIN):
        for send in (guarded.post, guarded.get):
            r = send(path, timeout=30, json={})
            assert r.status_code in (401, 403, 405), (path, r.status_code, r.text[:200])
    survived(guarded)


def test_admin_endpoints_need_their_own_key_and_confined_paths(guarded):
    r = admin(guarded, "/configure_logging", json={"dump_requests_folder": "/tmp/anywhere"})
    assert r.status_code == 403 and "--admin-path-root" in r.text
    r = admin(guarded, "/start_profile", json={"output_dir": "/"})
    assert r.status_code == 403
    r = admin(guarded, "/stop_profile")  # no profile running: SGLang raised, a 500
    assert r.status_code == 409 and "not in progress" in r.text
    r = admin(guarded, "/flush_cache")
    assert r.status_code == 200
    survived(guarded)


@pytest.mark.parametrize("i", range(len(KILLERS)))
def test_requests_that_killed_the_scheduler(guarded, i):
    guarded.post("/generate", json={"text": "hi there friend",
                                    "sampling_params": {"max_new_tokens": 1}})  # now cached
    r = guarded.post("/generate", json=KILLERS[i])
    assert r.status_code == 400 and r.json()["error"]["message"], r.text
    survived(guarded)


@pytest.mark.parametrize("path,body", FIVE_HUNDREDS)
def test_bodies_that_were_500s(guarded, path, body):
    r = guarded.post(path, json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    survived(guarded)


def test_deep_nesting_is_a_400(guarded):
    """orjson parses up to 1024 levels, msgspec raised RecursionError below that: a 500 and a
    traceback in the log per request."""
    deep = "[" * 995 + "]" * 995
    for path, body in [("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", '
                        '"content": "hi"}], "chat_template_kwargs": {"a": ' + deep + '}}'),
                       ("/generate", '{"text": "hi", "sampling_params": {"custom_params": '
                        '{"a": ' + deep + '}}}')]:
        r = guarded.post(path, data=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
    survived(guarded)


def test_admin_get_bodies_are_checked_too(guarded):
    """SGLang's admin handlers parse a GET body as they parse a POST's."""
    r = requests.get(guarded.url + "/configure_logging", timeout=30,
                     json={"dump_requests_folder": "/tmp/anywhere"},
                     headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 403 and "--admin-path-root" in r.text


def test_a_401_says_what_to_send(guarded):
    port = guarded.url.rsplit(":", 1)[1]
    r = requests.post(guarded.url + "/generate", json=PROBE, timeout=30)
    assert r.status_code == 401
    assert "Authorization: Bearer" in r.json()["message"]
    assert f"api-keys/{port}" in r.json()["message"]
    r = requests.post(guarded.url + "/flush_cache", timeout=30,
                      headers={"Authorization": f"Bearer {guarded.api_key}"})
    assert r.status_code == 401 and "admin key" in r.json()["message"]


def test_health_generate_needs_the_key(guarded):
    assert requests.get(guarded.url + "/health_generate", timeout=30).status_code == 401
    assert requests.get(guarded.url + "/health", timeout=30).status_code == 200
    assert guarded.get("/health_generate").status_code == 200


def test_tokenize_answers(guarded):
    r = guarded.post("/v1/tokenize", json={"prompt": "hi"})
    assert r.status_code == 200 and r.json()["max_model_len"] == 8192
    r = guarded.post("/v1/detokenize", json={"tokens": r.json()["tokens"]})
    assert r.status_code == 200 and r.json()["text"] == "hi"


def test_markers_in_anthropic_messages_without_the_span_cache(guarded):
    r = guarded.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "a <|ssep|> b"}]})
    assert r.status_code == 400 and "--enable-span-cache" in r.text


def test_oversized_bodies_are_refused_unread(guarded):
    big = b'{"text": "' + b"a" * (3 << 20) + b'"}'
    t0 = time.monotonic()
    r = guarded.post("/generate", data=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-request-mb" in r.text
    assert time.monotonic() - t0 < 10

    def chunks():  # no content-length: counted as it arrives
        for _ in range(3 << 4):
            yield b"a" * (1 << 16)

    r = guarded.post("/generate", data=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    survived(guarded)


def test_a_trickled_body_times_out(guarded):
    with socket.create_connection(("127.0.0.1", int(guarded.url.rsplit(":", 1)[1]))) as s:
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  f"{guarded.api_key}\r\nContent-Length: 100\r\n\r\n{{".encode())
        s.settimeout(15)
        t0 = time.monotonic()
        answer = s.recv(4096)
    assert b" 408 " in answer.split(b"\r\n")[0] and time.monotonic() - t0 < 10


def test_idle_and_slow_connections_are_closed(guarded):
    """Connections that never finish a request head are closed after the header deadline, and
    past --max-connections the longest waiting make room; real requests are served
    meanwhile."""
    port = int(guarded.url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(150)]
    slow = socket.create_connection(("127.0.0.1", port))
    try:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        assert guarded.post("/generate", json=PROBE).json()["output_ids"] == guarded.baseline
        for s in idle[:80]:  # past the cap: the oldest waiting made room
            assert closed(s)
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
        for s in [*idle[-10:], slow]:
            for _ in range(3):  # a trickle does not extend the deadline
                try:
                    s.sendall(b"X-A: b\r\n")
                except OSError:
                    break
            assert closed(s)
    finally:
        for s in [*idle, slow]:
            s.close()
    survived(guarded)


def test_a_client_that_never_reads_loses_its_connection(guarded):
    """Requests pipelined on a connection whose client never reads: once the responses fill
    the buffers the server waits to write; after --http-write-timeout-s (2 s here) it aborts
    the connection instead of holding it (and its slot under --max-connections) for good."""
    port = int(guarded.url.rsplit(":", 1)[1])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    sent = 2000
    head = (f"GET /server_info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {guarded.api_key}"
            "\r\n\r\n").encode()
    try:
        s.settimeout(10)
        s.sendall(head * sent)
        time.sleep(6)  # the write deadline passes while nothing is read
        data = b""
        try:
            while chunk := s.recv(1 << 16):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        answers = data.count(b"HTTP/1.1 200")
    finally:
        s.close()
    assert 0 < answers < sent, answers
    survived(guarded)


def closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (waits up to 5 s)."""
    s.settimeout(5)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _first_whole_dump(folder: Path, deadline: float) -> tuple[Path | None, Any]:
    """A request dump of ``folder`` and what it holds, once one is whole: SGLang creates the
    file before it has written it (a read in between ran out of input on a busy machine)."""
    while time.time() < deadline:
        for path in folder.glob("*.pkl"):
            try:
                return path, pickle.loads(path.read_bytes())
            except (EOFError, pickle.UnpicklingError):
                pass  # still being written
        time.sleep(0.5)
    return None, None


def test_dumps_hold_no_secret(guarded):
    """Request dumps pickle SGLang's ServerArgs and command line: neither key is in any file
    the server wrote, nor in its log; the dumps are the server user's alone."""
    folder = guarded.root / "dumps"
    r = admin(guarded, "/configure_logging", json={"dump_requests_folder": str(folder),
                                                   "dump_requests_threshold": 1})
    assert r.status_code == 200, r.text
    guarded.post("/generate", json=PROBE)
    dump, data = _first_whole_dump(folder, time.time() + 30)
    assert dump is not None
    assert data["server_args"].api_key == REDACTED and data["resolved_config"]["api_key"] == REDACTED
    assert os.stat(dump).st_mode & 0o077 == 0
    admin(guarded, "/configure_logging", json={"dump_requests_folder": ""})
    for path in [*guarded.root.rglob("*"), guarded.log]:
        if path.is_file():
            content = path.read_bytes()
            assert guarded.api_key.encode() not in content, path
            assert ADMIN_KEY.encode() not in content, path


# ---- the fuzzer -------------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ_SECONDS = float(os.environ.get("SGLANG_PIC_FUZZ_SECONDS", "20"))
"""Wall-clock budget of ``test_fuzzed_bodies`` (the suite's default; a long run sets more)."""
BOUNDARY_INTS = [-2**63, -2**31 - 1, -2**31, -6, -5, -2, -1, 0, 1, 2, 5, 127, 128, 129, 1024,
                 49151, 49152, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64]
scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(BOUNDARY_INTS),
                    st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=12), st.sampled_from(["<|ssep|>", "<|pdep|>", "(", "a"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)
SAMPLING_KEYS = ["max_new_tokens", "top_k", "top_p", "temperature", "n", "stop", "stop_regex",
                 "stop_token_ids", "logit_bias", "min_new_tokens", "ignore_eos",
                 "stream_interval", "sampling_seed", "regex", "json_schema", "custom_params",
                 "no_such_param"]
OPENAI_KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "top_k",
               "n", "logprobs", "top_logprobs", "stop", "stream", "seed", "temperature",
               "response_format", "tools", "tool_choice", "logit_bias", "rid", "spans",
               "system", "stop_sequences", "tokens", "custom_logit_processor", "extra_body"]
VALID = {
    "/generate": [PROBE, {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2}},
                  {"text": ["a", "b"], "return_logprob": True, "top_logprobs_num": 2,
                   "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}],
    "/v1/completions": [{"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": 1}],
    "/v1/chat/completions": [{"model": "m", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "hi"}]}],
    "/v1/messages": [{"model": "m", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}],
    "/v1/tokenize": [{"prompt": "hi"}],
    "/v1/detokenize": [{"tokens": [1, 2]}],
}
TOKEN_CAPS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "min_new_tokens",
              "min_tokens")


@st.composite
def from_schema(draw) -> tuple[str, object]:
    """A body of the /generate schema's fields (accepted and refused ones), values drawn from
    each field's neighbourhood and from any JSON."""
    names = list(schemas.CLIENT_FIELDS) + list(schemas.REFUSED_FIELDS)[:6] + ["spans", "zzz"]
    body = {name: draw(json_values) for name in draw(st.lists(st.sampled_from(names),
                                                              max_size=4, unique=True))}
    body[draw(st.sampled_from(["text", "input_ids"]))] = draw(
        st.one_of(st.text(max_size=20), st.lists(st.integers(-3, 49160), max_size=6),
                  st.lists(st.lists(st.integers(-3, 49160), max_size=4), max_size=3),
                  st.lists(st.text(max_size=8), max_size=3), json_values))
    params = {k: draw(json_values) for k in draw(st.lists(st.sampled_from(SAMPLING_KEYS),
                                                          max_size=3, unique=True))}
    body["sampling_params"] = draw(st.one_of(st.just(params), st.lists(st.just(params),
                                                                       max_size=3), json_values))
    return "/generate", body


@st.composite
def mutated(draw) -> tuple[str, object]:
    """A valid body of any route with one to three mutations: a value replaced by any JSON,
    wrapped in a list, deleted, or a key added (top level or inside ``sampling_params``)."""
    path = draw(st.sampled_from(sorted(VALID)))
    body = json.loads(json.dumps(draw(st.sampled_from(VALID[path]))))
    for _ in range(draw(st.integers(1, 3))):
        target = body
        if isinstance(body.get("sampling_params"), dict) and draw(st.booleans()):
            target = body["sampling_params"]
        keys = list(target) + (SAMPLING_KEYS if target is not body else OPENAI_KEYS)
        key = draw(st.sampled_from(keys))
        action = draw(st.sampled_from(["replace", "wrap", "delete", "boundary"]))
        if action == "delete":
            target.pop(key, None)
        elif action == "wrap" and key in target:
            target[key] = [target[key]]
        elif action == "boundary":
            target[key] = draw(st.sampled_from(BOUNDARY_INTS))
        else:
            target[key] = draw(json_values)
    return path, body


def bounded(body: object) -> object:
    """The body with valid token counts capped at 4 and defaults set, so a fuzzed request that
    is valid decodes a few tokens, not the model's whole context (what is out of range stays)."""
    if not isinstance(body, dict):
        return body
    for params in [body, *(p for p in _as_list(body.get("sampling_params")) if isinstance(p, dict))]:
        for key in TOKEN_CAPS:  # null: no limit but the context
            if key in params and (params[key] is None or isinstance(params[key], int)
                                  and 4 < params[key] <= 2**31 - 1):
                params[key] = 4
        params.setdefault("max_new_tokens" if params is not body else "max_tokens", 4)
    if isinstance(body.get("sampling_params"), dict):
        body.pop("max_tokens", None)
    return body


def _as_list(value: object) -> list:
    return value if isinstance(value, list) else [value]


_fuzz = {"cases": 0, "start": None}


class BudgetSpent(BaseException):
    """Ends the fuzzer's run at its time budget (a BaseException: hypothesis passes it on
    without taking it for a failure to shrink)."""


def test_fuzzed_bodies(guarded):
    """Bodies generated from the schemas and mutations of valid ones: never a 5xx, never a
    dead scheduler, and the probe's greedy output unchanged afterwards."""
    _fuzz["start"] = time.monotonic()

    @settings(max_examples=100_000, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(from_schema(), mutated()))
    def case(route_body):
        if time.monotonic() - _fuzz["start"] > FUZZ_SECONDS:
            raise BudgetSpent
        path, body = route_body
        try:
            r = guarded.post(path, data=json.dumps(bounded(body)), timeout=60,
                             headers={"content-type": "application/json"})
        except requests.Timeout:
            pytest.fail(f"no answer in 60 s: {path} {json.dumps(body)[:500]}")
        _fuzz["cases"] += 1
        assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
        if _fuzz["cases"] % 50 == 0:
            survived(guarded)

    try:
        case()
    except BudgetSpent:
        pass
    survived(guarded)
    print(f"fuzzer: {_fuzz['cases']} requests in {time.monotonic() - _fuzz['start']:.0f} s")
    assert _fuzz["cases"] > 0
