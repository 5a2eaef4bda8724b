"""Span caching on CPU with SmolLM2: outputs equal an HF block-attention reference, spans are hit at
other offsets, PDEP pages are not falsely shared, one physical copy serves concurrent requests,
and bad input gets a 400.

The servers run `sglang-pic serve --enable-span-cache` (pic_torch_native, page size 16, so page
padding is exercised; ``span_server`` is the suite's shared one, conftest's ``SPAN_SERVER_FLAGS``);
the reference is `sglang_pic.spans.reference` (one HF forward with an explicit block-attention
mask and the same positions).
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import SPAN_SERVER_FLAGS, assert_top_logprobs_match, start_servers, stop_server
from sglang_pic.spans.request import PDEP_ID, SSEP_ID, layout_prompt
from sglang_pic.spans.segments import decode_pieces

pytestmark = pytest.mark.capability("spans")

PAGE = int(SPAN_SERVER_FLAGS[SPAN_SERVER_FLAGS.index("--page-size") + 1])  # 16
NEW = 10
SP = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
DOCS = [
    "The secret code of the blue castle is 4417. The castle was built in 1502 by King Aldric.",
    "Mount Quellen is 3120 metres high and lies north of the river Aster, near the town of Brill.",
    "The bakery on Elm Street sells rye bread on Mondays and cherry pie on Fridays.",
]
PREFIXES = ["You are a helpful assistant.", "Read the documents below and answer the question briefly."]
QUESTION = "\nQuestion: what is the secret code of the blue castle?\nAnswer:"


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # a server's scheduler polls the other core
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return tok, model


def span_ids(tok, prefix: str, docs: list[str], question: str = QUESTION) -> list[int]:
    ids = tok(prefix)["input_ids"]
    for d in docs:
        ids += [SSEP_ID] + tok(" " + d, add_special_tokens=False)["input_ids"]
    return ids + [PDEP_ID] + tok(question, add_special_tokens=False)["input_ids"]


def reference(hf, ids: list[int], recompute: int = 0, top_logprobs: list | None = None
              ) -> list[int]:
    from sglang_pic.spans.reference import block_attention_greedy

    padded, layout = layout_prompt(ids, marker_ids=(SSEP_ID, PDEP_ID), page_size=PAGE,
                                   pad_id=hf[0].eos_token_id)
    return block_attention_greedy(hf[1], padded, decode_pieces(layout), NEW, recompute,
                                  top_logprobs=top_logprobs)


def generate(server, **body) -> dict:
    r = server.post("/generate", json={"sampling_params": SP, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def loads(server) -> dict:
    return server.get("/v1/loads").json()["loads"][0]


@pytest.mark.parametrize(
    "prefix,order", [(0, [0, 1]), (1, [1, 0]), (1, [2, 0, 1])], ids=["p0-ab", "p1-ba", "p1-cab"]
)
def test_output_equals_block_attention_reference(span_server, hf, prefix, order):
    """Spans at different offsets, after different prefixes, in different orders."""
    ids = span_ids(hf[0], PREFIXES[prefix], [DOCS[i] for i in order])
    out = generate(span_server, input_ids=ids)
    assert out["output_ids"] == reference(hf, ids)


def test_reference_reports_each_steps_top_logprobs_as_the_server_does(span_server, hf):
    """The reference's per-step top two (logprob, token), which the GPU tests weigh a divergence
    by, are its greedy picks first and agree with the server's logprobs for the same steps."""
    ids = span_ids(hf[0], PREFIXES[0], DOCS[:2])
    tops: list = []
    want = reference(hf, ids, top_logprobs=tops)
    out = generate(span_server, input_ids=ids, return_logprob=True, top_logprobs_num=2)
    assert out["output_ids"] == want == [step[0][1] for step in tops]
    assert all(a[0] >= b[0] for a, b in tops)
    assert_top_logprobs_match(tops, out)


def test_span_prefills_just_over_the_chunk_budget_run_in_one_pass(span_server, hf):
    """A cold prompt whose span prefills (system prompt + document) exceed the server's
    ``--chunked-prefill-size`` 128 by at most 1/8 prefills them in one pass of more than 128
    tokens (SGLang alone would chunk them, leaving a small tail pass before the question's), and
    answers as the block-attention reference does."""
    import re

    tok, sentence = hf[0], " The ferry to Lindholm leaves at seven and returns at noon."
    doc, chosen = "", None
    for _ in range(40):  # the document grows until the span prefills total 129-144 tokens
        doc += sentence
        ids = span_ids(tok, "Cold chunk test.", [doc])
        padded, layout = layout_prompt(ids, marker_ids=(SSEP_ID, PDEP_ID), page_size=PAGE,
                                       pad_id=tok.eos_token_id)
        units = decode_pieces(layout)[-1].start  # every piece but the question
        if 128 < units <= 144:
            chosen = ids
            break
    assert chosen is not None, "no document length gave span prefills of 129-144 tokens"
    seen = span_server.log.stat().st_size
    out = generate(span_server, input_ids=chosen)
    assert out["output_ids"] == reference(hf, chosen)
    with span_server.log.open() as f:
        f.seek(seen)
        batches = [int(n) for n in re.findall(r"Prefill batch.*?#new-token: (\d+)", f.read())]
    assert any(n > 128 for n in batches), batches


def test_text_markers_equal_token_markers(span_server, hf):
    tok = hf[0]
    text = PREFIXES[0] + "".join("<|ssep|> " + d for d in DOCS[:2]) + "<|pdep|>" + QUESTION
    by_text = generate(span_server, text=text)
    by_ids = generate(span_server, input_ids=span_ids(tok, PREFIXES[0], DOCS[:2]))
    assert by_text["output_ids"] == by_ids["output_ids"]
    spans = [{"text": PREFIXES[0]}, *({"text": " " + d, "mode": "independent"} for d in DOCS[:2]),
             {"text": QUESTION}]
    by_field = generate(span_server, spans=spans)
    assert by_field["output_ids"] == by_ids["output_ids"]


def test_span_is_hit_at_another_offset(span_server, hf):
    tok = hf[0]
    doc = " ".join(DOCS) + " This paragraph is only in the offset test."
    first = generate(span_server, input_ids=span_ids(tok, "Short prefix.", [doc]))
    before = loads(span_server)["total_prefill_uncached_tokens"]
    ids = span_ids(tok, "A much longer and different system prompt, placed before the document.", [doc])
    second = generate(span_server, input_ids=ids)
    computed = loads(span_server)["total_prefill_uncached_tokens"] - before
    doc_tokens = len(tok(" " + doc, add_special_tokens=False)["input_ids"])
    doc_pages = doc_tokens // PAGE * PAGE
    assert first["meta_info"]["cached_tokens"] == 0, "nothing was cached before the first request"
    assert second["meta_info"]["cached_tokens"] >= doc_pages
    assert computed < second["meta_info"]["prompt_tokens"] - doc_pages + PAGE
    assert second["output_ids"] == reference(hf, ids)


def test_a_cache_salt_keeps_span_pages_apart(span_server, hf):
    """Requests with different ``cache_salt`` values never share span pages, and a salted span
    request's span prefills land where its own later requests find them (SGLang 0.5.23 keys a
    salt apart from the namespace: the span cache folds it into its namespaces)."""
    import dataclasses

    from sglang.srt.managers.io_struct import GenerateReqInput

    if "cache_salt" not in {f.name for f in dataclasses.fields(GenerateReqInput)}:
        pytest.skip("this SGLang release has no cache_salt")
    tok = hf[0]
    doc = DOCS[2] + " This paragraph is only in the salt test."
    ids = span_ids(tok, "Salted prefix.", [doc])
    want = reference(hf, ids)
    doc_pages = len(tok(" " + doc, add_special_tokens=False)["input_ids"]) // PAGE * PAGE
    first = generate(span_server, input_ids=ids, cache_salt="tenant-a")
    other = generate(span_server, input_ids=ids, cache_salt="tenant-b")
    again = generate(span_server, input_ids=ids, cache_salt="tenant-a")
    assert first["output_ids"] == other["output_ids"] == again["output_ids"] == want
    assert first["meta_info"]["cached_tokens"] == 0
    assert other["meta_info"]["cached_tokens"] == 0, "tenant-b read tenant-a's pages"
    assert again["meta_info"]["cached_tokens"] >= doc_pages


def test_pdep_pages_are_not_shared_across_contexts(span_server, hf):
    """The same question after different documents: its pages depend on the whole prompt."""
    tok = hf[0]
    q = "\nQuestion: which of these facts is the most surprising, and why?\nAnswer:" * 3
    a = span_ids(tok, "PDEP test prefix.", [DOCS[0] + " (PDEP test A)"], q)
    b = span_ids(tok, "PDEP test prefix.", [DOCS[1] + " (PDEP test B)"], q)
    out_a = generate(span_server, input_ids=a)
    out_b = generate(span_server, input_ids=b)
    prefix_pages = -(-len(tok("PDEP test prefix.")["input_ids"]) // PAGE) * PAGE
    assert out_a["meta_info"]["cached_tokens"] == 0
    # only the shared prefix was in the cache for b: not a page of the (identical) question
    assert out_b["meta_info"]["cached_tokens"] == prefix_pages
    assert out_b["output_ids"] == reference(hf, b)
    again = generate(span_server, input_ids=b)  # same context: now the question pages are hits
    assert again["meta_info"]["cached_tokens"] >= len(b) - 2 - PAGE


def test_concurrent_requests_share_one_physical_copy(span_server, hf):
    """Two requests read one document at two offsets at once: it is prefilled once, one copy
    of it is in use, their decode steps read its pages once for both (the shared-run counter),
    and each answers as the block-attention reference does."""
    tok = hf[0]
    doc = " ".join(DOCS * 6)  # ~400 tokens
    doc_tokens = len(tok(" " + doc, add_special_tokens=False)["input_ids"])
    reqs = [span_ids(tok, p, [doc]) for p in ("First offset.", "A second, longer prompt prefix here.")]
    before = loads(span_server)["total_prefill_uncached_tokens"]
    grouped = _pic_counters(span_server).get("sglang_pic:span_shared_run_batches_total", 0)
    peak = [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], loads(span_server)["num_used_tokens"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    outs: list[dict] = [None, None]

    def run(i):
        r = span_server.post("/generate", timeout=300, json={
            "input_ids": reqs[i], "sampling_params": {**SP, "max_new_tokens": 48}})
        outs[i] = r.json()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    computed = loads(span_server)["total_prefill_uncached_tokens"] - before
    assert all(o and len(o["output_ids"]) == 48 for o in outs), outs
    # the document was prefilled once, and one copy of it was in use while both ran
    assert computed < 2 * doc_tokens
    assert doc_tokens <= peak[0] < 2 * doc_tokens
    assert _pic_counters(span_server)["sglang_pic:span_shared_run_batches_total"] > grouped
    for ids, out in zip(reqs, outs, strict=True):
        assert out["output_ids"][:NEW] == reference(hf, ids)


@pytest.mark.parametrize(
    "body,message",
    [
        ({"spans": [{"text": "a"}, {"text": "x<|ssep|>y", "mode": "independent"}]}, "marker"),
        ({"spans": [{"text": "a"}, {"text": "", "mode": "independent"}, {"text": "q"}]}, "empty"),
        ({"spans": [{"text": "a", "mode": "sideways"}]}, "mode"),
        ({"spans": [{"text": "a"}, {"text": "doc", "mode": "independent"}]}, "ends inside"),
        ({"spans": [{"text": "a"}, {"text": "doc " * 9000, "mode": "independent"},
                    {"text": "q"}]}, "exceed the context"),
        ({"text": "a<|ssep|><|pdep|>question"}, "empty span"),
        ({"input_ids": [1, 2, SSEP_ID, 3, PDEP_ID, 4, -7]}, "negative"),
        ({"spans": [{"text": "a"}], "text": "b"}, "not both"),
    ],
)
def test_bad_span_input_is_a_400(span_server, body, message):
    r = span_server.post("/generate", json={**body, "sampling_params": SP})
    assert r.status_code == 400, r.text
    assert message in r.text
    assert span_server.healthy()


def test_openai_endpoints_accept_spans(span_server, hf):
    spans = [{"text": PREFIXES[0]}, {"text": " " + DOCS[0], "mode": "independent"},
             {"text": QUESTION}]
    native = generate(span_server, spans=spans)
    r = span_server.post("/v1/completions", json={"model": "default", "spans": spans,
                                                   "max_tokens": NEW, "temperature": 0,
                                                   "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == native["text"]
    chat = span_server.post("/v1/chat/completions", json={
        "model": "default", "max_tokens": NEW, "temperature": 0,
        "messages": [{"role": "user", "spans": [{"text": DOCS[0], "mode": "independent"},
                                                {"text": "What is the secret code?"}]}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"]
    bad = span_server.post("/v1/completions", json={"model": "default", "max_tokens": 4,
                                                     "spans": [{"text": "a", "mode": "bad"}]})
    assert bad.status_code == 400 and "mode" in bad.json()["message"]


def test_dsl_span_program(span_server):
    import sglang as sgl
    import sglang_pic.lang  # noqa: F401

    @sgl.function
    def rag(s, docs, question):
        s += PREFIXES[0]
        for d in docs:
            s += sgl.span(" " + d)
        s += question
        s += sgl.gen("answer", max_tokens=NEW, temperature=0, ignore_eos=True)

    backend = sgl.RuntimeEndpoint(span_server.url, api_key=span_server.api_key)
    state = rag.run(docs=DOCS[:2], question=QUESTION, backend=backend)
    text = PREFIXES[0] + "".join(sgl.span(" " + d) for d in DOCS[:2]) + QUESTION
    assert state["answer"] == generate(span_server, text=text)["text"]


def test_reserved_layout_field_and_logprobs_inside_spans_are_400(span_server, hf):
    r = span_server.post("/generate", json={"text": "hello", "sampling_params": {
        **SP, "custom_params": {"pic_spans": [0, 1, 1]}}})
    assert r.status_code == 400 and "set by the server" in r.text
    ids = span_ids(hf[0], PREFIXES[0], DOCS[:1])
    r = span_server.post("/generate", json={"input_ids": ids, "sampling_params": SP,
                                             "return_logprob": True, "logprob_start_len": 0})
    assert r.status_code == 400 and "logprob_start_len" in r.text
    r = span_server.post("/generate", json={"input_ids": ids, "sampling_params": SP,
                                             "return_logprob": True})
    assert r.status_code == 200, r.text  # output logprobs only: fine


def test_without_span_cache_spans_and_markers_are_refused(server):
    """A server started without --enable-span-cache refuses the spans field and the markers (ids
    and strings) instead of reading them as ordinary input (test_lang.py: OpenAI bodies too)."""
    r = server.post("/generate", json={"spans": [{"text": "a"}], "sampling_params": SP})
    assert r.status_code == 400 and "--enable-span-cache" in r.text
    r = server.post("/generate", json={"input_ids": [1, 2, SSEP_ID, 3, PDEP_ID, 4],
                                        "sampling_params": SP})
    assert r.status_code == 400 and "--enable-span-cache" in r.text
    r = server.post("/generate", json={"text": "Hello<|ssep|>world<|pdep|>!",
                                        "sampling_params": SP})
    assert r.status_code == 400 and "--enable-span-cache" in r.text


@pytest.fixture(scope="module")
def side_servers(tmp_path_factory):
    """The link-recompute server and the tight-pool server, started together when the first of
    their tests runs (the module's last tests, after the last one using a session server, which
    has stopped by then: they live only until the module's end)."""
    logs = tmp_path_factory.mktemp("spans_side")
    servers = start_servers({
        "link": (["--enable-span-cache", "--span-recompute-tokens", "16",
                  "--span-schedule", "barrier", "--max-total-tokens", "8192",
                  "--page-size", str(PAGE)], logs / "link.log"),
        "tight": (["--enable-span-cache", "--span-copy-on-reuse", "on", "--enable-metrics",
                   "--max-total-tokens", "1536", "--page-size", str(PAGE),
                   "--chunked-prefill-size", "128"], logs / "tight.log"),
    })
    yield servers
    for srv in servers.values():
        stop_server(srv)


@pytest.fixture
def link_server(side_servers):
    return side_servers["link"]


@pytest.fixture
def tight_server(side_servers):
    return side_servers["tight"]


def test_link_recompute_equals_reference(link_server, hf):
    """EPIC-style link recompute (first 16 tokens of each span in context), barrier scheduling."""
    for prefix, order in ((0, [0, 1]), (1, [1, 0])):
        ids = span_ids(hf[0], PREFIXES[prefix], [DOCS[i] for i in order])
        out = generate(link_server, input_ids=ids)
        assert out["output_ids"] == reference(hf, ids, recompute=16)


def _pic_counters(server) -> dict[str, float]:
    return {name: value for name, value in server.metrics().items() if "_total" in name}


def test_span_copies_and_a_burst_larger_than_the_pool(tight_server, hf):
    """``--span-copy-on-reuse on`` in a 1536-token pool (CPU: pic_torch_native, which like
    pic_flashinfer runs a batch without moved keys as vanilla attention, turning nothing).

    1. A document reused at two offsets, each request's question long enough to be prefilled in
       two chunks (SGLang rewrites the row's prefix before the second): output equal to the
       block-attention reference, the moved pages copied for each request, and no batch read
       moved keys (a missing or unturned copy would be read as is: wrong tokens).
    2. 8 concurrent requests whose 8 distinct spans (~1000 tokens) plus prompts outgrow the pool:
       pinned spans are bounded (backlog), copies are made while 10 % of the pool stays free,
       and a request without room reads the shared pages (shift-aware) until a later batch of it
       finds room; every request completes correctly, and no pool slot leaks (SGLang's idle
       check)."""
    tok = hf[0]
    doc = " ".join(DOCS[:2]) + " This paragraph is only in the copy test."
    question = "\nQuestion: what is the secret code of the blue castle? " * 9 + "\nAnswer:"
    doc_pages = len(tok(" " + doc, add_special_tokens=False)["input_ids"]) // PAGE * PAGE
    for prefix in ("Copy test.", "A longer prompt prefix, so the document moves further."):
        ids = span_ids(tok, prefix, [doc], question)
        assert len(tok(question, add_special_tokens=False)["input_ids"]) > 128
        out = generate(tight_server, input_ids=ids)
        assert out["output_ids"] == reference(hf, ids)
    counters = _pic_counters(tight_server)
    assert counters["sglang_pic:span_copied_requests_total"] == 2
    assert counters["sglang_pic:span_copied_tokens_total"] >= 2 * doc_pages
    assert counters["sglang_pic:span_shared_requests_total"] == 0
    assert counters["sglang_pic:shifted_batches_total"] == 0

    docs = [f"Record {i}: " + " ".join(DOCS) for i in range(8)]
    reqs = [span_ids(tok, f"Burst prefix {i}.", [docs[i], docs[(i + 1) % 8]]) for i in range(8)]
    outs: list[dict | None] = [None] * len(reqs)

    def run(i):
        r = tight_server.post("/generate", timeout=600, json={"input_ids": reqs[i],
                                                              "sampling_params": SP})
        outs[i] = r.json() if r.status_code == 200 else {"error": r.text}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert all(o and "output_ids" in o for o in outs), outs
    for i in (0, 5):
        assert outs[i]["output_ids"] == reference(hf, reqs[i])
    assert tight_server.healthy()
    after = _pic_counters(tight_server)
    assert after["sglang_pic:span_copied_requests_total"] + \
        after["sglang_pic:span_waiting_requests_total"] >= 2 + 8
    assert after["sglang_pic:span_shared_requests_total"] == 0
    time.sleep(2)  # the scheduler checks its pools once idle
    assert "memory leak" not in tight_server.log.read_text(errors="replace")
