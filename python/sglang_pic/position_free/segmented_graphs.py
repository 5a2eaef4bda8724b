"""Segmented decode steps as CUDA graphs: the padded layout a captured step replays.

A CUDA graph fixes every shape and address it launches with, while a segmented decode step's
shapes follow its batch: how many runs each request has, and how the runs that read the same
slots group (``KeyRuns.shared_groups``). So the graph of batch size ``bs`` is captured for the
largest step of that size, and each replay fills the same buffers with the step it runs:

* query rows: ``bs * S`` (``S``: ``--span-graph-runs``, the most runs one request may have);
  row ``r`` is the query of request ``rows[r]`` turned back by ``shifts[r]``; only the first
  ``count`` rows (the step's runs) are turned;
* FlashInfer's paged prefill in CUDA-graph mode over ``bs * S`` requests (the most groups a step
  can have: every run alone): the step's groups first, a query row per run of the group over the
  group's keys, then empty groups (no rows, no keys), whose tiles exit at once. Its plan sizes
  partial states for that grid, in a workspace of the captured steps' own
  (``kernels.graph_workspace``, ~0.36 MB per row for Llama-3-8B's heads);
* ``merge_index`` ``[bs, S]``: each request's rows, padded with ``bs * S``, a state that weighs
  nothing (``merge_runs`` skips it); a request SGLang padded the batch with has no rows.

Every decode step runs the grouped layout: a step whose runs share too little
(``shared_groups`` gives None) has one group per run, which is the decode kernel's work on the
prefill kernel. A step with a request of more than ``S`` runs does not fit the graph and runs
eagerly (``fits``).

Shapes: ``rows``, ``shifts`` int64 [max_bs * S]; ``count`` int32 [1]; ``merge_index`` int64
[max_bs, S]; ``qo_indptr``, ``kv_indptr`` int32 [max_bs * S + 1]; ``kv_last_page_len`` int32
[max_bs * S] (ones: page size 1); ``kv_indices`` int32 [max_keys].
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .key_runs import KeyRuns

logger = logging.getLogger(__name__)


@dataclass
class GraphStep:
    """What a captured step of one batch size reads: its kernels (their paged wrapper planned
    into the buffers) and its slices of the buffers."""

    kernels: Any
    rows: torch.Tensor
    shifts: torch.Tensor
    count: torch.Tensor
    merge_index: torch.Tensor


class SegmentedDecodeGraphs:
    """The buffers of every captured batch size and each one's kernels (``kernels.for_graph``:
    a paged prefill wrapper in CUDA-graph mode over slices of the buffers)."""

    def __init__(self, kernels: Any, runs_per_request: int, max_bs: int, max_keys: int,
                 device: torch.device | str) -> None:
        if runs_per_request < 1:
            raise ValueError(f"--span-graph-runs must be at least 1, got {runs_per_request}")
        self.kernels = kernels
        self.runs_per_request = runs_per_request
        rows = max_bs * runs_per_request
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.rows = torch.zeros(rows, **i64)
        self.shifts = torch.zeros(rows, **i64)
        self.count = torch.zeros(1, **i32)
        self.merge_index = torch.zeros((max_bs, runs_per_request), **i64)
        self.qo_indptr = torch.zeros(rows + 1, **i32)
        self.kv_indptr = torch.zeros(rows + 1, **i32)
        self.kv_last_page_len = torch.ones(rows, **i32)
        self.kv_indices = torch.zeros(max(max_keys, rows), **i32)
        self.workspace = kernels.graph_workspace(rows)  # shared: one step replays at a time
        if self.workspace is not None:
            logger.info("segmented decode graphs: %d query rows at most, %.0f MB of workspace",
                        rows, self.workspace.numel() / (1 << 20))
        self.steps: dict[int, GraphStep] = {}

    def fits(self, per_request: Sequence[Sequence[Any]] | None) -> bool:
        """Whether a decode step with these runs per request can replay a captured graph."""
        return per_request is not None and all(
            len(runs) <= self.runs_per_request for runs in per_request)

    def capture(self, bs: int) -> GraphStep:
        """The step of batch size ``bs`` for capture, planned with every row its own group of
        one key (slot 0): the most rows and groups its replays may plan."""
        n = bs * self.runs_per_request
        kernels = self.kernels.for_graph(self.qo_indptr[: n + 1], self.kv_indptr[: n + 1],
                                         self.kv_indices, self.kv_last_page_len[:n],
                                         self.workspace)
        step = GraphStep(kernels, self.rows[:n], self.shifts[:n], self.count,
                         self.merge_index[:bs])
        self.steps[bs] = step
        indptr = torch.arange(n + 1, dtype=torch.int32)
        kernels.plan_paged(indptr, indptr, torch.zeros(n, dtype=torch.int32,
                                                        device=self.rows.device))
        step.rows.zero_()
        step.shifts.zero_()
        step.count.fill_(n)
        step.merge_index.copy_(torch.arange(n, device=self.rows.device).view(bs, -1))
        return step

    def replay(self, bs: int, per_request: Sequence[Sequence[Any]], req_to_token: torch.Tensor,
               req_pool_indices: torch.Tensor, group_shared_runs: bool) -> GraphStep:
        """Plan the captured step of batch size ``bs`` for a step with these runs (one list per
        real request; SGLang's padding requests come after them and have none)."""
        step = self.steps[bs]
        n = bs * self.runs_per_request
        if not self.fits(per_request) or len(per_request) > bs:
            raise RuntimeError(f"segmented decode graphs: a step of {len(per_request)} requests "
                               f"does not fit the graph of {bs} with {self.runs_per_request} "
                               "runs a request (span_graphs.around_can_run_graph must refuse it)")
        padded = list(per_request) + [[] for _ in range(bs - len(per_request))]
        runs = KeyRuns.build(padded, req_pool_indices.device)
        p = runs.num_runs
        groups = runs.shared_groups() if group_shared_runs else None
        layout = runs.grouped(groups, n)
        g = len(layout.firsts)
        qo_indptr = np.empty(n + 1, dtype=np.int32)  # the step's groups, then empty ones
        qo_indptr[: g + 1] = layout.qo_indptr
        qo_indptr[g + 1 :] = qo_indptr[g]
        real_kv_indptr, kv_indices = runs.run_kv_indices(req_to_token, req_pool_indices,
                                                         layout.firsts)
        kv_indptr = np.empty(n + 1, dtype=np.int32)
        kv_indptr[: g + 1] = real_kv_indptr.numpy()
        kv_indptr[g + 1 :] = kv_indptr[g]
        step.kernels.plan_paged(torch.from_numpy(qo_indptr), torch.from_numpy(kv_indptr),
                                kv_indices)
        merge = np.full((bs, self.runs_per_request), n, dtype=np.int64)
        merge[:, : layout.merge_index.shape[1]] = layout.merge_index
        to = dict(non_blocking=True)
        step.rows[:p].copy_(torch.from_numpy(layout.owners), **to)
        step.shifts[:p].copy_(torch.from_numpy(layout.shifts), **to)
        step.count.copy_(torch.tensor([p], dtype=torch.int32), **to)
        step.merge_index.copy_(torch.from_numpy(merge), **to)
        return step
