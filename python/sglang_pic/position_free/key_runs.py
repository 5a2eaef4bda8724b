"""A batch's keys cut into runs that moved by one distance: the layout of segmented attention.

In the shifted layout (``stored_positions``) a key computed at position ``s`` and read at ``l``
must be turned by ``l - s``. Inside one cached span every key moved by the same distance (the
span's offset), so a request's KV sequence is a few *runs* of one shift each: the system prompt
(0), each reused document (its offset), the question and the generated tokens (0). RoPE
rotations compose and are orthogonal, so ``q(l_q) . R(d) k(s) = R(-d) q(l_q) . k(s)``: a run can
be attended with the stored keys as they are and the query turned back by the run's shift.
Segmented attention runs each run as a request of its own in one batched attention call and
merges the partial results by their log-sum-exp (``run_attention``).

A cached run also names the slots it reads (``Run.source``, a digest of them): the runs of a
decode batch that read the same slots (a popular document, a tenant's system prompt) are
attended as one request with a query row per run, so the step reads those keys once, not once
per request that holds them (``KeyRuns.shared_groups``).

A run boundary never needs a device read: the copier's one host read at a span request's first
extend (``moved_copies.MovedPageCopier.prepare``) gives the shift of every prefix position, kept
on the request as ``shift_runs`` (``RUNS_ATTR``); every key after the matched prefix is computed
by the request where it is read (shift 0).

Shapes (``P`` runs, ``B`` requests, ``S`` most runs of one request):
``kv_indptr`` int32 [P + 1] (bounds of the runs in the batch's key list, which is vanilla's:
each request's slots in order); ``owners`` [P] (the request of each run); ``shifts`` [P];
``runs_of`` int64 [B, S] (each request's runs, padded with ``P``, a state that weighs
nothing); ``sources`` [P] (each run's ``Run.source``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import xxhash

RUNS_ATTR = "pic_shift_runs"
"""On a span request whose matched prefix holds moved keys: a tuple of ``Run`` covering its
prefix exactly, in order."""


class Run(NamedTuple):
    """Keys ``start:end`` of a request's sequence, each moved by ``shift`` positions."""

    start: int
    end: int
    shift: int
    source: bytes | None = None
    """A 128-bit digest of the slots the run reads (xxh3: slot ids come from SGLang's allocator,
    never from a client), when they are cached pages another request may read too (None: the
    request's own, or a part of a cached run). Equal sources read the same slots in order."""


SHARED_KEYS_MAX = 0.75
"""A decode step groups runs that read the same slots (``KeyRuns.shared_groups``) only when the
groups read at most this share of the batch's keys: a few shared runs are not worth moving every
run of the batch from the decode kernel to the paged prefill one."""


def runs_from_shifts(shift: torch.Tensor, slots: torch.Tensor | None = None
                     ) -> tuple[Run, ...]:
    """The runs of equal values of ``shift`` (CPU int64 [n], n >= 1), each with the digest of
    its ``slots`` (CPU [n], the row's slots; None: no sources)."""
    values = shift.numpy()
    starts = np.concatenate(([0], np.flatnonzero(np.diff(values)) + 1))
    ends = np.concatenate((starts[1:], [len(values)]))
    where = None if slots is None else np.ascontiguousarray(slots.numpy())
    return tuple(Run(int(a), int(e), int(values[a]),
                     None if where is None else xxhash.xxh3_128_digest(where[a:e]))
                 for a, e in zip(starts, ends, strict=True))


def request_runs(runs: Sequence[Run] | None, length: int) -> list[Run]:
    """The runs covering a request's first ``length`` keys: its prefix runs (``runs``; None:
    nothing moved) cut at ``length`` (a cut run loses its source), then shift 0 (keys it
    computed itself) up to ``length``, merged with a last prefix run of shift 0."""
    out = [r if r[1] <= length else Run(r[0], length, r[2])
           for r in runs or () if r[0] < length]
    covered = out[-1][1] if out else 0
    if covered < length:
        if out and out[-1][2] == 0:
            out[-1] = Run(out[-1][0], length, 0)
        else:
            out.append(Run(covered, length, 0))
    return out


class GroupedRuns(NamedTuple):
    """A batch's runs in group order (``KeyRuns.grouped``), on the host: ``qo_indptr`` int32
    [G + 1] (each group's query rows, a row per run), ``firsts`` [G] (the run whose keys each
    group reads), ``owners`` and ``shifts`` int64 [P] (each row's request and shift),
    ``merge_index`` int64 [B, S] (each request's rows, then padding)."""

    qo_indptr: np.ndarray
    firsts: list[int]
    owners: np.ndarray
    shifts: np.ndarray
    merge_index: np.ndarray


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
    starts: list[int]  # [P]: where each run starts in its request's sequence
    sources: list[bytes | None]  # [P]

    @property
    def num_runs(self) -> int:
        return len(self.owners)

    @classmethod
    def build(cls, per_request: Sequence[Sequence[Run]], device: torch.device | str
              ) -> KeyRuns:
        """From each request's runs (``request_runs``; an empty list for a request with no keys
        in the list, e.g. an extend without prefix)."""
        b = len(per_request)
        counts = np.fromiter((len(runs) for runs in per_request), dtype=np.int64, count=b)
        flat = [run for runs in per_request for run in runs]  # ``Run``s or (start, end, shift)
        p = len(flat)
        starts = [run[0] for run in flat]
        shifts = [run[2] for run in flat]
        sources = [run[3] if len(run) > 3 else None for run in flat]
        lens = np.fromiter((run[1] for run in flat), dtype=np.int64, count=p) \
            - np.asarray(starts, dtype=np.int64)
        owners = np.repeat(np.arange(b), counts).tolist()
        first = np.cumsum(counts) - counts  # each request's first run
        column = np.arange(max(int(counts.max(initial=0)), 1))
        padded = np.where(column[None, :] < counts[:, None], first[:, None] + column[None, :], p)
        indptr = np.zeros(p + 1, dtype=np.int32)
        np.cumsum(lens, out=indptr[1:])
        kv_lens = (indptr[first + counts] - indptr[first]).astype(np.int64)
        return cls(
            kv_indptr=torch.from_numpy(indptr), owners=owners, shifts=shifts,
            runs_of=torch.from_numpy(padded.astype(np.int64)),
            kv_lens=torch.from_numpy(kv_lens).to(device, non_blocking=True),
            num_keys=int(indptr[-1]), starts=starts, sources=sources,
        )

    def shared_groups(self) -> list[list[int]] | None:
        """The runs grouped by the slots they read (equal ``sources``; a run without one is a
        group of its own), groups in order of their first run; None when the groups would still
        read more than ``SHARED_KEYS_MAX`` of the batch's keys (no two runs share, or few)."""
        groups: list[list[int]] = []
        by_source: dict[bytes, list[int]] = {}
        for r, source in enumerate(self.sources):
            if source is None:
                groups.append([r])
                continue
            group = by_source.get(source)
            if group is None:
                group = by_source[source] = []
                groups.append(group)
            group.append(r)
        if len(groups) == self.num_runs:
            return None
        lens = np.diff(self.kv_indptr.numpy())
        read = int(lens[[g[0] for g in groups]].sum())
        return groups if read <= SHARED_KEYS_MAX * self.num_keys else None

    def grouped(self, groups: Sequence[Sequence[int]] | None, padding: int) -> GroupedRuns:
        """The runs laid out group after group (``groups``: ``shared_groups``; None: one run per
        group), the layout of a decode step's query rows; ``padding``: the state index the
        merge skips, for the padded entries of ``runs_of``."""
        p = self.num_runs
        if groups is None:
            groups = [[r] for r in range(p)]
        order = np.fromiter((r for group in groups for r in group), dtype=np.int64, count=p)
        qo_indptr = np.zeros(len(groups) + 1, dtype=np.int32)
        np.cumsum([len(group) for group in groups], out=qo_indptr[1:])
        row_of = np.full(p + 1, padding, dtype=np.int64)  # entry p: the padding of runs_of
        row_of[order] = np.arange(p)
        return GroupedRuns(
            qo_indptr=qo_indptr, firsts=[group[0] for group in groups],
            owners=np.asarray(self.owners, dtype=np.int64)[order],
            shifts=np.asarray(self.shifts, dtype=np.int64)[order],
            merge_index=row_of[self.runs_of.numpy()])

    def run_kv_indices(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       runs: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys of ``runs`` only, one after the other: ``(kv_indptr`` int32 [len(runs) + 1]
        on the CPU, ``kv_indices`` int32 on the device)."""
        lens = np.diff(self.kv_indptr.numpy()).astype(np.int64)[list(runs)]
        indptr = np.zeros(len(runs) + 1, dtype=np.int32)
        np.cumsum(lens, out=indptr[1:])
        total = int(indptr[-1])
        device = req_pool_indices.device
        to = dict(device=device, non_blocking=True)
        lens_d = torch.from_numpy(lens).to(**to)
        owners = torch.tensor([self.owners[r] for r in runs], dtype=torch.int64).to(**to)
        # column of each key: its run's start in the request, plus its place in the run
        offset = torch.tensor([self.starts[r] for r in runs], dtype=torch.int64).to(**to) \
            - torch.from_numpy(indptr[:-1].astype(np.int64)).to(**to)
        rows = torch.repeat_interleave(req_pool_indices.long()[owners], lens_d,
                                       output_size=total)
        cols = torch.arange(total, device=device) + torch.repeat_interleave(
            offset, lens_d, output_size=total)
        return torch.from_numpy(indptr), req_to_token[rows, cols].to(torch.int32)

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
