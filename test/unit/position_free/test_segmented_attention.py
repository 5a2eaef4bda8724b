"""Segmented attention (position_free.segmented_backend) against rotate-then-attend.

A pool holds keys rotated where they were computed; requests read some of them moved (a span
computed at 0 read at an offset, or moved back). The reference rotates every key at its index in
the request and attends in float32. Segmented attention must give the same output for decode
steps and for extends (new tokens after a moved prefix, and without a prefix) with the torch
kernels (the CPU engine's path), and with FlashInfer's kernels on a GPU (same inputs, compared
with the torch kernels' output).
"""

from __future__ import annotations

import types

import pytest
import torch
from sglang_pic.position_free import shifted_batches
from sglang_pic.position_free.key_runs import KeyRuns, request_runs, runs_from_shifts
from sglang_pic.position_free.moved_copies import turn_keys
from sglang_pic.position_free.run_kernels import TorchRunKernels, _attend
from sglang_pic.position_free.segmented_backend import SegmentedAttention

H, HKV, D = 8, 2, 128  # Llama-3's GQA group (4) and head size: the shapes FlashInfer compiled
SMOLLM2 = (9, 3, 64)
"""SmolLM2-135M's heads (query, KV, size): a GQA group of 3 and head size 64, the shape the
real-weights GPU tests serve (test/gpu/test_position_free_gpu.py)."""


def _cos_sin(positions: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(positions).float(), inv)
    return torch.cat((freqs.cos(), freqs.sin()), -1)


class _Pool:
    def __init__(self, k, v):
        self.k, self.v = k, v

    def get_kv_buffer(self, layer_id):
        return self.k, self.v

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[loc], self.v[loc] = k, v


def _case(seed: int, device: str, dtype: torch.dtype, heads: tuple[int, int, int] = (H, HKV, D)):
    """Three requests over a pool: runs with shifts 0 / +offset / 0, one moved back, one plain.
    Returns the raw (unrotated) keys, the pool, the rows, each row's runs and ``heads``
    (query heads, KV heads, head size)."""
    h, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    slots, positions = 600, 2048
    cos_sin = _cos_sin(positions, d)
    raw = torch.randn(slots, hkv, d, generator=g)
    v = torch.randn(slots, hkv, d, generator=g)
    stored = torch.zeros(slots, dtype=torch.long)
    perm = torch.randperm(slots - 100, generator=g)  # rows take scattered slots
    lengths = [int(x) for x in torch.randint(40, 160, (3,), generator=g)]
    rows, runs, at = [], [], 0
    for i, n in enumerate(lengths):
        row = perm[at : at + n]
        at += n
        if i == 0:  # a system prompt, a span computed at 0 read at offset a, then the rest
            a, b = n // 4, n // 2
            pos = torch.cat((torch.arange(a), torch.arange(b - a), torch.arange(b, n)))
        elif i == 1:  # everything computed 7 positions later than it is read
            pos = torch.arange(n) + 7
        else:  # read where computed
            pos = torch.arange(n)
        stored[row] = pos
        rows.append(row)
        runs.append(runs_from_shifts(torch.arange(n) - pos))
    return _pool_case(raw, v, stored, rows, runs, lengths, cos_sin, heads, device, dtype,
                      table_rows=4)


def _pool_case(raw, v, stored, rows, runs, lengths, cos_sin, heads, device, dtype,
               table_rows: int) -> dict:
    """The case dict the tests read: the pool's keys rotated where they were computed
    (``stored``), each request's row in a ``req_to_token`` table of ``table_rows`` rows."""
    k = turn_keys(raw, stored, cos_sin)
    req_to_token = torch.zeros(table_rows, 512, dtype=torch.long)
    for i, row in enumerate(rows):
        req_to_token[i, : len(row)] = row
    return dict(raw=raw.to(device), k=k.to(device, dtype), v=v.to(device, dtype),
                rows=[r.to(device) for r in rows], runs=runs, lengths=lengths,
                req_to_token=req_to_token.to(device), cos_sin=cos_sin.to(device), heads=heads,
                layer=_layer(heads))


def _backend(c, kernels, device):
    return SegmentedAttention.over_pool(kernels, c["req_to_token"], _Pool(c["k"], c["v"]),
                                        c["cos_sin"], device)


def _layer(heads: tuple[int, int, int]) -> types.SimpleNamespace:
    h, hkv, d = heads
    return types.SimpleNamespace(scaling=d ** -0.5, logit_cap=0.0, tp_q_head_num=h,
                                 tp_k_head_num=hkv, tp_v_head_num=hkv, head_dim=d, layer_id=0)


def _mode(decode: bool):
    return types.SimpleNamespace(is_decode_or_idle=lambda: decode, is_extend=lambda: not decode)


def _decode(c, seg, device, seed):
    g = torch.Generator().manual_seed(seed + 1)
    n = len(c["lengths"])
    shifted_batches._runs = [request_runs(r, ln) for r, ln in zip(c["runs"], c["lengths"], strict=True)]
    fb = types.SimpleNamespace(req_pool_indices=torch.arange(n, device=device),
                               forward_mode=_mode(True), out_cache_loc=None)
    seg.init_forward_metadata(fb)
    h, _, d = c["heads"]
    q_raw = torch.randn(n, h, d, generator=g).to(device)
    q = turn_keys(q_raw, torch.tensor(c["lengths"], device=device), c["cos_sin"])
    return q, seg.forward_decode(q.to(c["k"].dtype), None, None, c["layer"], fb).view(n, h, d)


def _extend(c, seg, device, seed, new=(5, 3, 70)):
    """Request 0 extends its row (prefix: all of it), request 1 has no prefix, request 2 a
    prefix of all of its row."""
    g = torch.Generator().manual_seed(seed + 2)
    prefix = [c["lengths"][0], 0, c["lengths"][2]]
    shifted_batches._runs = [request_runs(c["runs"][0], prefix[0]), request_runs(None, 0),
                             request_runs(c["runs"][2], prefix[2])]
    req_pool = torch.tensor([0, 3, 2], device=device)
    fb = types.SimpleNamespace(req_pool_indices=req_pool, forward_mode=_mode(False),
                               extend_seq_lens_cpu=list(new), out_cache_loc=None)
    seg.init_forward_metadata(fb)
    pos = torch.cat([torch.arange(p, p + m) for p, m in zip(prefix, new, strict=True)]).to(device)
    total = sum(new)
    h, hkv, d = c["heads"]
    q = turn_keys(torch.randn(total, h, d, generator=g).to(device), pos, c["cos_sin"])
    k = turn_keys(torch.randn(total, hkv, d, generator=g).to(device), pos, c["cos_sin"])
    v = torch.randn(total, hkv, d, generator=g).to(device)
    dt = c["k"].dtype
    out = seg.forward_extend(q.to(dt), k.to(dt), v.to(dt), c["layer"], fb,
                             save_kv_cache=False).view(total, h, d)
    return (q, k, v, prefix, list(new)), out


def _reference_decode(c, q):
    outs = []
    for i, (row, n) in enumerate(zip(c["rows"], c["lengths"], strict=True)):
        keys = turn_keys(c["raw"][row], torch.arange(n, device=row.device), c["cos_sin"])
        outs.append(_attend(q[i : i + 1].float(), keys, c["v"][row].float(),
                            c["layer"].scaling, False)[0])
    return torch.cat(outs)


def _reference_extend(c, inputs):
    q, k, v, prefix, new = inputs
    outs, at = [], 0
    for i, (p, m) in enumerate(zip(prefix, new, strict=True)):
        row = c["rows"][i][:p] if p else c["rows"][i][:0]
        keys = turn_keys(c["raw"][row], torch.arange(p, device=row.device), c["cos_sin"])
        kk = torch.cat((keys, k[at : at + m].float()))
        vv = torch.cat((c["v"][row].float(), v[at : at + m].float()))
        outs.append(_attend(q[at : at + m].float(), kk, vv, c["layer"].scaling, True)[0])
        at += m
    return torch.cat(outs)


def test_runs_cover_the_prefix_then_shift_zero():
    def plain(runs):
        return [tuple(r[:3]) for r in runs]

    runs = runs_from_shifts(torch.tensor([0, 0, 5, 5, 5, 0, -2]))
    assert plain(runs) == [(0, 2, 0), (2, 5, 5), (5, 6, 0), (6, 7, -2)]
    assert plain(request_runs(runs, 10)) == [(0, 2, 0), (2, 5, 5), (5, 6, 0), (6, 7, -2),
                                             (7, 10, 0)]
    assert plain(request_runs(runs, 4)) == [(0, 2, 0), (2, 4, 5)]
    assert plain(request_runs(runs[:3], 9)) == [(0, 2, 0), (2, 5, 5), (5, 9, 0)]
    assert plain(request_runs(None, 3)) == [(0, 3, 0)]
    assert request_runs(None, 0) == []


def test_a_run_names_its_slots_while_whole_and_cached():
    """Equal slots give equal sources whatever the shift; a run cut short, or merged with the
    request's own keys, names none (other requests cannot read the same keys)."""
    a = runs_from_shifts(torch.tensor([0, 0, 3, 3, 0]), torch.tensor([7, 8, 20, 21, 9]))
    b = runs_from_shifts(torch.tensor([5, 5, 0, 0]), torch.tensor([20, 21, 7, 8]))
    assert a[1].source == b[0].source and a[0].source == b[1].source
    assert a[0].source != a[2].source
    assert request_runs(a, 3)[1].source is None  # cut at 3
    assert request_runs(a, 4)[1].source == a[1].source  # whole
    whole = request_runs(a, 9)
    assert whole[1].source == a[1].source and whole[2] == (4, 9, 0, None)  # merged with its own
    layout = KeyRuns.build([[(0, 2, 0), (2, 5, 5)], [], [(0, 3, 0)]], "cpu")
    assert layout.kv_indptr.tolist() == [0, 2, 5, 8]
    assert layout.owners == [0, 0, 2] and layout.shifts == [0, 5, 0]
    assert layout.runs_of.tolist() == [[0, 1], [3, 3], [2, 3]]  # 3: the padding state
    req_to_token = torch.arange(40).view(4, 10)
    assert layout.kv_indices(req_to_token, torch.tensor([2, 0, 1])).tolist() == [
        20, 21, 22, 23, 24, 10, 11, 12]


@pytest.mark.parametrize("heads", [(H, HKV, D), SMOLLM2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_torch_kernels_equal_rotate_then_attend(seed, heads):
    c = _case(seed, "cpu", torch.float32, heads)
    seg = _backend(c, TorchRunKernels(c["layer"].scaling), "cpu")
    q, out = _decode(c, seg, "cpu", seed)
    torch.testing.assert_close(out, _reference_decode(c, q), atol=2e-5, rtol=1e-4)
    inputs, out = _extend(c, seg, "cpu", seed)
    torch.testing.assert_close(out, _reference_extend(c, inputs), atol=2e-5, rtol=1e-4)


def test_runs_are_grouped_only_when_that_saves_enough_keys():
    """Two requests share a run: grouped when it is most of their keys, not when it is a few
    keys beside long runs of their own (``SHARED_KEYS_MAX``)."""
    from sglang_pic.position_free.key_runs import Run

    big = [[Run(0, 90, 5, b"doc"), Run(90, 100, 0)], [Run(0, 90, 9, b"doc"), Run(90, 95, 0)]]
    assert KeyRuns.build(big, "cpu").shared_groups() == [[0, 2], [1], [3]]
    small = [[Run(0, 4, 5, b"doc"), Run(4, 100, 0)], [Run(0, 4, 9, b"doc"), Run(4, 95, 0)]]
    assert KeyRuns.build(small, "cpu").shared_groups() is None
    assert KeyRuns.build([[Run(0, 9, 0)], [Run(0, 9, 0)]], "cpu").shared_groups() is None


def _shared_case(seed: int, device: str, dtype: torch.dtype,
                 heads: tuple[int, int, int] = (H, HKV, D)):
    """Five requests over two cached documents and two system prompts, in ``_case``'s layout:
    a document read where it was computed by one request and moved by others, in other
    orders, after another system prompt; one request the same as another. Runs of different
    requests read the same slots."""
    h, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    positions = 2048
    cos_sin = _cos_sin(positions, d)
    s, s2, m1, m2 = 23, 41, 57, 36
    perm = torch.randperm(900, generator=g)
    parts, at = {}, 0
    for name, n in (("sys", s), ("sys2", s2), ("d1", m1), ("d2", m2)):
        parts[name] = perm[at : at + n]
        at += n
    stored = torch.zeros(900, dtype=torch.long)
    stored[parts["sys"]] = torch.arange(s)
    stored[parts["sys2"]] = torch.arange(s2)
    stored[parts["d1"]] = torch.arange(s, s + m1)  # each document computed after "sys"
    stored[parts["d2"]] = torch.arange(s, s + m2)
    layouts = [("sys", "d1", "d2"), ("sys", "d2", "d1"), ("sys2", "d1"), ("sys", "d1", "d2"),
               ("sys2", "d2", "d1")]
    tails = [int(x) for x in torch.randint(1, 9, (len(layouts),), generator=g)]
    rows, runs, lengths = [], [], []
    for names, tail in zip(layouts, tails, strict=True):
        prefix = torch.cat([parts[n] for n in names])
        own = perm[at : at + tail]
        at += tail
        stored[own] = torch.arange(len(prefix), len(prefix) + tail)
        shift = torch.arange(len(prefix)) - stored[prefix]
        rows.append(torch.cat((prefix, own)))
        runs.append(runs_from_shifts(shift, prefix))
        lengths.append(len(prefix) + tail)
    raw = torch.randn(900, hkv, d, generator=g)
    v = torch.randn(900, hkv, d, generator=g)
    return _pool_case(raw, v, stored, rows, runs, lengths, cos_sin, heads, device, dtype,
                      table_rows=len(layouts))


@pytest.mark.parametrize("heads", [(H, HKV, D), SMOLLM2])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_decode_step_reads_runs_of_the_same_slots_once(seed, heads):
    """Runs reading the same slots (a document after the same system prompt, a document moved
    by different distances) are one request of the paged kernel, a query row each; the output
    is still rotate-then-attend's."""
    c = _shared_case(seed, "cpu", torch.float32, heads)
    seg = _backend(c, TorchRunKernels(c["layer"].scaling), "cpu")
    q, out = _decode(c, seg, "cpu", seed)
    assert seg.grouped
    qo, kv_indptr, _ = seg.kernels._paged
    per_request = [request_runs(r, n) for r, n in zip(c["runs"], c["lengths"], strict=True)]
    assert len(kv_indptr) - 1 < sum(len(r) for r in per_request)  # fewer groups than runs
    assert qo[-1] == sum(len(r) for r in per_request)  # a query row per run
    torch.testing.assert_close(out, _reference_decode(c, q), atol=2e-5, rtol=1e-4)


def test_span_group_shared_runs_off_reads_each_requests_runs_on_their_own(monkeypatch):
    """``--span-group-shared-runs off``: the same step plans one row per run over the batch
    decode kernel, with the same output."""
    monkeypatch.setenv("SGLANG_PIC_SPAN_GROUPS", "off")
    c = _shared_case(0, "cpu", torch.float32, (H, HKV, D))
    seg = _backend(c, TorchRunKernels(c["layer"].scaling), "cpu")
    q, out = _decode(c, seg, "cpu", 0)
    assert not seg.grouped and seg.kernels._paged is None
    torch.testing.assert_close(out, _reference_decode(c, q), atol=2e-5, rtol=1e-4)
    monkeypatch.setenv("SGLANG_PIC_SPAN_GROUPS", "sometimes")
    with pytest.raises(ValueError, match="SGLANG_PIC_SPAN_GROUPS.*--span-group-shared-runs"):
        _backend(c, TorchRunKernels(c["layer"].scaling), "cpu")


def test_a_wrong_turn_is_caught():
    """The reference is sensitive to the turn: keys read unturned give another output."""
    c = _case(0, "cpu", torch.float32)
    seg = _backend(c, TorchRunKernels(D ** -0.5), "cpu")
    c_wrong = dict(c, runs=[((0, n, 0),) for n in c["lengths"]])
    q, out = _decode(c_wrong, seg, "cpu", 0)
    assert (out - _reference_decode(c, q)).abs().max() > 1e-2


def test_turn_in_row_blocks_equals_one_pass(monkeypatch):
    from sglang_pic.position_free import run_kernels

    g = torch.Generator().manual_seed(5)
    q = torch.randn(50, H, D, generator=g)
    rows = torch.randint(0, 50, (333,), generator=g)
    table = run_kernels.turn_table(torch.randint(-40, 40, (333,), generator=g), _cos_sin(64, D))
    whole = run_kernels.turn(q, rows, table)
    monkeypatch.setattr(run_kernels, "TURN_ROWS", 7)
    torch.testing.assert_close(run_kernels.turn(q, rows, table), whole, rtol=0, atol=0)


def test_a_graph_of_a_shifted_batch_without_span_graphs_is_refused():
    """Without --position-free-span-graphs no segmented step was captured: a replay that reached
    segmented attention would run the dense kernels captured on stale metadata, so it raises."""
    seg = SegmentedAttention.__new__(SegmentedAttention)
    seg.graphs = None
    with pytest.raises(RuntimeError, match="without --position-free-span-graphs"):
        seg.init_forward_metadata_out_graph(None)
    with pytest.raises(RuntimeError, match="without --position-free-span-graphs"):
        seg.init_forward_metadata_in_graph(None)
    assert not seg.graph_fits()


def _graph_decode(c, seg, device, seed, bs):
    """``_decode``'s step through a captured step of batch size ``bs`` (SGLang pads the batch
    with requests of no runs, their pool row 0): capture, then plan the replay, then run."""
    n = len(c["lengths"])
    seg.init_cuda_graph_state(max_bs=bs + 3, max_num_tokens=bs + 3)
    capture = types.SimpleNamespace(batch_size=bs, forward_mode=_mode(True), out_cache_loc=None)
    seg.init_forward_metadata_out_graph(capture, in_capture=True)
    g = torch.Generator().manual_seed(seed + 1)
    h, _, d = c["heads"]
    q_raw = torch.randn(n, h, d, generator=g).to(device)
    q = turn_keys(q_raw, torch.tensor(c["lengths"], device=device), c["cos_sin"])
    shifted_batches._runs = [request_runs(r, ln) for r, ln in zip(c["runs"], c["lengths"], strict=True)]
    pool = torch.zeros(bs, dtype=torch.long, device=device)
    pool[:n] = torch.arange(n)
    view = types.SimpleNamespace(batch_size=bs, req_pool_indices=pool, forward_mode=_mode(True),
                                 out_cache_loc=None)
    seg.init_forward_metadata_out_graph(view)
    seg.init_forward_metadata_in_graph(view)
    q_padded = torch.cat((q, q.new_zeros(bs - n, h, d)))
    out = seg.forward_decode(q_padded.to(c["k"].dtype), None, None, c["layer"], view)
    return q, out.view(bs, h, d)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("groups", ["auto", "off"])
def test_a_captured_decode_step_gives_the_eager_output(shared, groups, monkeypatch):
    """The padded layout a captured step replays (``segmented_graphs``): every run a query row
    of a fixed ``bs x S`` block, the step's groups then empty ones, the merge over ``[bs, S]``.
    Its output is rotate-then-attend's for the real requests and zero for SGLang's padding."""
    monkeypatch.setenv("SGLANG_PIC_SPAN_GROUPS", groups)
    c = (_shared_case if shared else _case)(0, "cpu", torch.float32)
    n = len(c["lengths"])
    seg = _backend(c, TorchRunKernels(c["layer"].scaling), "cpu")
    q, out = _graph_decode(c, seg, "cpu", 0, bs=n + 2)
    assert seg.graph_fits()
    torch.testing.assert_close(out[:n], _reference_decode(c, q), atol=2e-5, rtol=1e-4)
    assert not out[n:].any()
    qo, kv_indptr, _ = seg.active._paged
    assert len(qo) == (n + 2) * seg.runs_per_request + 1  # the captured batch of groups
    runs = sum(len(request_runs(r, ln)) for r, ln in zip(c["runs"], c["lengths"], strict=True))
    assert qo[-1] == runs and int(seg.count) == runs
    real_groups = sum(1 for a, b in zip(qo[:-1], qo[1:], strict=True) if b > a)
    assert (real_groups < runs) == (shared and groups == "auto")


def test_a_step_with_more_runs_than_a_graph_holds_runs_eagerly(monkeypatch):
    """``--span-graph-runs`` bounds a request's runs in a captured step: a step past it does
    not fit (the graph guard then runs it eagerly), and a replay of it is refused."""
    monkeypatch.setenv("SGLANG_PIC_SPAN_GRAPH_RUNS", "2")
    c = _case(0, "cpu", torch.float32)  # request 0 has three runs
    seg = _backend(c, TorchRunKernels(c["layer"].scaling), "cpu")
    assert seg.runs_per_request == 2
    with pytest.raises(RuntimeError, match="does not fit"):
        _graph_decode(c, seg, "cpu", 0, bs=4)
    assert not seg.graph_fits()
    monkeypatch.setenv("SGLANG_PIC_SPAN_GRAPH_RUNS", "0")
    with pytest.raises(ValueError, match="SGLANG_PIC_SPAN_GRAPH_RUNS.*--span-graph-runs"):
        _backend(c, TorchRunKernels(c["layer"].scaling), "cpu")


def test_the_graph_guard_sees_pic_flashinfer_inside_a_hybrid_backend():
    """Different prefill and decode backends: SGLang wraps them in HybridAttnBackend; the decode
    runner's graphs hold the decode backend's kernels, the prefill runner's the prefill one's."""
    from sglang_pic.position_free import span_graphs
    from sglang_pic.position_free.backends import PositionFreeFlashInferBackend

    twin = PositionFreeFlashInferBackend.__new__(PositionFreeFlashInferBackend)
    other = object()
    decode_cls, prefill_cls = span_graphs._types()[1], object
    hybrid = types.SimpleNamespace(decode_backend=twin, prefill_backend=other)

    def runner(cls):
        r = cls.__new__(cls)
        r.model_runner = types.SimpleNamespace(attn_backend=hybrid)
        return r

    assert span_graphs._flashinfer_twin(runner(decode_cls)) is twin
    assert span_graphs._flashinfer_twin(runner(type("Prefill", (prefill_cls,), {}))) is None
    hybrid.prefill_backend, hybrid.decode_backend = twin, other
    assert span_graphs._flashinfer_twin(runner(type("Prefill", (prefill_cls,), {}))) is twin


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(H, HKV, D), SMOLLM2])
@pytest.mark.parametrize("seed", [0, 1])
def test_flashinfer_kernels_equal_torch_kernels(seed, heads):
    from sglang_pic.position_free.run_kernels import FlashInferRunKernels

    c = _case(seed, "cuda", torch.bfloat16, heads)
    h, hkv, d = heads
    scale = c["layer"].scaling
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    for use_tensor_cores in (False, True):
        fi = _backend(c, FlashInferRunKernels(workspace, h, hkv, d, torch.bfloat16,
                                              torch.bfloat16, scale, use_tensor_cores), "cuda")
        ref = _backend(c, TorchRunKernels(scale), "cuda")
        q, out = _decode(c, fi, "cuda", seed)
        _, expected = _decode(c, ref, "cuda", seed)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out.float(), _reference_decode(c, q.float()), atol=3e-2,
                                   rtol=3e-2)
        inputs, out = _extend(c, fi, "cuda", seed)
        torch.testing.assert_close(out.float(), _reference_extend(c, inputs), atol=3e-2,
                                   rtol=3e-2)


def _flashinfer_and_torch(c: dict) -> tuple[SegmentedAttention, SegmentedAttention]:
    """Segmented attention over case ``c``'s pool on FlashInfer's kernels (tensor-core decode,
    a workspace of its own) and on the torch kernels, on the GPU."""
    from sglang_pic.position_free.run_kernels import FlashInferRunKernels

    h, hkv, d = c["heads"]
    scale = c["layer"].scaling
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    fi = _backend(c, FlashInferRunKernels(workspace, h, hkv, d, torch.bfloat16, torch.bfloat16,
                                          scale, True), "cuda")
    return fi, _backend(c, TorchRunKernels(scale), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(H, HKV, D), SMOLLM2])
@pytest.mark.parametrize("seed", [0, 1])
def test_flashinfer_reads_runs_of_the_same_slots_once_as_torch_does(seed, heads):
    """The grouped decode step (the paged prefill kernel, a query row per run) on FlashInfer
    against the torch kernels and rotate-then-attend."""
    c = _shared_case(seed, "cuda", torch.bfloat16, heads)
    fi, ref = _flashinfer_and_torch(c)
    q, out = _decode(c, fi, "cuda", seed)
    _, expected = _decode(c, ref, "cuda", seed)
    assert fi.grouped and ref.grouped
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), _reference_decode(c, q.float()), atol=3e-2,
                               rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(H, HKV, D), SMOLLM2])
def test_each_flashinfer_call_gives_the_torch_outputs_and_base_2_log_sum_exps(heads):
    """Each of the three calls alone (ragged causal, paged over runs, decode), output and
    log-sum-exp against the torch kernels: a merge weighs states by their log-sum-exps, so
    two calls whose log-sum-exps differ in base or layout merge wrongly although each output
    is right."""
    from sglang_pic.position_free.run_kernels import FlashInferRunKernels

    h, hkv, d = heads
    g = torch.Generator().manual_seed(3)
    scale = d ** -0.5
    k_pool = torch.randn(300, hkv, d, generator=g).to("cuda", torch.bfloat16)
    v_pool = torch.randn(300, hkv, d, generator=g).to("cuda", torch.bfloat16)
    new = [37, 5, 120]
    qo = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qo[-1]), h, d, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(int(qo[-1]), hkv, d, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(int(qo[-1]), hkv, d, generator=g).to("cuda", torch.bfloat16)
    run_kv = torch.tensor([0, 50, 130, 131, 250], dtype=torch.int32)  # 4 runs over the pool
    run_qo = torch.tensor([0, 37, 74, 79, 199], dtype=torch.int32)  # rows of requests 0,0,1,2
    kv_idx = torch.randperm(300, generator=g)[:250].to("cuda", torch.int32)
    rows = torch.cat((torch.arange(0, 37), torch.arange(0, 37), torch.arange(37, 42),
                      torch.arange(42, 162))).to("cuda")
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    fi = FlashInferRunKernels(workspace, h, hkv, d, torch.bfloat16, torch.bfloat16, scale, False)
    ref = TorchRunKernels(scale)
    for kern in (fi, ref):
        kern.plan_extend(qo, run_qo, run_kv, kv_idx)
    calls = {
        "ragged": lambda kern: kern.ragged(q, k, v),
        "paged": lambda kern: kern.paged(q[rows], (k_pool, v_pool)),
    }
    for name, call in calls.items():
        (o1, l1), (o2, l2) = call(fi), call(ref)
        torch.testing.assert_close(o1.float(), o2.float(), atol=2e-2, rtol=2e-2, msg=name)
        torch.testing.assert_close(l1.float(), l2.float(), atol=2e-2, rtol=1e-3, msg=name)
    for kern in (fi, ref):
        kern.plan_decode(run_kv, kv_idx)
    (o1, l1), (o2, l2) = fi.decode(q[:4], (k_pool, v_pool)), ref.decode(q[:4], (k_pool, v_pool))
    torch.testing.assert_close(o1.float(), o2.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(l1.float(), l2.float(), atol=2e-2, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(H, HKV, D), SMOLLM2])
@pytest.mark.parametrize("shared", [False, True])
def test_a_flashinfer_decode_step_replayed_from_a_cuda_graph_gives_the_eager_output(shared,
                                                                                     heads):
    """A segmented decode step captured once in a CUDA graph (FlashInfer's paged prefill in
    graph mode, the Triton turn and merge) and replayed for two different steps: each gives the
    torch kernels' eager output and rotate-then-attend's, and zero for the padding requests."""
    c = (_shared_case if shared else _case)(1, "cuda", torch.bfloat16, heads)
    h, _, d = heads
    seg, ref = _flashinfer_and_torch(c)
    n = len(c["lengths"])
    bs = n + 3
    seg.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    fb = types.SimpleNamespace(batch_size=bs, forward_mode=_mode(True), out_cache_loc=None,
                               req_pool_indices=torch.zeros(bs, dtype=torch.long, device="cuda"))
    seg.init_forward_metadata_out_graph(fb, in_capture=True)
    q_in = torch.zeros(bs, h * d, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
        seg.forward_decode(q_in, None, None, c["layer"], fb)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = seg.forward_decode(q_in, None, None, c["layer"], fb)
    for served in (n, n - 1):  # two steps replayed from the one graph
        case = dict(c, lengths=c["lengths"][:served], runs=c["runs"][:served],
                    rows=c["rows"][:served])
        q, expected = _decode(case, ref, "cuda", served)
        fb.req_pool_indices.zero_()
        fb.req_pool_indices[:served] = torch.arange(served)
        seg.init_forward_metadata_out_graph(fb)
        q_in.zero_()
        q_in[:served] = q.view(served, -1).to(torch.bfloat16)
        graph.replay()
        torch.cuda.synchronize()
        got = out.view(bs, h, d)
        torch.testing.assert_close(got[:served].float(), expected.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got[:served].float(), _reference_decode(case, q.float()),
                                   atol=3e-2, rtol=3e-2)
        assert not got[served:].any()
