"""The frontend DSL (``sgl.span``) and span markers sent to a server without the span cache.

A client program imports ``sglang_pic.lang``: it must load nothing ``import sglang`` does not
(besides a few modules of ours) and print nothing (it once pulled in the span planner and with it SGLang's server code: ~5 s more and three
platform warnings). A plain server once answered markers with a 200, reading them as ordinary
text; it refuses them now, naming ``--enable-span-cache``, and keeps serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
from conftest import Server
from sglang_pic.security.request_validation import refuse_openai_span_markers, refuse_span_markers
from sglang_pic.spans.segments import SpanError

MARKED = "Intro<|ssep|>Doc<|pdep|>Q?"
REFUSAL = "--enable-span-cache"

# ---- import cost ---------------------------------------------------------------------------------

_IMPORT = """
import json, sys
before = set(sys.modules)
import {module}
print(json.dumps(sorted(set(sys.modules) - before)))
"""
HEAVY = ("sglang_pic.spans.planner", "sglang.srt.mem_cache.radix_cache")


def _imported(module: str) -> tuple[set[str], str]:
    """(the modules importing ``module`` loads in a fresh interpreter, its stderr)."""
    out = subprocess.run([sys.executable, "-c", _IMPORT.format(module=module)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1])), out.stderr


def test_lang_imports_what_sglang_imports_and_quietly():
    """An import's cost is the modules it loads: counted rather than timed, which a busy machine
    skews by seconds either way (measured: 6-22 s for ``import sglang`` within one run)."""
    base, _ = _imported("sglang")
    lang, stderr = _imported("sglang_pic.lang")
    assert stderr == "", f"import sglang_pic.lang printed:\n{stderr}"
    assert not [m for m in HEAVY if m in lang], "import sglang_pic.lang loaded server code"
    foreign = sorted(m for m in lang - base if not m.startswith("sglang_pic"))
    assert foreign == [], f"import sglang_pic.lang loads modules import sglang does not: {foreign}"
    ours = [m for m in lang if m.startswith("sglang_pic")]
    assert len(ours) <= 12, f"import sglang_pic.lang loads {len(ours)} of our modules: {ours}"


# ---- sgl.span ------------------------------------------------------------------------------------


def test_span_wraps_text_in_markers_and_refuses_nesting():
    import sglang as sgl
    import sglang_pic.lang  # noqa: F401

    assert sgl.span("doc") == "<|ssep|>doc<|pdep|>"
    assert sgl.span("q", mode="dependent") == "<|pdep|>q<|pdep|>"
    with pytest.raises(SpanError, match="nested"):
        sgl.span("a<|ssep|>b")
    with pytest.raises(SpanError, match="mode"):
        sgl.span("a", mode="other")


# ---- markers without the span cache: unit level --------------------------------------------------


def test_marker_strings_are_refused_naming_the_flag():
    refuse_span_markers("text", "no markers here")
    refuse_span_markers("text", None)
    with pytest.raises(ValueError, match=f"text contains a span marker.*{REFUSAL}"):
        refuse_span_markers("text", MARKED)
    with pytest.raises(ValueError, match=r"text\[1\]"):
        refuse_span_markers("text", ["plain", "a<|pdep|>b"])


@pytest.mark.parametrize("body,where", [
    ({"model": "m", "prompt": MARKED}, "prompt"),
    ({"model": "m", "prompt": ["ok", MARKED]}, r"prompt\[1\]"),
    ({"model": "m", "messages": [{"role": "user", "content": MARKED}]}, r"messages\[0\].content"),
    ({"model": "m", "messages": [{"role": "system", "content": "hi"},
                                 {"role": "user", "content": [{"type": "text", "text": MARKED}]}]},
     r"messages\[1\].content\[0\]"),
    ({"model": "m", "system": [{"type": "text", "text": MARKED}], "messages": []},
     r"system\[0\]"),
])
def test_openai_bodies_with_markers_are_refused_without_the_span_cache(body, where):
    refuse_openai_span_markers({"model": "m", "prompt": "plain", "messages": []})
    with pytest.raises(ValueError, match=f"{where} contains a span marker.*{REFUSAL}"):
        refuse_openai_span_markers(body)


# ---- markers without the span cache: a real plain server -----------------------------------------


def _assert_refused(r, path: str) -> None:
    assert r.status_code == 400, f"{path}: {r.status_code} {r.text[:500]}"
    assert REFUSAL in r.text, r.text


def test_plain_server_refuses_markers_and_keeps_serving(server: Server):
    _assert_refused(server.post("/generate", json={
        "text": MARKED, "sampling_params": {"max_new_tokens": 4}}), "/generate")
    _assert_refused(server.post("/v1/completions", json={
        "model": "default", "prompt": MARKED, "max_tokens": 4}), "/v1/completions")
    _assert_refused(server.post("/v1/chat/completions", json={
        "model": "default", "max_tokens": 4,
        "messages": [{"role": "user", "content": MARKED}]}), "/v1/chat/completions")
    assert server.generate_text("Intro Doc Q?", max_new_tokens=4)["text"]
    r = server.post("/v1/chat/completions", json={
        "model": "default", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "What is 2 + 2?"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text


def test_dsl_program_on_a_plain_server_gets_the_refusal(server: Server):
    import sglang as sgl
    import sglang_pic.lang  # noqa: F401

    @sgl.function
    def rag(s, doc):
        s += "Answer.\n" + sgl.span(doc) + "Question: what?\nAnswer:"
        s += sgl.gen("answer", max_tokens=4, temperature=0)

    with warnings.catch_warnings():  # SGLang's interpreter also warns with the traceback
        warnings.simplefilter("ignore")
        state = rag.run(doc="Document.", backend=sgl.RuntimeEndpoint(server.url, api_key=server.api_key))
        state.sync()
    assert REFUSAL in str(state.error())
