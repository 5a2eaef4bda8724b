"""ParisKV retrieval reference (sglang_pic.sparse.retrieval): each step against brute force."""

from __future__ import annotations

import math

import torch
from sglang_pic.sparse.retrieval import (
    SRHT,
    KeyIndex,
    ParisConfig,
    lloyd_max_levels,
    partial_attention,
    sign_centroids,
    sparse_attention,
)


def test_srht_is_orthogonal():
    r = SRHT(64, seed=3)
    eye = r(torch.eye(64))
    assert torch.allclose(eye @ eye.T, torch.eye(64), atol=1e-5)
    x, y = torch.randn(10, 64), torch.randn(10, 64)
    assert torch.allclose((r(x) * r(y)).sum(-1), (x * y).sum(-1), atol=1e-4)


def test_centroid_is_the_nearest_sign_pattern():
    torch.manual_seed(0)
    keys = torch.randn(2, 50, 64)
    index = KeyIndex(keys, ParisConfig(subspace_dim=4, top_rho=2, tier_weights=(2, 1)))
    kn = index.srht(keys)
    kn = kn / kn.norm(dim=-1, keepdim=True)
    sims = kn.view(2, 50, 16, 4) @ sign_centroids(4).T  # [h, n, B, 16]
    assert torch.equal(sims.argmax(-1), index.centroid)


def test_lloyd_max_levels_beat_uniform_levels():
    d = 128
    lv = torch.tensor(lloyd_max_levels(d))
    assert torch.all(lv[1:] > lv[:-1]) and 0 < lv[0] and lv[-1] < 1
    x = torch.randn(20000, d)
    t = (x / x.norm(dim=-1, keepdim=True)).abs().flatten()

    def mse(levels):
        return ((t[:, None] - levels[None, :]).abs().min(-1).values ** 2).mean()

    uniform = torch.linspace(0, float(t.max()), 8)
    assert mse(lv) < 0.5 * mse(uniform)


def test_rsq_ip_estimate_tracks_exact_inner_products():
    torch.manual_seed(1)
    keys = torch.randn(4, 400, 128) * torch.linspace(0.5, 2, 128)  # anisotropic, like real keys
    q = torch.randn(4, 128)
    index = KeyIndex(keys)
    idx = torch.arange(400).expand(4, -1)
    est = index.estimate(q, idx)
    exact = torch.einsum("hd,hnd->hn", q, keys)
    corr = torch.corrcoef(torch.stack([est.flatten(), exact.flatten()]))[0, 1]
    assert corr > 0.97


import pytest  # noqa: E402


@pytest.mark.parametrize("vote", ["tiers", "similarity"])
def test_planted_keys_are_retrieved(vote):
    """Keys aligned with the query (what attention concentrates on) survive voting and rerank."""
    torch.manual_seed(2)
    h, n, d, k = 2, 4000, 128, 64
    keys = torch.randn(h, n, d)
    q = torch.randn(h, d)
    planted = torch.randperm(n)[:k]
    keys[:, planted] = q[:, None, :] * 0.6 + 0.8 * torch.randn(h, k, d) / math.sqrt(d) * 4
    index = KeyIndex(keys, ParisConfig(vote=vote))
    got = index.select(q, k)
    exact = torch.einsum("hd,hnd->hn", q, keys).topk(k, dim=-1).indices
    recall = sum(len(set(got[i].tolist()) & set(exact[i].tolist())) for i in range(h)) / (h * k)
    assert recall >= 0.9


def test_sparse_attention_with_everything_selected_is_dense_attention():
    torch.manual_seed(3)
    keys, values, q = torch.randn(3, 300, 64), torch.randn(3, 300, 64), torch.randn(3, 64)
    index = KeyIndex(keys, ParisConfig(candidate_fraction=1.0))
    out = sparse_attention(q, keys, values, index, k=300 - 16 - 32, sink=16, local=32)
    dense, _ = partial_attention(q, keys, values, 1 / 8)
    assert torch.allclose(out, dense, atol=1e-5)


def test_append_matches_building_at_once():
    torch.manual_seed(4)
    keys = torch.randn(2, 200, 64)
    whole = KeyIndex(keys)
    grown = KeyIndex(keys[:, :120])
    grown.append(keys[:, 120:])
    assert torch.equal(whole.codes, grown.codes) and torch.equal(whole.centroid, grown.centroid)
    assert torch.allclose(whole.weights, grown.weights)
