"""A batch's keys cut into runs that moved by one distance: the layout of segmented attention.

In the shifted layout (``stored_positions``) a key computed at position ``s`` and read at ``l``
must be turned by ``l - s``. Inside one cached span every key moved by the same distance (the
span's offset), so a request's KV sequence is a few *runs* of one shift each: the system prompt
(0), each reused document (its offset), the question and the generated tokens (0). RoPE
rotations compose and are orthogonal, so ``q(l_q) . R(d) k(s) = R(-d) q(l_q) . k(s)``: a run can
be attended with the stored keys as they are and the query turned back by the run's shift.
Segmented attention runs each run as a request of its own in one batched attention call and
merges the partial results by their log-sum-exp (``run_attention``).

A run boundary never needs a device read: the copier's one host read at a span request's first
extend (``moved_copies.MovedPageCopier.prepare``) gives the shift of every prefix position, kept
on the request as ``shift_runs`` (``RUNS_ATTR``); every key after the matched prefix is computed
by the request where it is read (shift 0).

Shapes (``P`` runs, ``B`` requests, ``S`` most runs of one request):
``kv_indptr`` int32 [P + 1] (bounds of the runs in the batch's key list, which is vanilla's:
each request's slots in order); ``owners`` [P] (the request of each run); ``shifts`` [P];
``runs_of`` int64 [B, S] (each request's runs, padded with ``P``, a state that weighs
nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

RUNS_ATTR = "pic_shift_runs"
"""On a span request whose matched prefix holds moved keys: a tuple of ``(start, end, shift)``
runs, in order, covering its prefix exactly."""


def runs_from_shifts(shift: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """``(start, end, shift)`` of each run of equal values of ``shift`` (CPU int64 [n], n >= 1)."""
    values = shift.numpy()
    starts = np.concatenate(([0], np.flatnonzero(np.diff(values)) + 1))
    ends = np.concatenate((starts[1:], [len(values)]))
    return tuple((int(a), int(e), int(values[a])) for a, e in zip(starts, ends, strict=True))


def request_runs(runs: Sequence[tuple[int, int, int]] | None, length: int
                 ) -> list[tuple[int, int, int]]:
    """``(start, end, shift)`` runs covering a request's first ``length`` keys: its prefix runs
    (``runs``; None: nothing moved) cut at ``length``, then shift 0 (keys it computed itself)
    up to ``length``, merged with a last prefix run of shift 0."""
    out = [(a, min(e, length), s) for a, e, s in runs or () if a < length]
    covered = out[-1][1] if out else 0
    if covered < length:
        if out and out[-1][2] == 0:
            out[-1] = (out[-1][0], length, 0)
        else:
            out.append((covered, length, 0))
    return out


@dataclass
class KeyRuns:
    """One batch's runs (see the module docstring for the shapes): on the host, what planning
    reads; ``kv_lens`` on the device, for the key list."""

    kv_indptr: torch.Tensor  # int32 [P + 1], CPU
    owners: list[int]  # [P]: the request of each run
    shifts: list[int]  # [P]
    runs_of: torch.Tensor  # int64 [B, S], CPU
    kv_lens: torch.Tensor  # int64 [B] on the device: keys of each request in the key list
    num_keys: int

    @property
    def num_runs(self) -> int:
        return len(self.owners)

    @classmethod
    def build(cls, per_request: Sequence[list[tuple[int, int, int]]], device: torch.device | str
              ) -> KeyRuns:
        """From each request's ``(start, end, shift)`` runs (``request_runs``; an empty list for a
        request with no keys in the list, e.g. an extend without prefix)."""
        lens, owners, shifts, runs_of = [], [], [], []
        for i, runs in enumerate(per_request):
            runs_of.append(list(range(len(lens), len(lens) + len(runs))))
            for start, end, s in runs:
                lens.append(end - start)
                owners.append(i)
                shifts.append(s)
        p = len(lens)
        width = max((len(r) for r in runs_of), default=0) or 1
        padded = np.full((len(per_request), width), p, dtype=np.int64)
        for i, r in enumerate(runs_of):
            padded[i, : len(r)] = r
        indptr = np.zeros(p + 1, dtype=np.int32)
        np.cumsum(lens, out=indptr[1:])
        kv_lens = [sum(e - a for a, e, _ in runs) for runs in per_request]
        return cls(
            kv_indptr=torch.from_numpy(indptr), owners=owners, shifts=shifts,
            runs_of=torch.from_numpy(padded),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int64).to(device, non_blocking=True),
            num_keys=int(indptr[-1]),
        )

    def kv_indices(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor
                   ) -> torch.Tensor:
        """int32 [num_keys]: each request's first ``kv_lens`` slots in order (vanilla's list;
        the runs only cut it finer)."""
        rows = torch.repeat_interleave(req_pool_indices.long(), self.kv_lens,
                                       output_size=self.num_keys)
        starts = torch.cumsum(self.kv_lens, 0) - self.kv_lens
        cols = torch.arange(self.num_keys, device=rows.device) - torch.repeat_interleave(
            starts, self.kv_lens, output_size=self.num_keys)
        return req_to_token[rows, cols].to(torch.int32)
