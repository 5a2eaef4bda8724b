"""ParisKV sparse long-context decoding kernels (seed 003), in Triton.

- ``encode_keys``: SRHT rotation, centroid ids (sign patterns of 4-coordinate subspaces), 4-bit
  RSQ-IP codes and calibration weights of keys entering the retrieval region;
- ``Selector``: per decode step, query tables, collision votes, histogram-threshold candidate
  pruning, 4-bit rerank and top-k;
- ``SparseAttention``: attention over the GPU window and the selected rows read straight from
  pinned host memory, partials merged by log-sum-exp.

The torch specification they are tested against is ``sglang_pic.sparse.retrieval``; the
per-layer memory layout that drives them is ``sglang_pic.sparse.kv_layout``.
"""

from .attention import SparseAttention
from .encode import encode_keys, unpack_centroids
from .select import NBINS, SIMILARITY_BINS, Selector

__all__ = [
    "NBINS", "SIMILARITY_BINS", "Selector", "SparseAttention", "encode_keys", "unpack_centroids",
]
