"""Prometheus counters of sglang-pic's features, next to SGLang's own on ``/metrics``.

Created in the scheduler process only with ``--enable-metrics``: SGLang then runs
prometheus_client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), so counters of any of its
processes are served by the HTTP server's ``/metrics``, labelled like SGLang's
(``model_name``, ...). Each feature names its counters in a table ``{stats key: (metric name,
help)}`` (prometheus_client adds ``_total`` to a counter's name).
"""

from __future__ import annotations

from typing import Any

CounterTable = dict[str, tuple[str, str]]


class Counters:
    """One labelled prometheus counter per entry of ``table``."""

    def __init__(self, table: CounterTable, labels: dict[str, str]) -> None:
        from prometheus_client import Counter  # after SGLang set PROMETHEUS_MULTIPROC_DIR

        self.counters = {
            key: Counter(name, doc, labelnames=list(labels)).labels(**labels)
            for key, (name, doc) in table.items()
        }

    def inc(self, name: str, n: int = 1) -> None:
        self.counters[name].inc(n)


def counters_for(model_runner: Any, table: CounterTable) -> Counters | None:
    """The counters of ``table`` for this scheduler's model, or None without --enable-metrics."""
    return counters_for_args(model_runner.server_args, table)


def counters_for_args(args: Any, table: CounterTable) -> Counters | None:
    """The counters of ``table`` for the model of SGLang's ``ServerArgs`` ``args``, or None
    without --enable-metrics."""
    if not getattr(args, "enable_metrics", False):
        return None
    return Counters(table, {"model_name": args.served_model_name})
