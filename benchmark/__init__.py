"""The benchmarks, one command each, run from the repository root as ``python -m
benchmark.<module>`` (``harness``: vanilla SGLang and sglang-pic side by side; ``headlines``: the
rows the README and docs quote). The subpackages hold each capability's benchmarks."""


def description(doc: str | None) -> str:
    """A benchmark's ``--help`` description: its module docstring's first paragraph on one line
    (a first line alone ends mid-sentence where the sentence wraps)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())
