"""`sglang-pic serve --sparse-decode pariskv` on the CPU engine (SmolLM2-135M, real weights).

The sparse server decodes requests over 700 tokens with ParisKV (sink 16, local 128, update 16,
64 keys retrieved per KV head: ~20 % of a 1.2K-token context is attended per step) and must
answer exactly what the plain server answers: needle prompts whose answer sits deep in the
retrieval region, decoded long enough for the window to slide into the region, batched with a
short request that stays dense.
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import start_servers, stop_server
from sglang_pic.launcher.launch_server import SPAN_OPTIONS, build_argv, our_flags_help

SPARSE_FLAGS = ["--sparse-decode", "pariskv", "--sparse-threshold", "700", "--sparse-local",
                "128", "--sparse-update", "16", "--sparse-topk", "64", "--max-total-tokens",
                "16384", "--enable-metrics"]  # the offloading server replaces the last three
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back. "
SP = {"max_new_tokens": 20, "temperature": 0}  # the window slides after 16 (CPU steps ~1 s)
SHORT_TURN = {"max_new_tokens": 8, "temperature": 0}


def needle(n_fill: int, pos: int, key: int) -> str:
    parts = [FILLER] * n_fill
    parts.insert(pos, f"The special magic number is {key}. Remember it. ")
    return "".join(parts) + "\nWhat is the special magic number? The special magic number is"


@pytest.fixture(scope="module")
def sparse_servers(tmp_path_factory):
    """The sparse server and the offloading one, started together."""
    logs = tmp_path_factory.mktemp("sparse")
    # the offloading server's host region holds 4096 tokens per request, below SmolLM2's 8192:
    # longer requests are 400s; its pool (2048 tokens, 256-token chunks) is smaller than the
    # longest prompt it serves
    servers = start_servers({
        "sparse": (SPARSE_FLAGS, logs / "server.log"),
        "offload": ([*SPARSE_FLAGS[:-3], "--max-total-tokens", "2048", "--enable-metrics",
                     "--sparse-offload", "--sparse-max-context", "4096",
                     "--chunked-prefill-size", "256"], logs / "offload.log"),
    })
    yield servers
    for srv in servers.values():
        stop_server(srv)


@pytest.fixture(scope="module")
def sparse_server(sparse_servers):
    return sparse_servers["sparse"]


def _generate(server, text: str, sp: dict = SP) -> dict:
    r = server.post("/generate", timeout=600, json={"text": text, "sampling_params": sp})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def dense(server):
    """The plain server's answer to a prompt, each asked once for the whole module."""
    answers: dict[tuple, dict] = {}

    def answer(text: str, sp: dict = SP) -> dict:
        key = (text, tuple(sorted(sp.items())))
        if key not in answers:
            answers[key] = _generate(server, text, sp)
        return answers[key]

    return answer


KEYS = [random.Random(i).randint(10000, 99999) for i in range(2)]
LONG = [needle(56, 10, KEYS[0]), needle(56, 38, KEYS[1])]  # ~1.2K tokens
SHORT = "Write one sentence about the sea."


def test_sparse_decode_answers_like_dense(sparse_server, dense):
    texts = [LONG[0], SHORT, LONG[1]]
    with ThreadPoolExecutor(6) as pool:  # two long and a short request decode in one batch,
        # on each server (the plain one's answers are the module's reference)
        sparse = pool.map(lambda t: _generate(sparse_server, t), texts)
        wanted = pool.map(dense, texts)
        sparse, wanted = list(sparse), list(wanted)
    for s, want in zip(sparse, wanted, strict=True):
        assert s["text"] == want["text"]
    assert str(KEYS[0]) in sparse[0]["text"] and str(KEYS[1]) in sparse[2]["text"]
    assert sparse[0]["meta_info"]["prompt_tokens"] > 1100
    log = sparse_server.log.read_text()
    assert log.count("decodes sparsely") == 2  # the two long requests, not the short one
    values = sparse_server.metrics("sglang_pic:sparse_")
    assert values["sglang_pic:sparse_activated_total"] == 2
    assert values["sglang_pic:sparse_decode_steps_total"] >= 2 * 19  # 20 tokens: 19 decode steps
    # each region: the prompt less sink and window (~1K), then 16 more when the window slid
    assert values["sglang_pic:sparse_encoded_tokens_total"] > 2 * (1100 - 144 + 16)


def test_the_next_turn_encodes_only_its_new_tokens_and_answers_like_dense(sparse_server,
                                                                           dense):
    """A conversation's second turn, whose prompt is the first turn's prompt and answer (the
    radix cache holds them), finds the first turn's retrieval region encoded in the slot it
    left and encodes only the rest; it still answers like dense. Short turns (the answer's five
    digits fit 8 tokens): the region's reuse does not need the window to slide."""
    first = _generate(sparse_server, LONG[0], SHORT_TURN)
    before = sparse_server.metrics("sglang_pic:sparse_")
    follow = LONG[0] + first["text"] + "\nOnce more: what is the special magic number? It is"
    second = _generate(sparse_server, follow, SHORT_TURN)
    after = sparse_server.metrics("sglang_pic:sparse_")
    reused = after["sglang_pic:sparse_reused_tokens_total"] \
        - before["sglang_pic:sparse_reused_tokens_total"]
    encoded = after["sglang_pic:sparse_encoded_tokens_total"] \
        - before["sglang_pic:sparse_encoded_tokens_total"]
    assert reused > 900  # the first turn's region: ~1.1K prompt tokens less sink and window
    assert 0 < encoded < reused / 4  # its own new tokens, and the window's slides
    assert second["text"] == dense(follow, SHORT_TURN)["text"] and str(KEYS[0]) in second["text"]


@pytest.fixture(scope="module")
def offload_server(sparse_servers):
    return sparse_servers["offload"]


def test_offloaded_sparse_decode_answers_like_dense(offload_server, dense):
    """``--sparse-offload``: the retrieval region's KV in host memory, its pool slots freed,
    SGLang's own frees of the request's row (at its end) kept off the padding slot."""
    with ThreadPoolExecutor(2) as pool:  # a long and a short request decode in one batch
        offloaded = list(pool.map(lambda t: _generate(offload_server, t), [LONG[1], SHORT]))
    assert [o["text"] for o in offloaded] == [dense(LONG[1])["text"], dense(SHORT)["text"]]
    assert str(KEYS[1]) in offloaded[0]["text"]
    log = offload_server.log.read_text()
    # the long one takes its slot in its prefill (256-token chunks, past the threshold)
    assert "offloaded to" in log and log.count("offloads its prefill after") == 1
    assert log.count("decodes sparsely") == 0
    assert "memory leak" not in log and "double free" not in log and "use-after-free" not in log
    values = offload_server.metrics("sglang_pic:sparse_")
    assert values["sglang_pic:sparse_offloaded_tokens_total"] > 1100 - 144 + 16
    assert values["sglang_pic:sparse_offloaded_tokens_total"] \
        == values["sglang_pic:sparse_encoded_tokens_total"]


def test_a_prompt_longer_than_the_pool_prefills_with_its_chunks_in_host_memory(offload_server,
                                                                              server):
    """Issue 27 item 4 at CPU scale: a 2.3K-token prompt on a 2048-token pool. Past the
    threshold each chunk first moves the finished positions to host memory and attends them
    from there (exactly), so SGLang admits a prompt its pool cannot hold, and the answer (8
    tokens: the needle is the first) is the plain server's."""
    text = needle(100, 50, KEYS[0])
    sp = {"max_new_tokens": 8, "temperature": 0}
    got, want = (s.post("/generate", timeout=600, json={"text": text, "sampling_params": sp})
                 for s in (offload_server, server))
    assert got.status_code == want.status_code == 200, got.text
    got, want = got.json(), want.json()
    assert got["meta_info"]["prompt_tokens"] > 2048
    assert got["text"] == want["text"]
    assert str(KEYS[0]) in got["text"]
    log = offload_server.log.read_text()
    assert "offloads its prefill after" in log


def test_a_request_longer_than_the_host_region_is_refused_with_the_gib(offload_server):
    """Issue 27 "bad input": with ``--sparse-offload`` a request over ``--sparse-max-context``
    (prompt + max_new_tokens) is an HTTP 400 naming the GiB, not a dense decode from the pool;
    the server keeps serving."""
    r = offload_server.post("/generate", timeout=600,
                            json={"text": needle(250, 100, 12345), "sampling_params": SP})
    assert r.status_code == 400, r.text
    assert "GiB of host KV" in r.text and "--sparse-max-context 4096" in r.text
    r = offload_server.post("/generate", timeout=600, json={
        "text": LONG[0], "sampling_params": {**SP, "max_new_tokens": 3000}})
    assert r.status_code == 400 and "+ 3000 new" in r.text, r.text
    assert _generate(offload_server, SHORT)["meta_info"]["completion_tokens"] > 0  # still up


@pytest.mark.parametrize("argv,message", [
    (["--sparse-decode", "magic"], "supports 'pariskv'"),
    (["--sparse-offload"], "need --sparse-decode pariskv"),
    (["--sparse-topk", "8"], "need --sparse-decode pariskv"),
    (["--sparse-decode", "pariskv", "--sparse-threshold", "100"], "threshold"),
    (["--sparse-decode", "pariskv", "--sparse-topk", "x"], "not an integer"),
    pytest.param(["--sparse-decode", "pariskv", "--enable-span-cache"], "does not combine",
                 marks=pytest.mark.capability("spans")),
    (["--sparse-decode", "pariskv", "--attention-backend", "fa3"], "needs --attention"),
    # issue 27: the default threshold (32768) is above SmolLM2's context (its config.json)
    (["--sparse-decode", "pariskv"], r"context length is 8192 tokens \(the model's config"),
    (["--sparse-decode", "pariskv", "--sparse-threshold", "8192"], "lower --sparse-threshold"),
    # issue 27: a host region larger than the host's memory is refused before SGLang starts
    (["--sparse-decode", "pariskv", "--sparse-threshold", "700", "--sparse-offload",
      "--sparse-max-requests", "100000"], r"GiB of host memory for their KV .* are available"),
])
def test_bad_sparse_flags_are_refused_before_start(argv, message, model_dir):
    with pytest.raises(SystemExit, match=message):
        build_argv(["--model-path", str(model_dir), *argv])


def test_sparse_decode_picks_the_twin_backend(model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_PIC_SPARSE_TOPK", "100")  # restored (unset) after the test
    argv = build_argv(["--model-path", str(model_dir), "--sparse-decode", "pariskv",
                       "--sparse-threshold", "700", "--sparse-topk", "32",
                       "--attention-backend", "torch_native"])
    assert argv[argv.index("--attention-backend") + 1] == "pariskv_torch_native"
    assert os.environ["SGLANG_PIC_SPARSE_TOPK"] == "32"


def test_sparse_offload_turns_prefix_caching_off(model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_PIC_SPARSE_OFFLOAD", "0")  # restored (unset) after the test
    argv = build_argv(["--model-path", str(model_dir), "--sparse-decode", "pariskv",
                       "--sparse-threshold", "700", "--sparse-offload"])
    assert "--disable-radix-cache" in argv and "--sparse-offload" not in argv
    assert os.environ["SGLANG_PIC_SPARSE_OFFLOAD"] == "1"


def test_serve_help_lists_every_flag_of_ours():
    from sglang_pic import sparse

    text = our_flags_help()
    for flag in [*sparse.OPTIONS, *SPAN_OPTIONS, sparse.FLAG, sparse.OFFLOAD_FLAG, "--ptstore",
                 "--ptstore-token-file",
                 "--enable-position-free-kv", "--enable-span-cache"]:
        assert f"  {flag} " in text, flag


def test_the_admission_config_is_parsed_once_per_setting(monkeypatch):
    """``SparseDecodeConfig.current()``, which the per-request admission hook asks, equals a fresh
    parse of the environment, is one object while the variables stay, and follows a change."""
    from sglang_pic.sparse.config import SparseDecodeConfig

    name = SparseDecodeConfig.env_name("reselect_interval")
    monkeypatch.setenv(name, "4")
    first = SparseDecodeConfig.current()
    assert first == SparseDecodeConfig.from_env() and first.reselect_interval == 4
    assert SparseDecodeConfig.current() is first
    monkeypatch.setenv(name, "2")
    assert SparseDecodeConfig.current().reselect_interval == 2
