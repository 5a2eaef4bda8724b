"""Sparse long-context decoding: TPOT, recall, offload and long prompts."""
