"""Sparse long-context decoding (ParisKV, seed 003) - work in progress.

Today: ``retrieval``, the reference implementation (torch) of ParisKV's top-k key retrieval -
SRHT rotation, analytic sign-pattern centroids, collision voting, 4-bit RSQ-IP rerank - and of
sparse attention over sink + local window + retrieved tokens merged by log-sum-exp. It is what the
Triton kernels (``sglang_pic_kernel``) will be tested against, and what ``benchmark/sparse/``
measures recall with. Not yet: the kernels, host-memory KV, the SGLang decode path.
"""
