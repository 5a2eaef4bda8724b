"""Prometheus counters of sparse decoding (``sglang_pic.metrics``), served on ``/metrics`` with
``--enable-metrics``."""

from __future__ import annotations

from sglang_pic.metrics import Counters, counters_for

COUNTERS = {  # SparseDecodeState.stats key -> (metric name, help)
    "activated": ("sglang_pic:sparse_activated", "Requests that started decoding sparsely."),
    "sparse_steps": ("sglang_pic:sparse_decode_steps",
                     "Decode steps of requests decoding sparsely (one per request and step)."),
    "encoded_tokens": ("sglang_pic:sparse_encoded_tokens",
                       "Tokens encoded into retrieval regions (all layers count once)."),
    "refused_full": ("sglang_pic:sparse_refused_full",
                     "Long requests decoded densely because every sparse slot was busy."),
    "reused_tokens": ("sglang_pic:sparse_reused_tokens",
                      "Retrieval-region tokens a request found encoded by an earlier request "
                      "with the same prefix (not encoded again)."),
    "selections": ("sglang_pic:sparse_selections",
                   "Decode steps of sparse requests that voted and selected their keys (the "
                   "others attended their last selection, --sparse-reselect-interval, or "
                   "reranked their last vote's candidates, --sparse-vote-interval)."),
    "offloaded_tokens": ("sglang_pic:sparse_offloaded_tokens",
                         "Tokens whose KV moved to host memory, their GPU pool slots freed "
                         "(--sparse-offload)."),
}


def metrics_for(model_runner) -> Counters | None:
    return counters_for(model_runner, COUNTERS)
