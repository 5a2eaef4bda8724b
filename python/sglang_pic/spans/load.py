"""Span work in SGLang's load report (``/v1/loads``, ``/get_load``, DP load balancing).

SGLang 0.5.17 builds the report in the scheduler (``SchedulerLoadInquirer.get_loads``) from its
waiting queue, running batch and KV pool. Span sub-requests are ordinary requests there and are
counted, but the requests the planner holds until their spans are cached (and the ones in its
backlog) are in neither, so a server busy prefilling spans for twenty waiting requests reported one
or two requests of work. This module adds them, in SGLang's own units:

* ``num_waiting_reqs``: + held and backlogged requests;
* ``num_total_tokens`` / ``num_active_tokens``: + their prompt lengths (what SGLang counts for a
  queued request);
* ``num_waiting_uncached_tokens``: + what they will still compute themselves (their final piece;
  the whole prompt for a backlogged one). Their missing spans are counted once, as the queued
  sub-requests that compute them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import msgspec
from sglang.srt.managers.scheduler_components.load_inquirer import SchedulerLoadInquirer


@dataclass(frozen=True)
class SpanLoad:
    """Requests the planner holds outside SGLang's queues, and their tokens."""

    requests: int = 0
    tokens: int = 0
    uncached_tokens: int = 0


@dataclass(kw_only=True, slots=True, frozen=True)
class SpanLoadInquirer(SchedulerLoadInquirer):
    """SGLang's load inquirer plus the planner's held requests."""

    get_span_load: Callable[[], SpanLoad]

    def get_loads(self) -> Any:
        snapshot = SchedulerLoadInquirer.get_loads(self)
        return with_span_load(snapshot, self.get_span_load())


def with_span_load(snapshot: Any, load: SpanLoad) -> Any:
    """``snapshot`` (a ``LoadSnapshot``) with ``load`` added to its core counts."""
    if not load.requests:
        return snapshot
    return msgspec.structs.replace(
        snapshot,
        num_waiting_reqs=snapshot.num_waiting_reqs + load.requests,
        num_total_tokens=snapshot.num_total_tokens + load.tokens,
        num_active_tokens=snapshot.num_active_tokens + load.tokens,
        num_waiting_uncached_tokens=snapshot.num_waiting_uncached_tokens + load.uncached_tokens,
    )


def install_span_load(scheduler: Any, get_span_load: Callable[[], SpanLoad]) -> None:
    """Replace ``scheduler.load_inquirer`` with one that adds ``get_span_load()``."""
    inquirer = scheduler.load_inquirer
    if type(inquirer) is not SchedulerLoadInquirer:
        return  # already ours, or another extension's subclass: leave it as it is
    values = {f.name: getattr(inquirer, f.name) for f in fields(inquirer)}
    scheduler.load_inquirer = SpanLoadInquirer(**values, get_span_load=get_span_load)
