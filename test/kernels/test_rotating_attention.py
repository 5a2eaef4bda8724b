"""Rotating-attention kernels vs the plain-torch reference (rotate K, then attend).

On CPU these run under TRITON_INTERPRET=1 at tiny shapes; with a GPU they also run at
Llama-3-8B head shapes (32 q heads, 8 kv heads, head_dim 128, bf16).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from sglang_pic_kernel.rotating_attention import (  # noqa: E402
    NEW_KEYS_IN_KERNEL,
    NEW_KEYS_PRE_ROTATED,
    ROPE_FROM_CACHE,
    ROPE_IN_KERNEL,
    ROPE_STEP,
    RotaryTable,
    reference_decode,
    reference_extend,
    rotate_neox,
    rotating_decode_attention_fwd,
    rotating_extend_attention_fwd,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def llama3_inv_freq(head_dim: int, base: float = 500000.0, factor: float = 8.0,
                    low: float = 1.0, high: float = 4.0, orig: int = 8192) -> torch.Tensor:
    """Llama-3.1 frequency scaling, as in HF's ``_compute_llama3_parameters``."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    wavelen = 2 * torch.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    mid = (wavelen <= orig / low) & (wavelen >= orig / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def plain_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)


ROPES = {
    "llama2": lambda d: plain_inv_freq(d, 10000.0),
    "llama3": llama3_inv_freq,
    "qwen2": lambda d: plain_inv_freq(d, 1000000.0),
}


def _table(kind: str, head_dim: int, mode: str, max_pos: int = 4096) -> RotaryTable:
    return RotaryTable.from_inv_freq(ROPES[kind](head_dim), max_pos, mode).to(DEVICE)


def _pool(slots: int, kv_heads: int, head_dim: int, dtype):
    k = torch.randn(slots, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(slots, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    return k, v


def _scattered_slots(lens: list[int], slots: int, page_size: int) -> tuple[torch.Tensor, ...]:
    """kv_indptr / kv_indices for requests whose tokens sit on random pages of `page_size`."""
    pages = torch.randperm(slots // page_size)
    indices, indptr, used = [], [0], 0
    for n in lens:
        need = -(-n // page_size)
        req_pages = pages[used : used + need]
        used += need
        tok = (req_pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()[:n]
        indices.append(tok)
        indptr.append(indptr[-1] + n)
    return (torch.tensor(indptr, dtype=torch.int32, device=DEVICE),
            torch.cat(indices).to(DEVICE, torch.int64))


CPU_DECODE = [  # (q_heads, kv_heads, head_dim, lens, page_size, rope, mode)
    (4, 2, 32, [5, 40, 77], 1, "llama3", ROPE_STEP),
    (4, 1, 32, [33, 3], 4, "qwen2", ROPE_IN_KERNEL),
    (2, 2, 32, [64], 16, "llama2", ROPE_FROM_CACHE),
]
def _gpu(cases: list) -> list:
    """Model-sized cases: run on the device (``make test-gpu``), skipped on CPU machines."""
    return [pytest.param(c, marks=pytest.mark.gpu) for c in cases]


GPU_DECODE = [
    (32, 8, 128, [1000, 4096, 17, 8000], 1, "llama3", ROPE_STEP),
    (32, 8, 128, [1000, 4096, 17, 30000], 1, "llama3", ROPE_FROM_CACHE),
    (32, 8, 128, [1000, 4096, 17, 8000], 16, "llama3", ROPE_IN_KERNEL),
    (28, 4, 128, [3000, 129], 64, "qwen2", ROPE_STEP),
    (32, 32, 128, [2048, 5], 1, "llama2", ROPE_IN_KERNEL),
]


@pytest.mark.parametrize("case", CPU_DECODE + _gpu(GPU_DECODE))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if DEVICE == "cuda"
                         else [torch.float32])
def test_decode_matches_reference(case, dtype):
    hq, hk, d, lens, page, rope_kind, mode = case
    torch.manual_seed(0)
    table = _table(rope_kind, d, mode, max_pos=max(lens) + 64)
    slots = page * (sum(-(-n // page) for n in lens) + 4)
    k_buf, v_buf = _pool(slots, hk, d, dtype)
    kv_indptr, kv_indices = _scattered_slots(lens, slots, page)
    q = torch.randn(len(lens), hq, d, device=DEVICE, dtype=dtype)
    max_splits = 8
    logits = torch.empty(len(lens), hq, max_splits, d, device=DEVICE, dtype=torch.float32)
    lse = torch.empty(len(lens), hq, max_splits, device=DEVICE, dtype=torch.float32)
    splits = torch.tensor([min(max_splits, max(1, n // 16)) for n in lens], device=DEVICE,
                          dtype=torch.int32)
    o = torch.empty_like(q)
    scale = d**-0.5
    rotating_decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr, kv_indices, logits, lse,
                                  splits, max_splits, scale, rope=table)
    ref = reference_decode(q, k_buf, v_buf, kv_indptr, kv_indices, scale, table)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol)


CPU_EXTEND = [  # (q_heads, kv_heads, head_dim, prefix_lens, extend_lens, page, rope, mode)
    (4, 2, 32, [0, 7], [20, 9], 1, "llama3", ROPE_STEP),
    (2, 1, 32, [33], [17], 4, "qwen2", ROPE_IN_KERNEL),
]
GPU_EXTEND = [
    (32, 8, 128, [0, 0], [1024, 300], 1, "llama3", ROPE_FROM_CACHE),
    (32, 8, 128, [2048, 100, 0], [512, 1, 777], 16, "llama3", ROPE_IN_KERNEL),
    (28, 4, 128, [4000], [129], 64, "qwen2", ROPE_STEP),
    (32, 32, 128, [64], [64], 1, "llama2", ROPE_FROM_CACHE),
]


@pytest.mark.parametrize("new_keys", [NEW_KEYS_PRE_ROTATED, NEW_KEYS_IN_KERNEL])
@pytest.mark.parametrize("case", CPU_EXTEND + _gpu(GPU_EXTEND))
@pytest.mark.parametrize("dtype", [torch.bfloat16] if DEVICE == "cuda" else [torch.float32])
def test_extend_matches_reference(case, dtype, new_keys):
    hq, hk, d, pre_lens, ext_lens, page, rope_kind, mode = case
    torch.manual_seed(1)
    table = _table(rope_kind, d, mode, max_pos=max(p + e for p, e in zip(pre_lens, ext_lens, strict=True)) + 8)
    slots = page * (sum(-(-n // page) for n in pre_lens) + 4)
    k_buf, v_buf = _pool(slots, hk, d, dtype)
    kv_indptr, kv_indices = _scattered_slots(pre_lens, slots, page)
    n_new = sum(ext_lens)
    q = torch.randn(n_new, hq, d, device=DEVICE, dtype=dtype)
    k_ext = torch.randn(n_new, hk, d, device=DEVICE, dtype=dtype)
    v_ext = torch.randn(n_new, hk, d, device=DEVICE, dtype=dtype)
    qo_indptr = torch.tensor([0, *torch.tensor(ext_lens).cumsum(0).tolist()], device=DEVICE,
                             dtype=torch.int64)
    o = torch.empty_like(q)
    scale = d**-0.5
    rotating_extend_attention_fwd(q, k_ext, v_ext, o, k_buf, v_buf, qo_indptr, kv_indptr,
                                  kv_indices, None, True, None, max(ext_lens), 1.0, 1.0, scale,
                                  rope=table, new_keys=new_keys)
    ref = reference_extend(q, k_ext, v_ext, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices,
                           scale, table)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol)


def test_same_span_at_two_offsets_reads_one_physical_copy():
    """The point of position-free KV: one stored copy of a span, attended at two offsets,
    gives exactly what a private, pre-rotated copy at each offset would."""
    torch.manual_seed(2)
    hq, hk, d = 4, 2, 32
    table = _table("llama3", d, ROPE_STEP, max_pos=128)
    k_buf, v_buf = _pool(64, hk, d, torch.float32 if DEVICE == "cpu" else torch.bfloat16)
    span = torch.arange(40, 56)                     # 16 slots holding the shared span
    pre_a, pre_b = torch.arange(0, 3), torch.arange(3, 20)
    indices = torch.cat((pre_a, span, pre_b, span)).to(DEVICE)
    indptr = torch.tensor([0, 19, 52], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, hq, d, device=DEVICE, dtype=k_buf.dtype)
    logits = torch.empty(2, hq, 4, d, device=DEVICE)
    lse = torch.empty(2, hq, 4, device=DEVICE)
    o = torch.empty_like(q)
    rotating_decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, logits, lse,
                                  torch.full((2,), 2, dtype=torch.int32, device=DEVICE), 4,
                                  d**-0.5, rope=table)
    ref = reference_decode(q, k_buf, v_buf, indptr, indices, d**-0.5, table)
    tol = 1e-4 if DEVICE == "cpu" else 2e-2
    torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol)
    # and the keys really were rotated: attending them un-rotated (a zero-frequency table) is
    # far from the kernel's output
    plain = RotaryTable.from_inv_freq(torch.zeros(d // 2), 128, ROPE_STEP).to(DEVICE)
    unrotated = reference_decode(q, k_buf, v_buf, indptr, indices, d**-0.5, plain)
    assert (o.float() - unrotated).abs().max() > 20 * tol


def _shifted_pool(k_unrotated: torch.Tensor, kv_indptr, kv_indices, table: RotaryTable,
                  moved: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shifted layout of a pool: each slot's key rotated at the position it was computed
    at, and that position per slot. Every request's keys sit at their index, except that the
    ``moved`` keys from index 5 on of each request were computed elsewhere (a span computed at
    its own start and reused at offset 5) - ``moved == 0``: nothing moved."""
    slots = k_unrotated.shape[0]
    stored = torch.zeros(slots, dtype=torch.int32, device=DEVICE)
    for b in range(kv_indptr.numel() - 1):
        req = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        pos = torch.arange(req.numel(), device=DEVICE, dtype=torch.int32)
        span = slice(5, 5 + moved)
        pos[span] -= 5
        stored[req] = pos
    k = rotate_neox(k_unrotated, stored.long(), table)
    return k, stored


SHIFTED_DECODE = [  # (q_heads, kv_heads, head_dim, lens, page, rope, moved)
    (4, 2, 32, [5, 40, 77], 1, "llama3", 20),
    (4, 1, 32, [33, 9], 4, "qwen2", 0),
]
GPU_SHIFTED_DECODE = [
    (32, 8, 128, [1000, 4096, 17, 8000], 1, "llama3", 4000),
    (28, 4, 128, [3000, 129], 64, "qwen2", 0),
]


@pytest.mark.parametrize("case", SHIFTED_DECODE + _gpu(GPU_SHIFTED_DECODE))
def test_shifted_decode_matches_reference(case):
    """Keys stored rotated where they were computed, some of them reused at another offset:
    the kernel turns each by the distance moved and matches attention over keys rotated at
    their index (the un-rotated reference)."""
    hq, hk, d, lens, page, rope_kind, moved = case
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    torch.manual_seed(3)
    table = _table(rope_kind, d, ROPE_FROM_CACHE, max_pos=max(lens) + 64)
    slots = page * (sum(-(-n // page) for n in lens) + 4)
    k0, v_buf = _pool(slots, hk, d, dtype)
    kv_indptr, kv_indices = _scattered_slots(lens, slots, page)
    k_buf, stored = _shifted_pool(k0, kv_indptr, kv_indices, table, moved)
    q = torch.randn(len(lens), hq, d, device=DEVICE, dtype=dtype)
    max_splits = 8
    logits = torch.empty(len(lens), hq, max_splits, d, device=DEVICE, dtype=torch.float32)
    lse = torch.empty(len(lens), hq, max_splits, device=DEVICE, dtype=torch.float32)
    splits = torch.tensor([min(max_splits, max(1, n // 16)) for n in lens], device=DEVICE,
                          dtype=torch.int32)
    o = torch.empty_like(q)
    rotating_decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr, kv_indices, logits, lse,
                                  splits, max_splits, d**-0.5, rope=table,
                                  stored_positions=stored)
    ref = reference_decode(q, k0, v_buf, kv_indptr, kv_indices, d**-0.5, table)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol)


SHIFTED_EXTEND = [  # (q_heads, kv_heads, head_dim, prefix_lens, extend_lens, page, rope, moved)
    (4, 2, 32, [0, 30], [20, 9], 1, "llama3", 16),
]
GPU_SHIFTED_EXTEND = [
    (32, 8, 128, [2048, 100, 0], [512, 1, 777], 16, "llama3", 1024),
]


@pytest.mark.parametrize("case", SHIFTED_EXTEND + _gpu(GPU_SHIFTED_EXTEND))
def test_shifted_extend_matches_reference(case):
    """Prefix keys in the shifted layout (some moved), new keys rotated by the model at their
    positions: same output as the un-rotated reference."""
    hq, hk, d, pre_lens, ext_lens, page, rope_kind, moved = case
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    torch.manual_seed(4)
    table = _table(rope_kind, d, ROPE_FROM_CACHE,
                   max_pos=max(p + e for p, e in zip(pre_lens, ext_lens, strict=True)) + 8)
    slots = page * (sum(-(-n // page) for n in pre_lens) + 4)
    k0, v_buf = _pool(slots, hk, d, dtype)
    kv_indptr, kv_indices = _scattered_slots(pre_lens, slots, page)
    k_buf, stored = _shifted_pool(k0, kv_indptr, kv_indices, table, moved)
    n_new = sum(ext_lens)
    q = torch.randn(n_new, hq, d, device=DEVICE, dtype=dtype)
    k_ext0 = torch.randn(n_new, hk, d, device=DEVICE, dtype=dtype)
    v_ext = torch.randn(n_new, hk, d, device=DEVICE, dtype=dtype)
    new_pos = torch.cat([p + torch.arange(e) for p, e in zip(pre_lens, ext_lens, strict=True)])
    k_ext = rotate_neox(k_ext0, new_pos.to(DEVICE), table)
    qo_indptr = torch.tensor([0, *torch.tensor(ext_lens).cumsum(0).tolist()], device=DEVICE,
                             dtype=torch.int64)
    o = torch.empty_like(q)
    rotating_extend_attention_fwd(q, k_ext, v_ext, o, k_buf, v_buf, qo_indptr, kv_indptr,
                                  kv_indices, None, True, None, max(ext_lens), 1.0, 1.0,
                                  d**-0.5, rope=table, stored_positions=stored)
    ref = reference_extend(q, k_ext0, v_ext, k0, v_buf, qo_indptr, kv_indptr, kv_indices,
                           d**-0.5, table)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol)
