"""Rotating-attention kernels vs the plain-torch reference (rotate K, then attend).

The kernels read keys in the shifted layout (rotated where they were computed, a position per
pool slot, each key turned by the distance it moved); the references take the same keys
un-rotated and rotate each at its index. Cases with no key moved (a pool as vanilla's) and with
a span moved. On CPU these run under TRITON_INTERPRET=1 at tiny shapes; with a GPU they also run
at model head shapes (32/8 and 28/4 heads, head_dim 128, bf16 and fp16).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from sglang_pic_kernel.rotating_attention import (
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


def _table(kind: str, head_dim: int, max_pos: int = 4096) -> RotaryTable:
    return RotaryTable.from_inv_freq(ROPES[kind](head_dim), max_pos).to(DEVICE)


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


def _gpu(cases: list) -> list:
    """Model-sized cases: run on the device (``make test-gpu``), skipped on CPU machines."""
    return [pytest.param(c, marks=pytest.mark.gpu) for c in cases]


DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32]


def _tol(dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


def _shifted_pool(k_unrotated: torch.Tensor, kv_indptr, kv_indices, table: RotaryTable,
                  moved: int, offset: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """The shifted layout of a pool: each slot's key rotated at the position it was computed
    at, and that position per slot. Every request's keys sit at their index, except that the
    ``moved`` keys from index ``offset`` on of each request were computed elsewhere (a span
    computed at its own start and reused at ``offset``) - ``moved == 0``: nothing moved, the
    pool vanilla SGLang would hold."""
    slots = k_unrotated.shape[0]
    stored = torch.zeros(slots, dtype=torch.int32, device=DEVICE)
    for b in range(kv_indptr.numel() - 1):
        req = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        pos = torch.arange(req.numel(), device=DEVICE, dtype=torch.int32)
        pos[offset : offset + moved] -= offset
        stored[req] = pos
    k = rotate_neox(k_unrotated, stored.long(), table)
    return k, stored


def _decode_scratch(batch: int, hq: int, d: int, lens: list[int], max_splits: int = 8):
    logits = torch.empty(batch, hq, max_splits, d, device=DEVICE, dtype=torch.float32)
    lse = torch.empty(batch, hq, max_splits, device=DEVICE, dtype=torch.float32)
    splits = torch.tensor([min(max_splits, max(1, n // 16)) for n in lens], device=DEVICE,
                          dtype=torch.int32)
    return logits, lse, splits, max_splits


SHIFTED_DECODE = [  # (q_heads, kv_heads, head_dim, lens, page, rope, moved)
    (4, 2, 32, [5, 40, 77], 1, "llama3", 20),
    (4, 2, 32, [5, 40, 77], 1, "llama3", 0),
    (4, 1, 32, [33, 9], 4, "qwen2", 0),
    (4, 1, 32, [33, 3], 4, "qwen2", 25),
    (2, 2, 32, [64], 16, "llama2", 50),
]
GPU_SHIFTED_DECODE = [
    (32, 8, 128, [1000, 4096, 17, 8000], 1, "llama3", 4000),
    (32, 8, 128, [1000, 4096, 17, 30000], 1, "llama3", 0),
    (32, 8, 128, [1000, 4096, 17, 30000], 1, "llama3", 27000),
    (32, 8, 128, [1000, 4096, 17, 8000], 16, "llama3", 0),
    (28, 4, 128, [3000, 129], 64, "qwen2", 0),
    (28, 4, 128, [3000, 129], 64, "qwen2", 2900),
    (32, 32, 128, [2048, 5], 1, "llama2", 2000),
]


@pytest.mark.parametrize("case", SHIFTED_DECODE + _gpu(GPU_SHIFTED_DECODE))
@pytest.mark.parametrize("dtype", DTYPES)
def test_shifted_decode_matches_reference(case, dtype):
    """Keys stored rotated where they were computed, some of them reused at another offset:
    the kernel turns each by the distance moved and matches attention over keys rotated at
    their index (the un-rotated reference)."""
    hq, hk, d, lens, page, rope_kind, moved = case
    torch.manual_seed(3)
    table = _table(rope_kind, d, max_pos=max(lens) + 64)
    slots = page * (sum(-(-n // page) for n in lens) + 4)
    k0, v_buf = _pool(slots, hk, d, dtype)
    kv_indptr, kv_indices = _scattered_slots(lens, slots, page)
    k_buf, stored = _shifted_pool(k0, kv_indptr, kv_indices, table, moved)
    q = torch.randn(len(lens), hq, d, device=DEVICE, dtype=dtype)
    o = torch.empty_like(q)
    rotating_decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr, kv_indices,
                                  *_decode_scratch(len(lens), hq, d, lens), d**-0.5,
                                  rope=table, stored_positions=stored)
    ref = reference_decode(q, k0, v_buf, kv_indptr, kv_indices, d**-0.5, table)
    torch.testing.assert_close(o.float(), ref, atol=_tol(dtype), rtol=_tol(dtype))


@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's CPU interpreter only")
def test_the_interpreter_patches_the_language_once_per_launch(monkeypatch):
    """``sglang_pic_kernel._interpreter.skip_nested_lang_patching``: in an interpreted launch, the
    helpers the kernel calls (ours and Triton's ``tl.max``, ``tl.cdiv``: many calls per program)
    no longer patch ``triton.language`` again on every call, and the output is bit for bit the
    one the interpreter computes with them patching (``__wrapped__``: its own functions)."""
    from triton.runtime import interpreter

    assert hasattr(interpreter._patch_lang, "__wrapped__"), "the shortcut is not installed"
    patches = []
    patch_builtin = interpreter._patch_builtin  # each _patch_lang patches 3-4 modules with it
    monkeypatch.setattr(interpreter, "_patch_builtin",
                        lambda *a: (patches.append(a[0]), patch_builtin(*a))[1])

    def decode() -> torch.Tensor:
        hq, hk, d, lens, page, rope_kind, moved = SHIFTED_DECODE[0]
        torch.manual_seed(3)
        table = _table(rope_kind, d, max_pos=max(lens) + 64)
        slots = page * (sum(-(-n // page) for n in lens) + 4)
        k0, v_buf = _pool(slots, hk, d, torch.float32)
        kv_indptr, kv_indices = _scattered_slots(lens, slots, page)
        k_buf, stored = _shifted_pool(k0, kv_indptr, kv_indices, table, moved)
        q = torch.randn(len(lens), hq, d, device=DEVICE)
        o = torch.empty_like(q)
        rotating_decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr, kv_indices,
                                      *_decode_scratch(len(lens), hq, d, lens), d**-0.5,
                                      rope=table, stored_positions=stored)
        return o

    fast = decode()
    fast_patches = len(patches)
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.__wrapped__)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__",
                        interpreter.GridExecutor.__call__.__wrapped__)
    patches.clear()
    assert torch.equal(decode(), fast)
    # two launches (stage 1 and 2), each patching its modules once, not on every helper call
    # (measured: 17 module patches against 1736)
    assert fast_patches * 50 < len(patches), (fast_patches, len(patches))


SHIFTED_EXTEND = [  # (q_heads, kv_heads, head_dim, prefix_lens, extend_lens, page, rope, moved)
    (4, 2, 32, [0, 30], [20, 9], 1, "llama3", 16),
    (4, 2, 32, [0, 7], [20, 9], 1, "llama3", 0),
    (2, 1, 32, [33], [17], 4, "qwen2", 0),
    (2, 1, 32, [33], [17], 4, "qwen2", 28),
]
GPU_SHIFTED_EXTEND = [
    (32, 8, 128, [0, 0], [1024, 300], 1, "llama3", 0),
    (32, 8, 128, [2048, 100, 0], [512, 1, 777], 16, "llama3", 0),
    (32, 8, 128, [2048, 100, 0], [512, 1, 777], 16, "llama3", 1024),
    (28, 4, 128, [4000], [129], 64, "qwen2", 0),
    (28, 4, 128, [4000], [129], 64, "qwen2", 3995),
    (32, 32, 128, [64], [64], 1, "llama2", 50),
]


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("case", SHIFTED_EXTEND + _gpu(GPU_SHIFTED_EXTEND))
@pytest.mark.parametrize("dtype", DTYPES)
def test_shifted_extend_matches_reference(case, dtype, splits):
    """Prefix keys in the shifted layout (some moved), new keys rotated by the model at their
    positions: same output as the un-rotated reference, whole or with the prefix cut in ranges
    merged by log-sum-exp (``splits``; the default picks it from the grid: 1 on CPU). Three
    ranges over a 7- or 30-key prefix leave some ranges empty."""
    hq, hk, d, pre_lens, ext_lens, page, rope_kind, moved = case
    torch.manual_seed(4)
    table = _table(rope_kind, d,
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
                                  d**-0.5, rope=table, stored_positions=stored, splits=splits)
    ref = reference_extend(q, k_ext0, v_ext, k0, v_buf, qo_indptr, kv_indptr, kv_indices,
                           d**-0.5, table)
    torch.testing.assert_close(o.float(), ref, atol=_tol(dtype), rtol=_tol(dtype))


def test_same_span_at_two_offsets_reads_one_physical_copy():
    """The point of position-free KV: one stored copy of a span, computed at 0..15 and read at
    two offsets (after prefixes of 3 and 17 keys), gives exactly what a private copy rotated at
    each offset would."""
    torch.manual_seed(2)
    hq, hk, d = 4, 2, 32
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    table = _table("llama3", d, max_pos=128)
    k0, v_buf = _pool(64, hk, d, dtype)
    span = torch.arange(40, 56)                     # 16 slots holding the shared span
    pre_a, pre_b = torch.arange(0, 3), torch.arange(3, 20)
    stored = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    stored[pre_a] = torch.arange(3, dtype=torch.int32, device=DEVICE)
    stored[pre_b] = torch.arange(17, dtype=torch.int32, device=DEVICE)
    stored[span] = torch.arange(16, dtype=torch.int32, device=DEVICE)   # computed alone, at 0
    k_buf = rotate_neox(k0, stored.long(), table)
    indices = torch.cat((pre_a, span, pre_b, span)).to(DEVICE)
    indptr = torch.tensor([0, 19, 52], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, hq, d, device=DEVICE, dtype=dtype)
    logits = torch.empty(2, hq, 4, d, device=DEVICE)
    lse = torch.empty(2, hq, 4, device=DEVICE)
    splits = torch.full((2,), 2, dtype=torch.int32, device=DEVICE)
    o = torch.empty_like(q)
    rotating_decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, logits, lse, splits, 4,
                                  d**-0.5, rope=table, stored_positions=stored)
    ref = reference_decode(q, k0, v_buf, indptr, indices, d**-0.5, table)
    tol = _tol(dtype)
    torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol)
    # and the span's keys really were turned: reading them as stored (a table of zero
    # frequencies turns nothing) is far from the reference (0.58 on CPU; 8x the bf16 tolerance)
    still = RotaryTable.from_inv_freq(torch.zeros(d // 2), 128).to(DEVICE)
    unturned = torch.empty_like(q)
    rotating_decode_attention_fwd(q, k_buf, v_buf, unturned, indptr, indices, logits, lse,
                                  splits, 4, d**-0.5, rope=still, stored_positions=stored)
    assert (unturned.float() - ref).abs().max() > 0.25
