"""ParisKV Triton kernels vs the torch specification (``sglang_pic.sparse.retrieval``).

On CPU under TRITON_INTERPRET=1 at tiny shapes (head dim 64, a few hundred keys); with a GPU
also at the Llama-3-8B head shape (32 q heads, 8 KV heads, head dim 128, bf16) with the
retrieval region in pinned host memory read by the attention kernel.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import triton
import triton.language as tl
from sglang_pic.sparse.kv_layout import ParisKVLayer
from sglang_pic.sparse.retrieval import SRHT, KeyIndex, ParisConfig, lloyd_max_levels
from sglang_pic_kernel.pariskv import (
    Selector,
    SparseAttention,
    encode,
    encode_keys,
    unpack_centroids,
)
from sglang_pic_kernel.pariskv.select import PLANES, _popc, _topk_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the model-sized shape runs on the device (``make test-gpu``) and is skipped on CPU machines
# query heads per KV head: 2, and Qwen2.5-7B's 7 (28 query heads over 4 KV heads), not a
# power of two
GROUPS = [(4, 2), (7, 1)]
SHAPES = [(4, 2, 64, 150), (7, 1, 64, 150), pytest.param(32, 8, 128, 4096, marks=pytest.mark.gpu)]


def _quantiser(d: int):
    rt = SRHT(d, 0)(torch.eye(d)).contiguous().to(DEVICE)
    levels = torch.tensor(lloyd_max_levels(d), dtype=torch.float32, device=DEVICE)
    return rt, levels, ((levels[1:] + levels[:-1]) / 2).contiguous()


def _encoded(keys: torch.Tensor, prerotate_from: int = encode.PREROTATE_FROM):
    n, hk, d = keys.shape
    rt, levels, edges = _quantiser(d)
    cent = torch.zeros(hk, n, d // 32, dtype=torch.int32, device=DEVICE)
    codes = torch.zeros(hk, n, d // 2, dtype=torch.uint8, device=DEVICE)
    w = torch.zeros(hk, n, d // 4, dtype=torch.float16, device=DEVICE)
    counts = torch.full((hk, d), 7, dtype=torch.int32, device=DEVICE)  # reset at offset 0
    encode_keys(keys, rt, edges, levels, cent, codes, w, bit_counts=counts,
                prerotate_from=prerotate_from)
    return rt, levels, cent, codes, w, counts


@pytest.mark.parametrize("rotation", ["in kernel", "cuBLAS first, in chunks"])
@pytest.mark.parametrize("hq,hk,d,n", SHAPES)
def test_encode_matches_reference_index(hq, hk, d, n, rotation, monkeypatch):
    """Both ways of rotating (``encode`` module doc) against the torch reference; the
    pre-rotated one over chunks of a third of the keys (each launch at its own offset)."""
    torch.manual_seed(0)
    keys = torch.randn(n, hk, d, device=DEVICE).to(torch.float16)
    if rotation == "in kernel":
        _, _, cent, codes, w, counts = _encoded(keys, prerotate_from=n + 1)
    else:
        monkeypatch.setattr(encode, "PREROTATE_CHUNK_BYTES", (n // 3) * hk * d * 4)
        _, _, cent, codes, w, counts = _encoded(keys, prerotate_from=1)
    ref = KeyIndex(keys.transpose(0, 1).float().cpu(), ParisConfig())
    assert torch.equal(unpack_centroids(cent).cpu(), ref.centroid)
    # per head and rotated coordinate i (= 4b + j: bit j of subspace b's id), keys with it > 0
    ids = ref.centroid  # [hk, n, B]
    bits = torch.stack([(ids >> j) & 1 for j in range(4)], -1).flatten(-2)
    assert torch.equal(counts.cpu(), bits.sum(1).int())
    unpacked = torch.stack([codes & 15, codes >> 4], -1).view(hk, n, d).cpu()
    # a coordinate within float rounding of a level edge may land on either side
    assert (unpacked != ref.codes).float().mean() < 1e-3
    close = torch.isclose(w.float().cpu(), ref.weights, rtol=2e-3, atol=2e-3)
    assert close.float().mean() > 1 - 1e-4  # the weight of a flipped code moves with it


def _group_estimate(keys: torch.Tensor, q: torch.Tensor, hk: int) -> torch.Tensor:
    """[hk, n]: RSQ-IP estimate of q.k, max over each KV head's query heads (the reference)."""
    n, _, d = keys.shape
    g = q.shape[0] // hk
    out = []
    for h in range(hk):
        index = KeyIndex(keys[:, h].float().cpu()[None].expand(g, n, d).contiguous())
        est = index.estimate(q[h * g:(h + 1) * g].float().cpu(), torch.arange(n).expand(g, n))
        out.append(est.max(0).values)
    return torch.stack(out)


@pytest.mark.parametrize("similarity", [True, False])
@pytest.mark.parametrize("hq,hk,d,n", SHAPES)
def test_rerank_selects_the_reference_top_k(hq, hk, d, n, similarity):
    """With every key a candidate, the selection is the top-k of the reference estimate."""
    torch.manual_seed(1)
    keys = torch.randn(n, hk, d, device=DEVICE).to(torch.float16)
    q = torch.randn(1, hq, d, device=DEVICE).to(torch.float16)
    rt, levels, cent, codes, w, counts = _encoded(keys)
    k = 16
    sel = Selector(1, hq, hk, d, n, c=n, k=k, similarity=similarity, device=DEVICE)
    got = sel(q, rt, levels, cent[None], codes[None], w[None],
              torch.tensor([n], dtype=torch.int32, device=DEVICE), counts[None])
    est = _group_estimate(keys, q[0], hk)
    for h in range(hk):
        want = set(est[h].topk(k).indices.tolist())
        assert len(want & set(got[0, h].tolist())) >= k - 1  # one near-tie may swap


@pytest.mark.parametrize("similarity", [True, False])
def test_votes_and_pruning_follow_the_histogram(similarity):
    """Similarity votes equal the group's centroid similarities up to the ``PLANES``-bit query
    quantisation, tiered votes equal the reference's integer votes; pruning keeps every key
    binned above the threshold and fills the budget from the threshold bin, never below it."""
    torch.manual_seed(2)
    hq, hk, d, n, c = 4, 2, 64, 600, 40
    keys = torch.randn(n, hk, d, device=DEVICE).to(torch.float16)
    q = torch.randn(1, hq, d, device=DEVICE).to(torch.float16)
    rt, levels, cent, codes, w, counts = _encoded(keys)
    # spans of 256 keys in blocks of 128: each vote program adds up several blocks
    sel = Selector(1, hq, hk, d, n, c=c, k=8, similarity=similarity, device=DEVICE, block_n=128,
                   span=256)
    sel(q, rt, levels, cent[None], codes[None], w[None],
        torch.tensor([n], dtype=torch.int32, device=DEVICE), counts[None])
    bins, thresh = sel.bins[0].long().cpu(), sel.thresh[0].cpu()
    assert torch.equal(sel.hist[0].cpu(), torch.stack([torch.bincount(b, minlength=sel.nbins)
                                                      for b in bins]).int())
    g = hq // hk
    if similarity:
        # exact vote: sum over the group and subspaces of <q~_b, centroid_b>, centroid +-1/2
        ids = unpack_centroids(cent).cpu()  # [hk, n, B]
        signs = torch.stack([(ids >> j) & 1 for j in range(4)], -1).flatten(-2)  # coord 4b+j
        qt = sel.qt[0].cpu().view(hk, g, 4, d // 4).transpose(2, 3).flatten(-2)  # coord order
        exact = (signs.float() - 0.5) @ qt.sum(1)[..., None]  # [hk, n, 1]
        step, floor, per_vote = sel.params[0].cpu().T
        # the histogram spans [mean - 3 sd, the highest possible vote], from the bit counts
        qs = qt.sum(1)  # [hk, D] the group's summed query
        p = signs.float().mean(1)  # [hk, D] share of keys with each bit set
        mean = (p * qs).sum(-1) - qs.sum(-1) / 2
        sd = (p * (1 - p) * qs * qs).sum(-1).sqrt()
        assert torch.allclose(floor, qs.sum(-1) / 2 + mean - 3 * sd, atol=1e-4)
        top = qs.abs().sum(-1) / 2
        assert torch.allclose(per_vote, sel.nbins / (top - (mean - 3 * sd)), rtol=1e-4)
        assert torch.allclose(exact[..., 0].mean(1), mean, atol=1e-4)  # the mean is exact
        above = exact[..., 0] - (floor - qs.sum(-1) / 2)[:, None]  # vote above bin 0's floor
        # quantised votes: each set bit's coordinate is off by at most half a step
        bound = step[:, None] / 2 * signs.sum(-1) + 1e-4
        want_lo = ((above - bound) * per_vote[:, None]).floor().clamp(0, sel.nbins - 1)
        want_hi = ((above + bound) * per_vote[:, None]).floor().clamp(0, sel.nbins - 1)
        assert ((bins >= want_lo) & (bins <= want_hi)).all()
        # signed PLANES-bit levels: the largest coordinate at the top level, 2^(PLANES-1) - 1
        torch.testing.assert_close(step, qs.abs().amax(-1) / (2 ** (PLANES - 1) - 1))
    else:
        for h in range(hk):
            index = KeyIndex(keys[:, h].float().cpu()[None].expand(g, n, d).contiguous(),
                             ParisConfig(vote="tiers"))
            votes = index.coarse_votes(q[0, h * g:(h + 1) * g].float().cpu()).sum(0)
            assert torch.equal(bins[h], votes.long())
    for h in range(hk):
        cand = sel.cand[0, h].cpu()
        assert (cand >= 0).all() and len(set(cand.tolist())) == c
        above = set((bins[h] > thresh[h]).nonzero().flatten().tolist())
        at = set((bins[h] == thresh[h]).nonzero().flatten().tolist())
        assert above <= set(cand.tolist()) <= above | at
        assert len(above) < c <= len(above) + len(at)


def _kept_and_best_votes(keys: torch.Tensor, q: torch.Tensor, c: int):
    """Exact pruning (budget ``c``) of ``keys`` ``[n, hk, D]`` for ``q`` ``[1, hq, D]``: per KV
    head, the candidate set, the reference's top-``c`` by similarity vote, and its votes."""
    n, hk, d = keys.shape
    hq = q.shape[1]
    rt, levels, cent, codes, w, counts = _encoded(keys)
    sel = Selector(1, hq, hk, d, n, c=c, k=16, device=DEVICE, block_n=128, sample_stride=1)
    sel(q, rt, levels, cent[None], codes[None], w[None],
        torch.tensor([n], dtype=torch.int32, device=DEVICE), counts[None])
    g = hq // hk
    out = []
    for h in range(hk):
        index = KeyIndex(keys[:, h].float().cpu()[None], ParisConfig(vote="similarity"))
        qh = q[0, h * g:(h + 1) * g].float().cpu()
        votes = index.coarse_votes((qh / qh.norm(dim=-1, keepdim=True)).sum(0, keepdim=True))[0]
        out.append((set(sel.cand[0, h].cpu().tolist()), set(votes.topk(c).indices.tolist()),
                    votes))
    return out


def test_pruning_keeps_the_best_votes_of_keys_sharing_a_direction():
    """Real keys share a direction, so a query's votes sit far from 0 (SmolLM2: every vote of
    most heads below 0). The histogram is placed on the region's votes, so pruning still keeps
    the keys with the best votes (the reference's), not the first ``C`` by position."""
    torch.manual_seed(7)
    hq, hk, d, n, c = 4, 2, 64, 1200, 150
    mu = torch.randn(d, device=DEVICE)
    mu = mu / mu.norm() * d**0.5
    keys = (torch.randn(n, hk, d, device=DEVICE) + 2.5 * mu).to(torch.float16)
    q = (torch.randn(1, hq, d, device=DEVICE) - 2.0 * mu).to(torch.float16)
    for got, best, votes in _kept_and_best_votes(keys, q, c):
        assert (votes < 0).all()  # the case that broke a histogram over [0, max vote]
        assert len(best & got) >= 0.9 * c  # only the threshold bin's order is arbitrary


def test_pruning_keeps_a_favoured_cluster_whose_votes_exceed_the_estimated_spread():
    """Clustered keys spread their votes wider than the bit counts suggest: a small cluster the
    query favours votes far above the mean. The histogram reaches up to the highest possible
    vote, so those keys are not lumped into one top bin (where the budget would keep the first
    ``C`` by position): pruning keeps the cluster's best."""
    torch.manual_seed(8)
    hq, hk, d, n, c = 4, 2, 64, 1500, 60
    a, b = torch.randn(d, device=DEVICE), torch.randn(d, device=DEVICE)
    keys = torch.randn(n, hk, d, device=DEVICE) + 2.0 * a
    small = torch.randperm(n)[:150]  # 10 %: the cluster the query is aimed at
    keys[small] += 2.0 * (b - a)
    q = (torch.randn(1, hq, d, device=DEVICE) * 0.3 + b).to(torch.float16)
    for got, best, _ in _kept_and_best_votes(keys.to(torch.float16), q, c):
        assert len(best & got) >= 0.9 * c


def _exact_and_sampled(similarity: bool, n: int, c: int, n_ret: list[int], stride: int = 4):
    """Both pruning modes on the same keys and query (2 sequences): the exact selector's bins
    are every key's bin, which the sampled selector computes the same way."""
    torch.manual_seed(5)
    hq, hk, d = 4, 2, 64
    keys = torch.randn(n, hk, d, device=DEVICE).to(torch.float16)
    q = torch.randn(2, hq, d, device=DEVICE).to(torch.float16)
    rt, levels, cent, codes, w, counts = _encoded(keys)
    args = (rt, levels, cent[None].expand(2, -1, -1, -1), codes[None].expand(2, -1, -1, -1),
            w[None].expand(2, -1, -1, -1), torch.tensor(n_ret, dtype=torch.int32, device=DEVICE),
            counts[None].expand(2, -1, -1).contiguous())
    kw = dict(k=8, similarity=similarity, device=DEVICE, block_n=128, span=128)
    exact = Selector(2, hq, hk, d, n, c=c, sample_stride=1, **kw)
    sampled = Selector(2, hq, hk, d, n, c=c, sample_stride=stride, **kw)
    return exact, sampled, q, args


@pytest.mark.parametrize("similarity", [True, False])
def test_sampled_threshold_keeps_every_key_above_it_then_keys_at_it(similarity):
    """Pruning with the threshold from a 1/4 sample, compacted inside the vote pass: the
    candidates are distinct, every key above the threshold bin is one of them, the rest of the
    budget comes from the threshold bin in key order, and nothing below it is kept. A sequence
    holding at most ``C`` keys keeps them all."""
    n, c = 700, 60
    exact, sampled, q, args = _exact_and_sampled(similarity, n, c, [n, 50])
    exact(q, *args)
    sampled(q, *args)
    assert sampled.programs > 1  # several vote programs, each with its own region
    for h in range(2):
        bins = exact.bins[0, h].long().cpu()
        t = int(sampled.thresh[0, h])
        cand = sampled.cand[0, h].cpu()
        got = cand[cand >= 0].tolist()
        assert len(got) == len(set(got))
        above = (bins > t).nonzero().flatten().tolist()
        at = (bins == t).nonzero().flatten().tolist()
        assert len(above) <= c  # this sample set the threshold high enough
        assert got[:len(above)] == above  # in key order: program by program, then in each
        assert got[len(above):] == at[:c - len(above)]
        # a short sequence: every key, in order
        assert sampled.cand[1, h, :50].tolist() == list(range(50))
        assert (sampled.cand[1, h, 50:] == -1).all()


def test_sampled_threshold_overflow_drops_keys_evenly_over_the_context():
    """If the sampled threshold is too low (here forced), the keys above it overflow the budget
    and each vote program keeps ``floor(count * C / total)`` of its own (one more for the first
    programs with a remainder, until the budget is full), so the dropped keys are spread over
    the whole context rather than cut off at its end, and no place goes to a key at it."""
    n, c = 700, 60
    exact, sampled, q, args = _exact_and_sampled(True, n, c, [n, n])
    sampled.target = 10 * c // 4  # the threshold a sample asking for 10 x the budget sets
    exact(q, *args)
    sampled(q, *args)
    bins = exact.bins[0, 0].long().cpu()
    t = int(sampled.thresh[0, 0])
    above = (bins > t).nonzero().flatten()
    assert len(above) > c
    got = sampled.cand[0, 0].cpu()
    got = got[got >= 0]
    assert len(set(got.tolist())) == len(got)
    program = above // sampled.span
    counts = torch.bincount(program, minlength=sampled.programs)
    share = counts * c // len(above)
    short = (share < counts).nonzero().flatten()
    share[short[: c - int(share.sum())]] += 1
    want = torch.cat([above[program == p][:share[p]] for p in range(sampled.programs)])
    assert len(want) == c and got.tolist() == want.tolist()


@pytest.mark.parametrize("case", ["filled by keys at the threshold", "overflow", "idle slot"])
def test_rerank_gathering_the_kept_keys_equals_merge_then_rerank(case):
    """``gather_in_rerank``: the rerank's programs place the vote programs' kept keys
    themselves. Every place of the candidate list (ids, -1 past the filled ones) and every
    estimate equal the merge launch's followed by the rerank's, after a call on other lengths
    left the buffers stale; the overflowing budget's shares too."""
    n, c = 700, 60
    n_ret = {"filled by keys at the threshold": [n, 50], "overflow": [n, n],
             "idle slot": [n, 0]}[case]
    _, merged, q, args = _exact_and_sampled(True, n, c, n_ret)
    _, gathered, _, _ = _exact_and_sampled(True, n, c, n_ret)
    gathered.gather_in_rerank = True
    merged.block_c = gathered.block_c = 16  # 4 rerank programs a head: later ones, and ones
    # past a short list, place keys too
    if case == "overflow":
        merged.target = gathered.target = 10 * c // 4  # a threshold too low (as above)
    stale = (*args[:5], torch.tensor([n // 3, n], dtype=torch.int32, device=DEVICE), args[6])
    gathered(q, *stale)
    want = merged(q, *args).clone()
    got = gathered(q, *args)
    assert merged.programs > 1 and not merged.gather_in_rerank
    assert torch.equal(gathered.cand, merged.cand)
    valid = merged.cand >= 0
    assert valid[0].sum() > c // 2 and (case != "idle slot" or not valid[1].any())
    torch.testing.assert_close(gathered.est[valid], merged.est[valid], rtol=0, atol=0)
    assert (gathered.est[~valid] == float("-inf")).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("stride", [0, -4])
def test_sample_stride_below_one_is_refused(stride):
    with pytest.raises(ValueError, match="sample_stride must be >= 1"):
        Selector(1, 4, 2, 64, 600, c=40, k=8, device=DEVICE, sample_stride=stride)


def test_sampled_and_exact_pruning_select_alike_on_planted_keys():
    """The end of selection (rerank + top-k) with either pruning mode finds the same planted
    query-aligned keys."""
    torch.manual_seed(6)
    hq, hk, d, n, c, k = 4, 2, 64, 2000, 200, 16
    keys = torch.randn(n, hk, d, device=DEVICE)
    q = torch.randn(1, hq, d, device=DEVICE)
    planted = torch.randperm(n)[:k]
    for h in range(hk):
        keys[planted, h] = 3 * q[0, 2 * h] / q[0, 2 * h].norm() * d**0.5 + 0.1 * keys[planted, h]
    keys, q = keys.to(torch.float16), q.to(torch.float16)
    rt, levels, cent, codes, w, counts = _encoded(keys)
    picks = []
    for stride in (1, 8):
        sel = Selector(1, hq, hk, d, n, c=c, k=k, device=DEVICE, block_n=128, sample_stride=stride)
        got = sel(q, rt, levels, cent[None], codes[None], w[None],
                  torch.tensor([n], dtype=torch.int32, device=DEVICE), counts[None])
        picks.append([set(got[0, h].tolist()) for h in range(hk)])
    for h in range(hk):
        assert picks[0][h] == picks[1][h] == set(planted.tolist())


@triton.jit
def _popcount_kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, _popc(tl.load(X + i), False))


def test_popcount_fallback_counts_bits_of_negative_words():
    """The SWAR popcount used where inline PTX is unavailable, on words with the sign bit set."""
    x = torch.tensor([0, -1, -2**31, 2**31 - 1, 0x55555555, -0x55555556, 12345, -98765],
                     dtype=torch.int32, device=DEVICE)
    y = torch.empty_like(x)
    _popcount_kernel[(1,)](x, y, N=8)
    want = [bin(v & 0xFFFFFFFF).count("1") for v in x.tolist()]
    assert y.tolist() == want


@pytest.mark.parametrize("hq,hk", GROUPS)
@pytest.mark.parametrize("sel_chunk", [None, 8, 32])
def test_sparse_attention_equals_dense_over_the_chosen_keys(sel_chunk, hq, hk):
    """Window rows and selected host rows against a dense softmax over the same keys, with the
    selected rows split one tile a program (``None``), in part-tiles (8 of a 16-row tile) and
    in two tiles a program (32)."""
    torch.manual_seed(3)
    d, w, n, k = 64, 40, 120, 24
    dt = torch.float16
    q = torch.randn(2, hq, d, device=DEVICE).to(dt)
    kw, vw = (torch.randn(2, hk, w, d, device=DEVICE).to(dt) for _ in range(2))
    kh, vh = (torch.randn(2, hk, n, d).to(dt).pin_memory() if DEVICE == "cuda"
              else torch.randn(2, hk, n, d).to(dt) for _ in range(2))
    sel = torch.randint(0, n, (2, hk, k), dtype=torch.int32, device=DEVICE)
    sel[1, :, k - 5:] = -1  # fewer than k selected
    win_len = torch.tensor([w, 13], dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    SparseAttention(2, hq, hk, d, w, k, device=DEVICE, chunk=16, block_t=16,
                    sel_chunk=sel_chunk)(q, kw, vw, win_len, kh, vh, sel, out, 1 / math.sqrt(d))
    for b in range(2):
        for h in range(hq):
            kv = h // (hq // hk)
            rows = sel[b, kv][sel[b, kv] >= 0].cpu()
            keys = torch.cat([kw[b, kv, :win_len[b]].cpu(), kh[b, kv, rows]]).float()
            vals = torch.cat([vw[b, kv, :win_len[b]].cpu(), vh[b, kv, rows]]).float()
            p = torch.softmax(keys @ q[b, h].float().cpu() / math.sqrt(d), 0)
            torch.testing.assert_close(out[b, h].float().cpu(), p @ vals, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("c,k,t", [(64, 8, 1), (100, 16, 1), (4096, 100, 1), (64, 8, 3),
                                   (4096, 100, 4)])
def test_topk_kernel_returns_the_best_valid_candidates(c, k, t):
    """The fused top-k against ``torch.topk``, with ``t`` thresholds per search round:
    negative and positive estimates, ties across the k-th place, -inf and NaN estimates and
    empty candidates (-1) never selected, fewer valid candidates than k padded with -1 (with a
    +inf among them), a head with none, and one spanning the float range (the search's widest
    interval)."""
    torch.manual_seed(c + t)
    heads = 6
    est = torch.randn(1, heads, c, device=DEVICE) * 3
    est[0, 5] = torch.randn(c, device=DEVICE).sign() * 10.0 ** torch.randint(-37, 38, (c,),
                                                                              device=DEVICE)
    est[0, 1] = torch.randint(-3, 3, (c,), device=DEVICE).float()  # many ties at every value
    est[0, 2, c // 3 :] = float("-inf")
    est[0, 2, 0] = float("nan")
    cand = torch.randperm(10 * c, device=DEVICE)[: heads * c].view(1, heads, c).int()
    cand[0, 2, 1:4] = -1
    est[0, 3] = float("-inf")  # nothing valid
    est[0, 4, k // 2 :] = float("-inf")  # fewer valid than k
    est[0, 4, 1] = float("inf")
    sel = torch.full((1, heads, k), 7, dtype=torch.int32, device=DEVICE)
    n_sel = torch.ones(1, dtype=torch.int32, device=DEVICE)
    _topk_kernel[(1, heads, 1)](est, cand, sel, n_sel, n_sel, n_sel, n_sel, c, k,
                                CP=max(128, triton.next_power_of_2(c)),
                                KP=triton.next_power_of_2(k), T=t)
    for h in range(heads):
        valid = (est[0, h] > float("-inf")) & (cand[0, h] >= 0)  # NaN compares false
        ids, vals = cand[0, h][valid], est[0, h][valid]
        n = min(k, ids.numel())
        got = sel[0, h].tolist()
        assert got[n:] == [-1] * (k - n) and -1 not in got[:n]
        if n == 0:
            continue
        kth = vals.topk(n).values[-1]
        got_vals = {float(est[0, h][cand[0, h] == i][0]) for i in got[:n]}
        assert len(set(got[:n])) == n and min(got_vals) >= kth  # the k best, no duplicate
        assert set(ids[vals > kth].tolist()) <= set(got[:n])  # all strictly above the k-th


# CPU only: for the GPU, Triton would compile one program holding 131072 candidates in
# registers (spilling, slow to build), a width no server builds: --sparse-candidates is
# bounded by TOPK_PACKED_MAX_CP
@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's CPU interpreter only (compile time)")
def test_topk_kernel_bisects_past_65535_candidates():
    """More than 65535 valid candidates: the bisection (``T = 1``) reads its count as the whole
    sum, not a 16-bit field of it (a field wrapped at 65536 and the kernel wrote past its ``K``
    places). The server never launches it this wide (``--sparse-candidates`` <= 32768); the
    kernel stays right for direct callers."""
    torch.manual_seed(0)
    c, k = 65636, 100
    est = 1.0 + torch.rand(1, 1, c, device=DEVICE)
    est[0, 0, :50] = -3e38
    cand = torch.arange(c, dtype=torch.int32, device=DEVICE).view(1, 1, c)
    sel = torch.full((1, 1, k + 64), 7, dtype=torch.int32, device=DEVICE)  # 64 guard places
    n_sel = torch.ones(1, dtype=torch.int32, device=DEVICE)
    _topk_kernel[(1, 1, 1)](est, cand, sel, n_sel, n_sel, n_sel, n_sel, c, k,
                            CP=triton.next_power_of_2(c), KP=128, T=1)
    assert set(sel[0, 0, :k].tolist()) == set(est[0, 0].topk(k).indices.tolist())
    assert sel[0, 0, k:].tolist() == [7] * 64  # nothing written past the K places


@pytest.mark.parametrize("k,sel_chunk", [(100, 32), (2048, 32), (4096, 64), (32768, 512)])
def test_selected_rows_split_one_tile_a_program_up_to_64_splits(k, sel_chunk):
    """The selected rows' splits: one 32-row tile each, and no more than 64 of them for a large
    top-k (the merge's one program holds every split's partial)."""
    att = SparseAttention(1, 4, 2, 64, 656, k, device=DEVICE)
    assert att.sel_chunk == sel_chunk and att.splits - att.s_win == -(-k // sel_chunk) <= 64


@pytest.mark.parametrize("window", ["in one launch", "launched first", "on a side stream"])
def test_pool_attention_reads_batch_rows_and_writes_only_active_slots(window):
    """``attend_pool`` against the torch reference: slot queries read from the decode batch's
    rows, the selected rows turned into pool slots through ``req_to_token`` inside the kernel,
    window slots listed per sequence; an idle slot (row -1) writes nothing."""
    torch.manual_seed(5)
    hq, hk, d, sink, w, k, pool_size, ctx = 4, 2, 64, 4, 24, 16, 512, 200
    dt = torch.float16
    k_buf, v_buf = (torch.randn(pool_size, hk, d, device=DEVICE).to(dt) for _ in range(2))
    req_to_token = torch.stack([torch.randperm(pool_size - 1)[:ctx] + 1
                                for _ in range(3)]).int().to(DEVICE)
    slots = 3
    row_of_slot = torch.tensor([2, -1, 0], device=DEVICE)  # slot 1 idle
    pool_of_slot = torch.tensor([1, 0, 2], device=DEVICE)
    win_len = torch.tensor([w, 9, 13], dtype=torch.int32, device=DEVICE)
    win_idx = torch.randint(1, pool_size, (slots, w), device=DEVICE)
    sel = torch.randint(0, ctx - sink, (slots, hk, k), dtype=torch.int32, device=DEVICE)
    sel[2, :, k - 5 :] = -1
    q = torch.randn(4, hq, d, device=DEVICE).to(dt)  # batch of 4: rows 1 and 3 dense
    out = torch.full((4, hq, d), 7.0, device=DEVICE).to(dt)
    attention = SparseAttention(slots, hq, hk, d, w, k, device=DEVICE, chunk=16, block_t=16)
    begun = None  # the window's splits launched before (as beside the selection), or not
    if window == "on a side stream":
        if DEVICE != "cuda":
            pytest.skip("streams need a GPU")
        begun = attention.attend_pool_window(q, row_of_slot, k_buf, v_buf, win_idx, win_len,
                                             sel, req_to_token, pool_of_slot, sink,
                                             1 / math.sqrt(d), torch.cuda.Stream())
    elif window == "launched first":
        begun = attention.attend_pool_window(q, row_of_slot, k_buf, v_buf, win_idx, win_len,
                                             sel, req_to_token, pool_of_slot, sink,
                                             1 / math.sqrt(d))
    attention.attend_pool(q, row_of_slot, k_buf, v_buf, win_idx, win_len, sel, req_to_token,
                          pool_of_slot, sink, out, 1 / math.sqrt(d), window=begun)
    for r, row in ((0, 2), (2, 0)):
        for h in range(hq):
            kv = h // (hq // hk)
            picked = sel[r, kv][sel[r, kv] >= 0].long() + sink
            locs = torch.cat([win_idx[r, : win_len[r]],
                              req_to_token[pool_of_slot[r], picked].long()])
            keys, vals = k_buf[locs, kv].float(), v_buf[locs, kv].float()
            p = torch.softmax(keys @ q[row, h].float() / math.sqrt(d), 0)
            torch.testing.assert_close(out[row, h].float(), p @ vals, rtol=2e-2, atol=2e-3)
    assert (out[1] == 7).all() and (out[3] == 7).all()  # dense rows and the idle slot's


def _shared_region(seed: int, sequences: int, n: int = 300, hk: int = 2, d: int = 64):
    """Random keys encoded once and given to ``sequences`` sequences: the rotation, the levels
    and ``[centroid ids, codes, weights, bit counts]`` with a leading sequence dimension."""
    torch.manual_seed(seed)
    keys = torch.randn(n, hk, d, device=DEVICE).to(torch.float16)
    rt, levels, *parts = _encoded(keys)
    return rt, levels, [t.expand(sequences, *t.shape).contiguous() for t in parts]


def test_selector_reads_each_slot_query_from_its_batch_row():
    """The same selection whether each slot's query is passed alone or read from the decode
    batch through ``row_of_slot``; an idle slot (row -1, no keys this step, as the server gives
    it) selects nothing and its query tables and bit planes are not computed at all."""
    hq, hk, d, n = 4, 2, 64, 300
    rt, levels, two = _shared_region(6, 2, n, hk, d)
    batch = torch.randn(3, hq, d, device=DEVICE).to(torch.float16)
    # the sampled path: which keys at the threshold are kept does not depend on atomics' order
    sel = Selector(2, hq, hk, d, n, c=64, k=8, device=DEVICE, block_n=128, sample_stride=16)
    want = sel(batch[[2, 0]].contiguous(), rt, levels, *two[:3],
               torch.tensor([n, n], dtype=torch.int32, device=DEVICE), two[3]).clone()
    for buf in (sel.qt, sel.qnorm, sel.planes, sel.params):
        buf[1] = 7  # the idle slot's: left as they are
    got = sel(batch, rt, levels, *two[:3], torch.tensor([n, 0], dtype=torch.int32,
                                                          device=DEVICE),
              two[3], row_of_slot=torch.tensor([2, -1], device=DEVICE))
    assert [sorted(x) for x in got.tolist()[0]] == [sorted(x) for x in want.tolist()[0]]
    assert (got[1] == -1).all()
    for buf in (sel.qt, sel.qnorm, sel.planes, sel.params):
        assert (buf[1] == 7).all()


@pytest.mark.parametrize("stride", [1, 16])
def test_a_sequence_not_selecting_attends_its_last_selection_moved_on(stride):
    """``n_sel`` 0 for a sequence with keys (``--sparse-reselect-interval``): none of its query
    tables or planes is computed and it gets its last selection (``last``) moved on by
    ``shift`` rows, rows past its region dropped, while ``last`` keeps the selection itself;
    the sequence selecting gets what it gets without ``n_sel`` and ``last`` records it; an
    idle one gets -1."""
    hq, hk, d, n = 4, 2, 64, 300
    rt, levels, three = _shared_region(10, 3, n, hk, d)
    q = torch.randn(3, hq, d, device=DEVICE).to(torch.float16)
    sel = Selector(3, hq, hk, d, n, c=64, k=8, device=DEVICE, block_n=128, sample_stride=stride)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    n_ret = torch.tensor([n, n, 0], **i32)
    want = sel(q, rt, levels, *three[:3], n_ret, three[3]).clone()
    last = torch.full((3, hk, 8), 5, **i32)
    last[1, :, :3] = torch.tensor([0, n - 3, -1], **i32)  # n - 3 + 3 leaves the region
    kept = last[1].clone()
    for buf in (sel.qt, sel.qnorm, sel.planes, sel.params):
        buf[1] = 7
    got = sel(q, rt, levels, *three[:3], n_ret, three[3], n_sel=torch.tensor([n, 0, 0], **i32),
              last=last, shift=torch.tensor([0, 3, 0], **i32))
    assert [sorted(x) for x in got[0].tolist()] == [sorted(x) for x in want[0].tolist()]
    assert torch.equal(last[0], got[0]) and torch.equal(last[1], kept)
    assert got[1, :, :3].tolist() == [[3, -1, -1]] * hk and (got[1, :, 3:] == 8).all()
    assert (got[2] == -1).all()
    for buf in (sel.qt, sel.qnorm, sel.planes, sel.params):
        assert (buf[1] == 7).all()
    with pytest.raises(ValueError, match="last must be int32"):
        sel(q, rt, levels, *three[:3], n_ret, three[3], n_sel=n_ret, last=last[:, :, :4],
            shift=n_ret)
    with pytest.raises(ValueError, match="n_sel and shift must be like n_ret"):
        sel(q, rt, levels, *three[:3], n_ret, three[3], n_sel=n_ret.long(), last=last,
            shift=n_ret)


@pytest.mark.parametrize("stride", [1, 16])
def test_a_sequence_not_voting_reranks_its_kept_candidates_moved_on(stride):
    """``cand`` (``--sparse-vote-interval``): a vote writes each voting sequence's candidates
    into the caller's list and selects what it selects without one; at a later step a sequence
    not voting (``n_sel`` 0, ``shift`` s) reranks that list moved on by s rows with its query
    and takes its top-k. On a region moved on by s rows (row i + s holds what row i held) that
    is the vote's selection moved on, its list untouched; an idle sequence selects nothing.

    The budget holds every key: which keys at the pruning threshold's bin a vote keeps is
    unspecified (atomic counters on a GPU), so two votes over the same keys agree only when
    the threshold cuts nothing. Sequence 1 votes over the region's first n - s keys, so its
    picks moved on by s stay inside the region."""
    hq, hk, d, n, s, c = 4, 2, 64, 300, 3, 512
    torch.manual_seed(12)
    keys = torch.randn(n, hk, d, device=DEVICE).to(torch.float16)
    moved_keys = torch.cat([torch.randn(s, hk, d, device=DEVICE).to(torch.float16),
                            keys[: n - s]])
    rt, levels, *orig = _encoded(keys)
    _, _, *moved = _encoded(moved_keys)
    q = torch.randn(3, hq, d, device=DEVICE).to(torch.float16)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    sel = Selector(3, hq, hk, d, n, c=c, k=8, device=DEVICE, block_n=128, sample_stride=stride)
    n_ret = torch.tensor([n, n - s, 0], **i32)
    regions = [torch.stack([o, o, o]).contiguous() for o in orig]
    want = sel(q, rt, levels, *regions[:3], n_ret, regions[3]).clone()
    kept = torch.full((3, hk, c), 11, **i32)
    voted = sel(q, rt, levels, *regions[:3], n_ret, regions[3], n_sel=n_ret,
                shift=torch.zeros(3, **i32), cand=kept).clone()
    assert [sorted(x) for x in voted[:2].flatten(0, 1).tolist()] == \
        [sorted(x) for x in want[:2].flatten(0, 1).tolist()]
    assert (voted[2] == -1).all()
    for b, n_b in enumerate((n, n - s)):  # every key of the region a candidate, once
        assert [sorted(x for x in h if x >= 0) for h in kept[b].tolist()] == \
            [list(range(n_b))] * hk
    assert (kept[2] == 11).all()  # an idle sequence's list unread
    list_then = kept.clone()
    regions = [torch.stack([o, m, o]).contiguous() for o, m in zip(orig, moved, strict=True)]
    got = sel(q, rt, levels, *regions[:3], torch.tensor([n, n, 0], **i32), regions[3],
              n_sel=torch.tensor([n, 0, 0], **i32), shift=torch.tensor([0, s, 0], **i32),
              cand=kept)
    assert torch.equal(kept[1:], list_then[1:])  # the reranked list is kept as the vote left it
    assert [sorted(x) for x in got[0].tolist()] == [sorted(x) for x in want[0].tolist()]
    assert [sorted(x) for x in got[1].tolist()] == [sorted(v + s for v in x)
                                                    for x in voted[1].tolist()]
    assert (got[2] == -1).all()
    with pytest.raises(ValueError, match="cand must be int32"):
        sel(q, rt, levels, *regions[:3], n_ret, regions[3], n_sel=n_ret, shift=n_ret,
            cand=kept[:, :, :32])
    with pytest.raises(ValueError, match="needs n_sel and shift"):
        sel(q, rt, levels, *regions[:3], n_ret, regions[3], cand=kept)


@pytest.mark.parametrize("stride", [1, 4])
def test_a_sequence_without_keys_selects_nothing_beside_one_with_keys(stride):
    """An idle slot has no keys this step (``n_ret`` 0): its selection is empty (-1) and its
    rerank blocks read nothing, while the other sequence's selection is what it is alone."""
    torch.manual_seed(9)
    hq, hk, d, n, c = 4, 2, 64, 300, 200  # C spans several rerank blocks of 64
    keys = torch.randn(n, hk, d, device=DEVICE).to(torch.float16)
    rt, levels, cent, codes, w, counts = _encoded(keys)
    q = torch.randn(2, hq, d, device=DEVICE).to(torch.float16)
    two = [t.expand(2, *t.shape).contiguous() for t in (cent, codes, w, counts)]
    kw = dict(k=8, device=DEVICE, block_n=128, span=128, sample_stride=stride)
    pair = Selector(2, hq, hk, d, n, c=c, **kw)
    got = pair(q, rt, levels, *two[:3], torch.tensor([n, 0], dtype=torch.int32, device=DEVICE),
               two[3]).clone()
    alone = Selector(1, hq, hk, d, n, c=c, **kw)
    want = alone(q[:1], rt, levels, *(t[:1] for t in two[:3]),
                 torch.tensor([n], dtype=torch.int32, device=DEVICE), two[3][:1])
    assert (got[1] == -1).all()
    assert [sorted(x) for x in got[0].tolist()] == [sorted(x) for x in want[0].tolist()]


@pytest.mark.parametrize("hq,hk", GROUPS)
def test_layer_slides_tokens_to_host_and_full_selection_is_dense_attention(hq, hk):
    """Prefill + decode through the window: tokens leave the window for the host region in
    ``update`` chunks; selecting every host token makes sparse attention exact."""
    torch.manual_seed(4)
    d, batch = 64, 2
    sink, local, update, cap = 4, 16, 8, 256
    layer = ParisKVLayer(batch, hq, hk, d, cap, k=cap, candidates=cap, sink=sink, local=local,
                         update=update, dtype=torch.float16, device=DEVICE)
    seqs_k = [torch.randn(n, hk, d, device=DEVICE).to(torch.float16) for n in (60, 10)]
    seqs_v = [torch.randn_like(k) for k in seqs_k]
    for b in range(batch):
        layer.prefill(b, seqs_k[b], seqs_v[b])
    assert layer.n_ret_host == [60 - sink - local, 0]
    for _ in range(20):
        k, v = (torch.randn(batch, hk, d, device=DEVICE).to(torch.float16) for _ in range(2))
        layer.append(k, v)
        for b in range(batch):
            seqs_k[b] = torch.cat([seqs_k[b], k[b][None]])
            seqs_v[b] = torch.cat([seqs_v[b], v[b][None]])
    # sequence 0: 80 tokens = 4 sink + 16..23 recent + the rest on the host
    assert layer.n_ret_host[0] + layer.win_len_host[0] == 80
    assert layer.n_ret_host[0] == 40 + 16 and layer.win_len_host[0] == sink + 20
    q = torch.randn(batch, hq, d, device=DEVICE).to(torch.float16)
    out = layer.attend(q)
    for b in range(batch):
        for h in range(hq):
            kv = h // (hq // hk)
            p = torch.softmax(seqs_k[b][:, kv].float() @ q[b, h].float() / math.sqrt(d), 0)
            torch.testing.assert_close(out[b, h].float(), p @ seqs_v[b][:, kv].float(),
                                       rtol=2e-2, atol=2e-3)
