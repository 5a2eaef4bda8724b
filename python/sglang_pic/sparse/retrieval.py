"""ParisKV top-k key retrieval and sparse attention: the torch reference (ParisKV, arXiv:2602.07721).

Pipeline for one decode step, per attention head (shapes: ``h`` heads, ``n`` keys, ``d`` head dim,
``B = d / m`` subspaces of ``m`` coordinates):

1. **SRHT rotation**: keys and queries are rotated by one shared random orthogonal map
   ``R x = H (s * x) / sqrt(d)`` (random signs ``s``, Walsh-Hadamard ``H``). Inner products are
   unchanged; the ℓ2-normalised vectors become spread evenly over the unit sphere whatever the
   model's key distribution is, so data-independent centroids fit them - also keys generated long
   after prefill (no stale learned centroids: "drift robust").
2. **Analytic centroids**: per subspace the ``2^m`` sign patterns ``±1/sqrt(m)``. A key's centroid is
   the sign pattern of its rotated sub-vector (the nearest one: it maximises the inner product).
3. **Collision voting**: per subspace the query's ``rho`` most similar centroids; a key whose
   centroid is among them gets the vote of that rank tier (``tier_weights``); votes summed over the
   ``B`` subspaces give an integer coarse score; the best ``candidate_fraction`` of keys survive.
4. **RSQ-IP rerank**: each rotated, normalised key coordinate is kept as 4 bits (sign + 3-bit
   magnitude on Lloyd-Max levels of the coordinate's distribution on the sphere, whose square is
   ``Beta(1/2, (d-1)/2)``); a per-key, per-subspace calibration weight ``w`` (least squares, at
   prefill) makes ``<k, q> ~ ||q|| * sum_b w_b <v_b, q~_b>`` with ``v_b`` the dequantised direction
   and ``q~`` the rotated normalised query. The ``k`` best candidates by this estimate are selected.
5. **Attention** over sink + local window (on the GPU) and the selected tokens (fetched from host
   memory), as two partial softmaxes merged by log-sum-exp.

Everything here is plain torch on any device; it is the specification the kernels are checked
against and what the recall benchmark (``benchmark/sparse/``) measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch


@dataclass(frozen=True)
class ParisConfig:
    subspace_dim: int = 4
    """``m``: coordinates per subspace (``2^m`` analytic centroids each). 4 beat 8 on SmolLM2's
    64-dim heads (recall of the voting stage 0.43-0.64 vs 0.23-0.64 at equal candidates)."""
    top_rho: int = 8
    """Query centroids per subspace that collect votes."""
    tier_weights: tuple[int, ...] = (4, 3, 3, 2, 2, 2, 1, 1)
    """Vote of a key whose centroid is the query's 1st, 2nd, ... most similar (len == top_rho)."""
    candidate_fraction: float = 0.1
    """Share of keys kept by voting for the rerank ..."""
    min_candidates_per_k: int = 8
    """... but at least this many per selected key (short contexts: 10 % is too few)."""
    vote: str = "tiers"
    """``tiers``: the paper's tiered integer votes for the query's ``top_rho`` centroids;
    ``similarity``: every key votes the similarity of its centroid to the query sub-vector (the
    limit of infinitely many tiers; same table lookup, and a higher recall on real keys,
    ``benchmark/sparse/bench_recall.py``)."""
    seed: int = 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform over the last dim (a power of two)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"head dim must be a power of two for the Hadamard transform, got {d}")
    shape = x.shape
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape)


class SRHT:
    """``R x = H (s * x) / sqrt(d)``: orthogonal, shared by keys and queries."""

    def __init__(self, dim: int, seed: int = 0, device: torch.device | str = "cpu"):
        g = torch.Generator().manual_seed(seed)
        self.signs = (torch.randint(0, 2, (dim,), generator=g) * 2 - 1).to(device, torch.float32)
        self.scale = 1.0 / math.sqrt(dim)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fwht(x.float() * self.signs) * self.scale


@cache
def lloyd_max_levels(dim: int, levels: int = 8, iters: int = 200) -> tuple[float, ...]:
    """Lloyd-Max reconstruction levels for ``|x_j|``, ``x`` uniform on the unit sphere in ``dim``
    dimensions (density of ``t = |x_j|`` on [0, 1] proportional to ``(1 - t^2)^((dim - 3) / 2)``)."""
    t = torch.linspace(0, 1, 20001, dtype=torch.float64)[:-1] + 0.5 / 20000
    pdf = (1 - t * t).clamp_min(0) ** ((dim - 3) / 2)
    # start from quantiles, then alternate nearest-level partition and centroid update
    cdf = torch.cumsum(pdf, 0) / pdf.sum()
    lv = torch.stack([t[torch.searchsorted(cdf, (i + 0.5) / levels)] for i in range(levels)])
    for _ in range(iters):
        edges = (lv[1:] + lv[:-1]) / 2
        idx = torch.bucketize(t, edges)
        lv = torch.stack([(t[idx == i] * pdf[idx == i]).sum() / pdf[idx == i].sum().clamp_min(1e-300)
                          for i in range(levels)])
    return tuple(float(v) for v in lv)


def sign_centroids(m: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[2^m, m]``: centroid ``c`` has coordinate ``j`` = +1/sqrt(m) if bit ``j`` of ``c`` is set."""
    bits = (torch.arange(2**m)[:, None] >> torch.arange(m)[None, :]) & 1
    return (bits.float() * 2 - 1).to(device) / math.sqrt(m)


class KeyIndex:
    """Retrieval metadata of one sequence's keys (built at prefill, appended during decode).

    ``keys``: ``[h, n, d]`` post-RoPE keys (one row per query head: GQA callers repeat KV heads).
    Holds, per key: its centroid per subspace ``[h, n, B]``, the 4-bit code per coordinate
    ``[h, n, d]`` (sign bit << 3 | magnitude level) and the calibration weights ``[h, n, B]``.
    """

    def __init__(self, keys: torch.Tensor, cfg: ParisConfig = ParisConfig()):
        h, n, d = keys.shape
        if d % cfg.subspace_dim:
            raise ValueError(f"head dim {d} is not a multiple of subspace_dim {cfg.subspace_dim}")
        if len(cfg.tier_weights) != cfg.top_rho:
            raise ValueError("tier_weights needs one weight per top_rho rank")
        if cfg.vote not in ("tiers", "similarity"):
            raise ValueError(f"vote must be 'tiers' or 'similarity', got {cfg.vote!r}")
        self.cfg, self.d, self.m, self.B = cfg, d, cfg.subspace_dim, d // cfg.subspace_dim
        self.srht = SRHT(d, cfg.seed, keys.device)
        self.levels = torch.tensor(lloyd_max_levels(d), device=keys.device)
        self.centroids = sign_centroids(self.m, keys.device)
        self.bit_weights = (2 ** torch.arange(self.m, device=keys.device))
        self.centroid = torch.empty(h, 0, self.B, dtype=torch.long, device=keys.device)
        self.codes = torch.empty(h, 0, d, dtype=torch.uint8, device=keys.device)
        self.weights = torch.empty(h, 0, self.B, device=keys.device)
        self.append(keys)

    @property
    def n(self) -> int:
        return self.codes.shape[1]

    def append(self, keys: torch.Tensor) -> None:
        h, n, d = keys.shape
        kr = self.srht(keys)  # rotated, unnormalised
        kn = kr / kr.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        sub = kn.view(h, n, self.B, self.m)
        centroid = ((sub > 0).long() * self.bit_weights).sum(-1)
        edges = (self.levels[1:] + self.levels[:-1]) / 2
        mag = torch.bucketize(kn.abs(), edges)  # 0..7
        codes = ((kn < 0).to(torch.uint8) << 3) | mag.to(torch.uint8)
        v = self._dequant(codes).view(h, n, self.B, self.m)
        krb = kr.view(h, n, self.B, self.m)
        w = (krb * v).sum(-1) / (v * v).sum(-1).clamp_min(1e-12)
        self.centroid = torch.cat([self.centroid, centroid], 1)
        self.codes = torch.cat([self.codes, codes], 1)
        self.weights = torch.cat([self.weights, w], 1)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` keys (a region reused by a request whose own is shorter)."""
        self.centroid, self.codes = self.centroid[:, :n], self.codes[:, :n]
        self.weights = self.weights[:, :n]

    def _dequant(self, codes: torch.Tensor) -> torch.Tensor:
        sign = 1.0 - 2.0 * (codes >> 3).float()
        return sign * self.levels[(codes & 7).long()]

    def coarse_votes(self, q: torch.Tensor) -> torch.Tensor:
        """``[h, n]`` collision votes of every key for queries ``q`` ``[h, d]`` (integers for
        ``tiers``)."""
        cfg = self.cfg
        qr = self.srht(q)
        qs = qr.view(q.shape[0], self.B, self.m)
        sim = qs @ self.centroids.T  # [h, B, 2^m]
        if cfg.vote == "similarity":
            return sim.gather(2, self.centroid.transpose(1, 2)).sum(1)
        top = sim.topk(cfg.top_rho, dim=-1).indices  # [h, B, rho]
        table = torch.zeros(q.shape[0], self.B, 2**self.m, dtype=torch.int32, device=q.device)
        tiers = torch.tensor(cfg.tier_weights, dtype=torch.int32, device=q.device)
        table.scatter_(2, top, tiers.expand_as(top).contiguous())
        votes = table.gather(2, self.centroid.transpose(1, 2)).sum(1)  # [h, n]
        return votes

    def estimate(self, q: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """RSQ-IP estimate of ``<k_i, q>`` for key indices ``idx`` ``[h, c]``."""
        h = q.shape[0]
        qr = self.srht(q)
        qnorm = qr.norm(dim=-1, keepdim=True)
        qt = (qr / qnorm.clamp_min(1e-12)).view(h, 1, self.B, self.m)
        codes = self.codes.gather(1, idx[..., None].expand(-1, -1, self.d))
        v = self._dequant(codes).view(h, idx.shape[1], self.B, self.m)
        w = self.weights.gather(1, idx[..., None].expand(-1, -1, self.B))
        return qnorm * (w * (v * qt).sum(-1)).sum(-1)

    def select(self, q: torch.Tensor, k: int, exclude: torch.Tensor | None = None) -> torch.Tensor:
        """``[h, k]`` indices of the keys ParisKV retrieves for queries ``q`` ``[h, d]``.

        ``exclude`` (bool ``[n]``) marks keys never to return (sink and local window: they are
        attended densely anyway).
        """
        votes = self.coarse_votes(q).float()
        if exclude is not None:
            votes = votes.masked_fill(exclude[None, :], -1.0)
        cfg = self.cfg
        n_cand = min(self.n, max(k * cfg.min_candidates_per_k,
                                 math.ceil(cfg.candidate_fraction * self.n)))
        cand = votes.topk(n_cand, dim=-1).indices
        est = self.estimate(q, cand)
        if exclude is not None:
            est = est.masked_fill(exclude[cand], float("-inf"))
        best = est.topk(min(k, n_cand), dim=-1).indices
        return cand.gather(1, best)


def partial_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` ``[h, d]`` over ``keys/values`` ``[h, n, d]``: (out, lse)."""
    s = torch.einsum("hd,hnd->hn", q.float(), keys.float()) * scale
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hn,hnd->hd", torch.softmax(s, dim=-1), values.float())
    return out, lse


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine partial softmax attentions over disjoint key sets by their log-sum-exp."""
    lses = torch.stack([lse for _, lse in parts])  # [p, h]
    total = torch.logsumexp(lses, dim=0)
    return sum(out * torch.exp(lse - total)[:, None] for out, lse in parts)


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: KeyIndex,
                     k: int, sink: int, local: int, scale: float | None = None) -> torch.Tensor:
    """Attention over the first ``sink`` + last ``local`` keys and the ``k`` retrieved ones."""
    h, n, d = keys.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    dense = torch.cat([torch.arange(min(sink, n)), torch.arange(max(sink, n - local), n)])
    exclude = torch.zeros(n, dtype=torch.bool, device=keys.device)
    exclude[dense] = True
    parts = [partial_attention(q, keys[:, dense], values[:, dense], scale)]
    if not bool(exclude.all()) and k > 0:
        idx = index.select(q, k, exclude)
        g = idx[..., None].expand(-1, -1, d)
        parts.append(partial_attention(q, keys.gather(1, g), values.gather(1, g), scale))
    return merge_partials(parts)
