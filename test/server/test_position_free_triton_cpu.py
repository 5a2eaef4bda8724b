"""`pic_triton` on CPU: our rotating Triton kernels (TRITON_INTERPRET=1) inside SGLang's Triton
attention backend give HF transformers' greedy tokens, including through a prefix-cache hit, and
on span prompts (a cached document read at another offset: keys turned by the distance they
moved, what batches with span requests run on a GPU) the HF block-attention reference's.

Its own module so that the other position-free servers are down while the interpreter runs
(every Triton program is executed in Python; CPU cores are the bottleneck).
"""

from __future__ import annotations

import json

import pytest
from conftest import assert_top_logprobs_match, start_server, stop_server

pytestmark = pytest.mark.capability("spans")  # its server serves spans

PROMPTS = ["The capital of France is", "List three prime numbers:"]
LAYERS = 8
"""The model's first layers only, on both sides (the server's ``--json-model-override-args``,
HF's config): each interpreted step runs our kernels once per layer, and the kernels' parity
does not depend on the depth."""
STORY = "Once upon a time, in a land far away, " * 3  # > 16 tokens: one cached page


@pytest.fixture(scope="module")
def triton_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("position_free_triton") / "server.log"
    # one KV split: fewer Triton programs for the interpreter to run; no warm-up request (8
    # tokens of interpreted kernels: the start's health check runs a forward pass already)
    srv = start_server(["--max-total-tokens", "4096", "--page-size", "16",
                        "--enable-span-cache", "--attention-backend", "triton",
                        "--triton-attention-num-kv-splits", "1", "--skip-server-warmup",
                        "--json-model-override-args", json.dumps({"num_hidden_layers": LAYERS})],
                       log)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def hf_greedy(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 num_hidden_layers=LAYERS).eval()

    def run(text: str, n: int) -> tuple[list[int], list[int]]:
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=n, do_sample=False)
        return ids[0].tolist(), gen[0, ids.shape[1]:].tolist()

    return run


def _generate(server, input_ids, n):
    r = server.post("/generate", timeout=600, json={
        "input_ids": input_ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()


def test_triton_kernels_in_sglang_match_hf(triton_server, hf_greedy):
    info = triton_server.get("/get_server_info").json()
    assert info["attention_backend"] == "pic_triton"
    refs = [hf_greedy(p, 3) for p in PROMPTS]
    outs = _generate(triton_server, [ids for ids, _ in refs], 3)
    for (_, want), got in zip(refs, outs, strict=True):
        assert got["output_ids"][: len(want)] == want


def test_prefix_hit_through_rotating_extend_kernel(triton_server, hf_greedy):
    first_ids, _ = hf_greedy(STORY + "the king said", 1)
    _generate(triton_server, first_ids, 1)
    ids, want = hf_greedy(STORY + "the queen asked", 2)
    out = _generate(triton_server, ids, 2)
    assert out["meta_info"]["cached_tokens"] >= 16  # the story's first page, from the cache
    assert out["output_ids"][: len(want)] == want


def test_a_document_moved_to_another_offset_follows_the_block_attention_reference(
        triton_server, model_dir):
    """The document is computed as a span unit (from position 0) for the first prompt, then read
    after a longer system prompt and in second place: its keys are turned by the offsets."""
    import torch
    from sglang_pic.spans.reference import block_attention_greedy
    from sglang_pic.spans.request import PDEP_ID, SSEP_ID, layout_prompt
    from sglang_pic.spans.segments import decode_pieces
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager",
                                                 num_hidden_layers=LAYERS).eval()
    doc = " The secret code of the blue castle is 4417."
    other = " Mount Quellen is 3120 metres high."
    question = tok("\nQuestion: what is the secret code?\nAnswer:",
                   add_special_tokens=False)["input_ids"]

    def prompt(system: str, docs: list[str]) -> list[int]:
        ids = tok(system)["input_ids"]
        for d in docs:
            ids += [SSEP_ID] + tok(d, add_special_tokens=False)["input_ids"]
        return ids + [PDEP_ID] + question

    for ids in (prompt("Answer briefly.", [doc]),
                prompt("Read the documents below and answer briefly.", [other, doc])):
        padded, layout = layout_prompt(ids, marker_ids=(SSEP_ID, PDEP_ID), page_size=16,
                                       pad_id=tok.eos_token_id)
        tops: list = []
        with torch.no_grad():
            # two tokens: the first from the extend kernel, the second from the decode kernel
            want = block_attention_greedy(model, padded, decode_pieces(layout), 2,
                                          top_logprobs=tops)
        r = triton_server.post("/generate", timeout=600, json={
            "input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == want
        # the top two's logprobs too: with 8 layers, keys left unturned (the kernels' shifts
        # zeroed) keep both greedy picks here but move the runner-up's logprob by 0.2
        assert_top_logprobs_match(tops, out)
    assert out["meta_info"]["cached_tokens"] >= 16  # the document's page, from the cache
