"""``benchmark/quality/sparse_needle.py`` without an engine: its cases and its scoring.

The engine part runs with ``--cpu --smoke`` here and on the H200 (docs/sparse-decode.md); what
must hold before a device call is spent: every prompt fits SmolLM2's 8K context with room for
the answer, each length is near its nominal size, the cases are the same in every run, and a
case counts as solved exactly when its answer's digits are in the generated text.
"""

from __future__ import annotations

import pytest

from benchmark.quality import sparse_needle


def test_cases_fit_the_context_near_their_nominal_length_and_repeat(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    cases = sparse_needle.build_cases(tok, ["2k", "8k"], sparse_needle.TASKS, 2, 12)
    assert [(c["length"], c["task"]) for c in cases] == [
        (n, t) for n in ("2k", "8k") for t in sparse_needle.TASKS for _ in range(2)
    ]
    for c in cases:
        nominal = sparse_needle.LENGTHS[c["length"]]
        assert 0.9 * nominal < len(c["input_ids"]) and len(c["input_ids"]) + 12 < 8192
        assert c["answer"].isdigit() and len(c["answer"]) == 7
        # the needle holding the answer is in the prompt, the question at its end
        text = tok.decode(c["input_ids"])
        assert f"is {c['answer']}." in text and text.rstrip().endswith("is")
    again = sparse_needle.build_cases(tok, ["2k", "8k"], sparse_needle.TASKS, 2, 12)
    assert again == cases
    assert len({c["answer"] for c in cases}) == len(cases)


def test_a_case_is_solved_when_its_digits_are_generated():
    cases = [
        {"length": "2k", "answer": "1234567"},
        {"length": "2k", "answer": "7654321"},
        {"length": "4k", "answer": "1111111"},
    ]
    texts = [" 1,234,567.", " 7654320 and", " The number is 1111111"]
    assert sparse_needle.scores(cases, texts) == {"2k": [100.0, 0.0], "4k": [100.0]}
    assert not sparse_needle.solved("1234567", "123456")


def test_a_reselect_variant_is_the_sparse_engine_and_bad_names_are_refused():
    ours = {"sglang-pic-sparse": {"attention_backend": "pariskv_triton"},
            "sglang-pic-dense": {"attention_backend": "triton"}}
    sparse_needle.add_reselect_variants(("vanilla", "sglang-pic-sparse", "sglang-pic-sparse-r4"),
                                        ours)
    assert ours["sglang-pic-sparse-r4"] == {"attention_backend": "pariskv_triton"}
    for bad, message in (("sglang-pic-dense-r4", "unknown variant"), ("nope", "unknown variant"),
                         ("sglang-pic-sparse-r65", "reselect-interval must be <= 64")):
        with pytest.raises(ValueError, match=message):
            sparse_needle.add_reselect_variants((bad,), dict(ours))


def test_agreement_passages_are_fixed_text_and_divergence_is_the_first_differing_step(
        model_dir):
    from transformers import AutoTokenizer

    from benchmark.quality import sparse_agreement

    tok = AutoTokenizer.from_pretrained(model_dir)
    first = sparse_agreement.passages(tok, 3, 500)
    assert first == sparse_agreement.passages(tok, 3, 500)  # read from a fixed commit
    question = tok(sparse_agreement.QUESTION)["input_ids"]
    assert all(len(p) == 500 + len(question) and p[500:] == question for p in first)
    assert len({tuple(p) for p in first}) == 3
    with pytest.raises(SystemExit, match="need more than"):
        sparse_agreement.passages(tok, 64, 5000)
    assert sparse_agreement.first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert sparse_agreement.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert sparse_agreement.first_divergence([7], [1, 2]) == 0
