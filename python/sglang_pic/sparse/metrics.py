"""Prometheus counters of sparse decoding, next to SGLang's own on ``/metrics``.

Created in the scheduler process only with ``--enable-metrics``: SGLang then runs
prometheus_client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), so counters of any of its
processes are served by the HTTP server's ``/metrics``, labelled like SGLang's
(``model_name``, ...).
"""

from __future__ import annotations

COUNTERS = {  # SparseDecodeState.stats key -> (metric name, help)
    "activated": ("sglang_pic:sparse_activated", "Requests that started decoding sparsely."),
    "sparse_steps": ("sglang_pic:sparse_decode_steps",
                     "Decode steps of requests decoding sparsely (one per request and step)."),
    "encoded_tokens": ("sglang_pic:sparse_encoded_tokens",
                       "Tokens encoded into retrieval regions (all layers count once)."),
    "refused_full": ("sglang_pic:sparse_refused_full",
                     "Long requests decoded densely because every sparse slot was busy."),
    "offloaded_tokens": ("sglang_pic:sparse_offloaded_tokens",
                         "Tokens whose KV moved to host memory, their GPU pool slots freed "
                         "(--sparse-offload)."),
}


class SparseMetrics:
    def __init__(self, labels: dict[str, str]) -> None:
        from prometheus_client import Counter  # after SGLang set PROMETHEUS_MULTIPROC_DIR

        self.counters = {
            key: Counter(name, doc, labelnames=list(labels)).labels(**labels)
            for key, (name, doc) in COUNTERS.items()
        }

    def inc(self, name: str, n: int) -> None:
        self.counters[name].inc(n)


def metrics_for(model_runner) -> SparseMetrics | None:
    args = model_runner.server_args
    if not getattr(args, "enable_metrics", False):
        return None
    return SparseMetrics({"model_name": args.served_model_name})
