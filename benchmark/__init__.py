"""The benchmarks, one command each, run from the repository root as ``python -m
benchmark.<module>`` (``harness``: vanilla SGLang and sglang-pic side by side; ``headlines``: the
rows the README and docs quote). The subpackages hold each capability's benchmarks."""
