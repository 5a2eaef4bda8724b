"""SGLang on a machine without an accelerator: what its CPU engine lacks, and what we put in its
place (``support``: import stand-ins, the CPU engine's settings and torch versions of CUDA-only
paths; ``grammar``: constrained decoding with xgrammar on the CPU). See docs/cpu.md."""
