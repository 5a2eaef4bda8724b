"""Sparse decoding inside SGLang, below the server: ``SparseDecodeState`` over a stand-in KV pool.

Both index implementations run here: ``TorchIndexOps`` (the CPU engine's) and
``KernelIndexOps`` (the Triton kernels; under TRITON_INTERPRET=1 on CPU, at tiny shapes). What
must hold: with every key of the retrieval region selectable, sparse attention equals dense
attention over the whole context; windows slide into the retrieval region in ``update`` steps;
slots follow requests (released by an extend batch of another request, reused when full).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from sglang_pic.sparse.config import SparseDecodeConfig, SparseDecodeUnsupported
from sglang_pic.sparse.decode_state import SparseDecodeState
from sglang_pic.sparse.index_ops import KernelIndexOps, TorchIndexOps, indexed_attention
from sglang_pic.sparse.offload import HostKVRegion, PoolSlotRelease

HQ, HKV, D, LAYERS = 4, 2, 64, 2
POOL, MAX_CTX = 4096, 1024
# the kernels run on the GPU when there is one, else under the Triton interpreter on CPU
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = [(TorchIndexOps, "cpu"),
       pytest.param(KernelIndexOps, KERNEL_DEVICE, marks=pytest.mark.kernels)]
OPS_GPU_KERNELS = [(TorchIndexOps, "cpu"), pytest.param(
    KernelIndexOps, "cuda", marks=[pytest.mark.kernels, pytest.mark.skipif(
        KERNEL_DEVICE != "cuda", reason="the kernels on a GPU only: ~30 s each under the "
        "interpreter, and test/kernels/test_pariskv.py checks on CPU what they do here (a kept "
        "selection or vote moved on, regions read through the slot table)")])]
"""For the tests whose many decode steps make the interpreted kernels slow: the index logic
runs on CPU with ``TorchIndexOps``, the kernels on the device (``make test-gpu``)."""


class FakePool:
    """SGLang's KV pool as the state sees it: per layer ``[slots, kv_heads, D]`` buffers, and
    ``req_to_token`` mapping each request's positions to slots (shuffled, like a real pool)."""

    def __init__(self, requests: int, seed: int = 0, device: str = "cpu"):
        g = torch.Generator().manual_seed(seed)
        self.k = [torch.randn(POOL, HKV, D, generator=g).to(device) for _ in range(LAYERS)]
        self.v = [torch.randn(POOL, HKV, D, generator=g).to(device) for _ in range(LAYERS)]
        perm = torch.randperm(POOL - 1, generator=g) + 1
        self.req_to_token = perm[: requests * MAX_CTX].view(requests, MAX_CTX).int().to(device)
        self.device = device

    def dense(self, layer: int, q: torch.Tensor, pool_index: int, n: int) -> torch.Tensor:
        idx = self.req_to_token[pool_index, :n].long()[None, None].expand(1, HKV, n).int()
        return indexed_attention(q[None], self.k[layer], self.v[layer], idx, 1 / math.sqrt(D))[0]


def make_state(pool: FakePool, ops_cls, **cfg) -> SparseDecodeState:
    dev = pool.device
    cfg = SparseDecodeConfig(**{"threshold": 200, "topk": 8, "candidates": 64, "sink": 4,
                                "local": 32, "update": 16, "max_requests": 2, **cfg})
    cfg.validate()
    capacity = MAX_CTX - cfg.sink - cfg.local
    ops = ops_cls(LAYERS, cfg.max_requests, HQ, HKV, D, capacity, cfg.topk, cfg.candidates,
                  cfg.attended, dev, rerank_between=cfg.vote_interval > 1)
    state = SparseDecodeState(cfg, ops, layer_ids=list(range(LAYERS)), q_heads=HQ,
                              kv_heads=HKV, head_dim=D, capacity=capacity, max_batch=8,
                              req_to_token=pool.req_to_token, device=dev, dtype=torch.float32)
    state.key_buffer = lambda layer: pool.k[layer]
    state.value_buffer = lambda layer: pool.v[layer]
    return state


def step(state, pool_indices, lens):
    return state.prepare_decode(pool_indices, lens, torch.tensor(lens, device=state.n_ret.device))


@pytest.mark.parametrize("ops_cls,device", OPS)
def test_sparse_rows_equal_dense_when_every_key_is_selectable(ops_cls, device):
    pool = FakePool(3, device=device)
    # topk and candidates cover the whole retrieval region: the selection is everything
    state = make_state(pool, ops_cls, topk=512, candidates=512, max_context=MAX_CTX)
    # what the GPU backend runs before CUDA-graph capture: no slot, so no output row is written
    q0 = torch.randn(1, HQ, D, device=device)
    o0 = q0.clone()
    state.attend(0, q0, o0, 1.0)
    assert torch.equal(o0, q0) and not state.active
    state.warm_up()
    lens = [300, 40, 420]  # rows 0 and 2 are long, row 1 short
    dense_lens = step(state, [0, 1, 2], lens)
    assert dense_lens.tolist() == [1, 40, 1] and state.active
    assert state.slots[0].n_ret == 300 - 4 - 32 and state.slots[1].n_ret == 420 - 4 - 32
    q = torch.randn(3, HQ, D, device=device)
    for layer in range(LAYERS):
        o = torch.full((3, HQ, D), 7.0, device=device)
        state.attend(layer, q, o, 1 / math.sqrt(D))
        for row in (0, 2):
            # on a GPU the kernels' fp32 dots run in TF32 (~1e-3 relative)
            tol = dict(atol=2e-3, rtol=1e-2) if device == "cuda" else dict(atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(o[row], pool.dense(layer, q[row], row, lens[row]), **tol)
        assert torch.equal(o[1], torch.full((HQ, D), 7.0, device=device))  # dense rows are left alone


@pytest.mark.parametrize("ops_cls,device", OPS)
def test_retrieval_finds_planted_keys_and_attention_tracks_dense(ops_cls, device):
    """A query aligned with 8 planted keys per KV head: they are retrieved."""
    pool = FakePool(1, seed=1, device=device)
    state = make_state(pool, ops_cls, topk=8)
    n = 600
    # a seeded query: the global generator's state depends on which tests ran before in this
    # worker (pytest-xdist), and some draws put the dense output far from the planted keys
    q = torch.randn(HQ, D, generator=torch.Generator().manual_seed(0)).to(device)
    planted = torch.arange(100, 500, 50, device=device)  # positions inside the retrieval region
    for layer in range(LAYERS):
        for h in range(HKV):
            qk = q.view(HKV, HQ // HKV, D)[h].sum(0)
            locs = pool.req_to_token[0, planted].long()
            pool.k[layer][locs, h] = 4 * qk / qk.norm() * math.sqrt(D) ** 0.5
    step(state, [0], [n])
    o = torch.zeros(1, HQ, D, device=device)
    state.attend(0, q[None], o, 1 / math.sqrt(D))
    picked = pool.req_to_token[0][state.selected[0].long() + 4]  # selected rows' pool slots
    want = pool.req_to_token[0, planted].int()
    for h in range(HKV):
        assert set(want.tolist()) <= set(picked[h].tolist())
    rel = (o[0] - pool.dense(0, q, 0, n)).norm() / pool.dense(0, q, 0, n).norm()
    assert rel < 0.2


class FakeAllocator:
    """SGLang's token allocator as ``offload.PoolSlotRelease`` sees it: ``free`` only."""

    def __init__(self):
        self.freed: list[int] = []

    def free(self, free_index: torch.Tensor) -> None:
        self.freed += free_index.tolist()


def offloaded(state: SparseDecodeState, pool: FakePool) -> FakeAllocator:
    alloc = FakeAllocator()
    host = HostKVRegion(LAYERS, state.cfg.max_requests, HKV, state.capacity, D,
                        pool.k[0].dtype, pin=pool.device == "cuda")  # the GPU reads it mapped
    state.enable_offload(host, PoolSlotRelease(alloc, pool.req_to_token), pool.k[0].dtype)
    return alloc


@pytest.mark.parametrize("ops_cls,device", OPS_GPU_KERNELS)
def test_offloaded_regions_attend_as_in_the_pool_and_give_their_slots_back(ops_cls, device):
    """``--sparse-offload``: the same attention as with the region in the pool (and, with every
    key selectable, as dense attention), while the region's pool slots are freed exactly once,
    its ``req_to_token`` entries point at the padding slot and SGLang's frees skip that slot."""
    pools = [FakePool(3, device=device) for _ in range(2)]  # same seed: the same KV and slots
    original = pools[0].req_to_token.clone()
    kw = dict(topk=512, candidates=512, max_context=MAX_CTX)
    in_pool, host = make_state(pools[0], ops_cls, **kw), make_state(pools[1], ops_cls, **kw)
    alloc = offloaded(host, pools[1])
    host.warm_up()
    tol = dict(atol=2e-3, rtol=1e-2) if device == "cuda" else dict(atol=2e-5, rtol=1e-4)
    lens = [300, 40, 420]
    for t in range(20):  # the windows (32) pass 32 + 16 at t = 17: 16 more tokens move out
        now = [n + t if n > 200 else n for n in lens]
        for state in (in_pool, host):
            assert step(state, [0, 1, 2], now).tolist() == [1, now[1], 1]
        if t not in (0, 19):  # attend before and after the slide (slow under the interpreter)
            continue
        q = torch.randn(3, HQ, D, device=device)
        for layer in range(LAYERS):
            outs = []
            for state in (in_pool, host):
                o = torch.full((3, HQ, D), 7.0, device=device)
                state.attend(layer, q, o, 1 / math.sqrt(D))
                outs.append(o)
            torch.testing.assert_close(outs[1], outs[0], **tol)
            assert torch.equal(outs[1][1], torch.full((HQ, D), 7.0, device=device))
            for row in (0, 2):
                torch.testing.assert_close(outs[1][row],
                                           pools[0].dense(layer, q[row], row, now[row]), **tol)
    n_ret = [host.slots[0].n_ret, host.slots[1].n_ret]
    assert n_ret == [300 - 36 + 16, 420 - 36 + 16]
    want = sorted(original[0, 4 : 4 + n_ret[0]].tolist() + original[2, 4 : 4 + n_ret[1]].tolist())
    assert sorted(alloc.freed) == want  # each region slot freed once, nothing else
    assert host.stats["offloaded_tokens"] == len(want)
    r2t = pools[1].req_to_token
    assert (r2t[0, 4 : 4 + n_ret[0]] == 0).all() and (r2t[2, 4 : 4 + n_ret[1]] == 0).all()
    assert torch.equal(r2t[1], original[1]) and torch.equal(r2t[0, :4], original[0, :4])
    # SGLang frees a finished request's whole row: the padding slot is kept out of the free list
    alloc.freed.clear()
    alloc.free(r2t[0, : 300 + 19])  # the wrapped free, as ChunkCache.cache_finished_req calls it
    assert 0 not in alloc.freed and len(alloc.freed) == 300 + 19 - n_ret[0]


def test_window_slides_in_update_steps_and_idx_lists_sink_selected_window():
    pool = FakePool(1)
    state = make_state(pool, TorchIndexOps)
    n = 300
    step(state, [0], [n])
    slot = state.slots[0]
    assert slot.n_ret == n - 4 - 32
    for t in range(1, 40):  # the window (32) passes 32 + 16 at t = 17 and again at t = 33
        step(state, [0], [n + t])
    assert slot.n_ret == n - 4 - 32 + 2 * 16
    assert state.stats["encoded_tokens"] == (n - 36) + 2 * 16
    idx = state.win_idx[0, : int(state.win_len[0])].tolist()
    r2t = pool.req_to_token[0].tolist()
    assert idx[:4] == r2t[:4]  # sink
    window = idx[4:]
    assert window == r2t[4 + slot.n_ret : n + 39]  # the window: what the region does not hold
    assert len(window) == n + 39 - 4 - slot.n_ret <= 32 + 16
    assert state.ops.index[0][0].n == slot.n_ret  # each layer's index grew with the region


class _ScalarStores(torch.overrides.TorchFunctionMode):
    """Records ``t[i] = number`` into one element of a tensor: on a CUDA tensor that is a copy
    from pageable host memory, which waits for every queued kernel."""

    def __init__(self, host_buffers: list[torch.Tensor]):
        super().__init__()
        self.host = {t.data_ptr() for t in host_buffers}  # host staging: stores are free
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__setitem__:
            target, index, value = args
            one = isinstance(index, int) or (isinstance(index, tuple)
                                              and all(isinstance(i, int) for i in index))
            if (one and isinstance(value, (int, float, bool))
                    and target.data_ptr() not in self.host):
                self.seen.append((tuple(target.shape), index, value))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ops_cls,device", OPS)
def test_decode_bookkeeping_never_waits_for_the_gpu(ops_cls, device):
    """Activation, window slides and slot release write the per-slot GPU tables without
    waiting for queued kernels (on the H200 one such store stalled every 128K step ~6 ms on
    the previous one, idling the GPU ~0.9 ms a step while the CPU then prepared this one).
    On CPU: no Python number is stored into a single tensor element; on a GPU: no synchronising
    call at all (CUDA's sync debug mode raises)."""
    pool = FakePool(2, device=device)
    state = make_state(pool, ops_cls, max_context=MAX_CTX)
    state.warm_up()
    lens = torch.tensor([300, 40], device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with _ScalarStores(list(state._staging)) as stores:
            state.prepare_decode([0, 1], [300, 40], lens)  # activation
            for t in range(1, 20):  # a slide at t = 17
                state.prepare_decode([0, 1], [300 + t, 40 + t], lens)
            state.prepare_decode([1], [60], lens[1:])  # request 0 left: its slot stays held
            state.note_extend([0], ["b"], [0], [250])  # its row serves another request
            if device == "cuda":  # what the kept region shares with it is read once (a wait)
                torch.cuda.set_sync_debug_mode(0)
            state.prepare_decode([0, 1], [251, 61], lens)  # released, then taken again
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    # the new request at row 0 holds the same keys here: the kept region's first rows serve it
    assert state.stats["reused_tokens"] == 251 - 36 and state.slots[0].n_ret == 251 - 36
    assert stores.seen == []


def _sparse_output(state, q: torch.Tensor, row_of: dict[int, int]) -> list[torch.Tensor]:
    """Each layer's sparse output rows and selected retrieval rows for the batch ``q``."""
    out = []
    for layer in range(LAYERS):
        o = torch.zeros_like(q)
        state.attend(layer, q, o, 1 / math.sqrt(D))
        sel = state.selected.clone()
        out.append((o, {row: set(sel[k].flatten().tolist()) for row, k in row_of.items()}))
    return out


@pytest.mark.parametrize("first,second,shared", [(300, 420, 300), (420, 300, 300),
                                                 (420, 400, 250)])
@pytest.mark.parametrize("ops_cls,device", OPS)
def test_the_next_turn_on_a_cached_prefix_encodes_only_its_new_tokens(ops_cls, device, first,
                                                                       second, shared):
    """A request whose first ``shared`` positions are a finished request's (the radix cache's
    pool slots: the next turn of a conversation, or another question on the same document)
    takes that request's slot and encodes only the region rows past what they share (a longer
    region keeps its first rows); it then selects and attends exactly as a state that encoded
    it from scratch."""
    pool = FakePool(3, device=device)
    state = make_state(pool, ops_cls, max_context=MAX_CTX)
    step(state, [0], [first])  # the first request's region: first - 4 - 32 rows
    assert state.stats["encoded_tokens"] == first - 36
    pool.req_to_token[1, :shared] = pool.req_to_token[0, :shared]  # the same prefix
    step(state, [1], [second])  # the first request has finished: its slot is not decoding
    reused = min(shared - 4, first - 36, second - 36)  # rows of the shared positions
    assert state.stats["reused_tokens"] == reused
    assert state.stats["encoded_tokens"] == first - 36 + (second - 36 - reused)
    assert state.slots[0].pool_index == 1 and state.slots[0].n_ret == second - 36
    fresh = make_state(pool, ops_cls, max_context=MAX_CTX)
    step(fresh, [1], [second])
    assert fresh.stats["reused_tokens"] == 0 and fresh.slots[0].n_ret == second - 36
    if ops_cls is KernelIndexOps:  # the votes' histogram range: counts of exactly these rows
        assert torch.equal(state.ops.bit_counts[:, 0], fresh.ops.bit_counts[:, 0])
    q = torch.randn(1, HQ, D, device=device)
    for (o, sel), (o_ref, sel_ref) in zip(_sparse_output(state, q, {0: 0}),
                                          _sparse_output(fresh, q, {0: 0}), strict=True):
        assert sel == sel_ref
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ops_cls,device", OPS)
def test_a_region_is_reused_only_up_to_rewritten_keys_and_not_from_a_decoding_request(
        ops_cls, device):
    """The same pool slots holding other keys since (freed and rewritten by another token) end
    what is shared: rows from the first such position on are encoded again, and the request
    still selects and attends as from scratch. A slot whose request still decodes is not
    taken from it."""
    pool = FakePool(3, device=device)
    state = make_state(pool, ops_cls, max_context=MAX_CTX)
    step(state, [0], [300])
    pool.req_to_token[1, :300] = pool.req_to_token[0, :300]
    step(state, [0, 1], [301, 420])  # the first request still decodes: the new one takes slot 1
    assert state.stats["reused_tokens"] == 0 and state.slots[1].n_ret == 384
    state = make_state(pool, ops_cls, max_context=MAX_CTX)
    step(state, [0], [300])
    layer0 = pool.k[0]
    slot_200 = pool.req_to_token[0, 200].long()
    saved = layer0[slot_200].clone()
    layer0[slot_200] += 1.0  # position 200's pool slot rewritten by another token
    try:
        step(state, [1], [420])
        fresh = make_state(pool, ops_cls, max_context=MAX_CTX)
        step(fresh, [1], [420])
        q = torch.randn(1, HQ, D, device=device)
        for (o, sel), (o_ref, sel_ref) in zip(_sparse_output(state, q, {0: 0}),
                                              _sparse_output(fresh, q, {0: 0}), strict=True):
            assert sel == sel_ref
            torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    finally:
        layer0[slot_200] = saved
    assert state.stats["reused_tokens"] == 200 - 4  # the rows before position 200
    assert state.stats["encoded_tokens"] == 264 + 384 - 196


def test_slots_follow_requests():
    pool = FakePool(3)
    state = make_state(pool, TorchIndexOps, max_requests=1)
    state.note_extend([0], ["a"], [0], [300], )
    step(state, [0], [301])
    assert state.slots[0].rid == "a"
    # a second long request while the only slot is busy: it decodes densely, counted
    assert step(state, [0, 1], [302, 400]).tolist() == [1, 400]
    assert state.stats["refused_full"] == 1
    # a mixed batch carries request a's next token densely: a keeps its slot
    state.note_extend([0], ["a"], [302], [1])
    assert state.slots[0] is not None and state.slots[0].seq_len == 303
    step(state, [0], [304])
    # request a finished; its pool index is prefilled for request b: the slot is released
    state.note_extend([0], ["b"], [0], [350])
    assert state.slots[0] is None and not state.n_ret.any() and not state.win_len.any()
    # a long request takes the slot of one that is no longer decoding
    step(state, [2], [500])
    assert state.slots[0].pool_index == 2
    step(state, [1], [401])
    assert state.slots[0].pool_index == 1
    # a length that is not the next step of the known request: not that request, released, and
    # (over the threshold) taken again as a new request of unknown id - whose positions hold the
    # same keys here, so it keeps the first rows of the region instead of encoding them again
    encoded, reused = state.stats["encoded_tokens"], state.stats["reused_tokens"]
    step(state, [1], [300])
    assert state.slots[0] is not None and state.slots[0].seq_len == 300
    assert state.slots[0].rid is None and state.slots[0].n_ret == 300 - 36
    assert state.stats["encoded_tokens"] == encoded
    assert state.stats["reused_tokens"] == reused + 300 - 36
    # an extend batch seen without rids or lengths (a graph runner's view): released, to be safe
    state.note_extend([1], None, None, None)
    assert all(slot is None for slot in state.slots)
    # with lengths but no rid: the continuation of the slot's request keeps it
    step(state, [2], [600])
    state.note_extend([2], None, [600], [1])
    assert state.slots[0] is not None and state.slots[0].seq_len == 601
    # the slot learns its request's id from the first decode batch that names it ...
    state.prepare_decode([2], [602], torch.tensor([602]), rids=["y"])
    assert state.slots[0].rid == "y"
    # ... and a decode batch that names another request at that pool index releases it
    activated = state.stats["activated"]
    assert state.prepare_decode([2], [603], torch.tensor([603]), rids=["z"]).tolist() == [1]
    assert state.slots[0].rid == "z" and state.stats["activated"] == activated + 1


def test_a_context_beyond_the_capacity_decodes_densely_without_taking_a_slot():
    pool = FakePool(2)
    state = make_state(pool, TorchIndexOps, max_requests=1, max_context=MAX_CTX)
    step(state, [0], [300])
    assert state.slots[0].pool_index == 0
    too_long = MAX_CTX  # capacity + sink + local = MAX_CTX - sink - local + sink + local
    assert step(state, [1], [too_long + 1]).tolist() == [too_long + 1]  # dense
    assert state.slots[0].pool_index == 0 and 1 in state.too_long  # request 0 keeps its slot


@pytest.mark.parametrize("bad,message", [
    (dict(threshold=100), "threshold"),
    (dict(topk=0), "topk"),
    (dict(candidates=4, topk=8), "candidates"),
    (dict(candidates=32769), "candidates must be <= 32768"),
    (dict(sink=-1), "sink"),
    (dict(reselect_interval=0), "--sparse-reselect-interval must be >= 1"),
    (dict(reselect_interval=65), "--sparse-reselect-interval must be <= 64"),
    (dict(vote_interval=65), "--sparse-vote-interval must be <= 64"),
    (dict(vote_interval=2, reselect_interval=2), "are alternatives: set one of them"),
])
def test_bad_settings_are_refused(bad, message):
    with pytest.raises(SparseDecodeUnsupported, match=message):
        SparseDecodeConfig(**bad).validate()
    env = {"SGLANG_PIC_SPARSE_TOPK": "many"}
    with pytest.raises(SparseDecodeUnsupported, match="not an integer"):
        SparseDecodeConfig.from_env(env)


def test_the_candidates_bound_is_the_top_k_kernels():
    """The launcher (standard library only) bounds ``--sparse-candidates`` by the top-k kernel's
    packing bound without importing the kernels: the two constants agree."""
    from sglang_pic.sparse.config import MAX_CANDIDATES
    from sglang_pic_kernel.pariskv.select import TOPK_PACKED_MAX_CP

    assert MAX_CANDIDATES == TOPK_PACKED_MAX_CP
    SparseDecodeConfig(candidates=MAX_CANDIDATES).validate()


def test_decode_graphs_are_captured_twice_and_the_sparse_set_replayed_only_when_needed():
    """``graphs``: the AROUND hooks on SGLang's DecodeCudaGraphRunner, on a stand-in runner."""
    from types import SimpleNamespace

    from sglang_pic.sparse import graphs
    from sglang_pic.sparse.backends import ParisKVTritonBackend

    backend = object.__new__(ParisKVTritonBackend)  # no model: only the flags are used

    def deactivate():
        backend.sparse.active = False

    # the last step before a recapture had sparse rows: the capture must not see them
    backend.sparse = SimpleNamespace(active=True, deactivate=deactivate)
    runner = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend))
    keys: list[tuple] = []

    import inspect

    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
        DecodeCudaGraphRunner,
        ShapeKey,
    )

    # SGLang's own method (unwrapped, should a hook have been applied in this process)
    make_key = inspect.unwrap(DecodeCudaGraphRunner._make_graph_key)

    def key(size, stream_idx=None, variant_label=None):
        return ShapeKey(size=size, stream_idx=stream_idx, variant_label=variant_label)

    def capture(self):  # SGLang's capture makes one key per batch size
        keys.append(graphs.around_make_graph_key(make_key, self, 4))

    graphs.around_capture_one_stream(capture, runner)
    assert keys == [key(4), key(4, None, "pariskv")] and not backend.capture_sparse
    assert not backend.capturing and not backend.sparse.active
    assert graphs.around_make_graph_key(make_key, runner, 2) == key(2)
    backend.sparse.active = True  # this step's batch has sparse rows
    assert graphs.around_make_graph_key(make_key, runner, 2) == key(2, None, "pariskv")
    assert graphs.around_make_graph_key(make_key, runner, 2, None, "lora") == key(
        2, None, "lora+pariskv")
    other = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=object()))
    keys.clear()
    graphs.around_capture_one_stream(capture, other)  # not our backend: captured once
    assert keys == [key(4)]


def test_batches_of_only_sparse_rows_replay_a_set_without_the_dense_decode():
    """On a backend that can write the new K/V itself (FlashInfer), a third set is captured,
    ``pariskv-all``, for the batch sizes a batch of at most ``max_requests`` sparse rows is
    padded to; a step replays it when every request row is sparse, else the sparse set."""
    import inspect

    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
        DecodeCudaGraphRunner,
        ShapeKey,
    )
    from sglang_pic.sparse import graphs
    from sglang_pic.sparse.backends import ParisKVFlashInferBackend

    backend = object.__new__(ParisKVFlashInferBackend)
    backend.sparse = SimpleNamespace(active=False, all_rows=False, deactivate=lambda: None,
                                     cfg=SimpleNamespace(max_requests=3))
    runner = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend),
                             capture_bs=[1, 2, 4, 8, 16])
    make_key = inspect.unwrap(DecodeCudaGraphRunner._make_graph_key)
    keys = []

    def capture(self):  # SGLang's loop over the sizes it captures
        keys.extend(graphs.around_make_graph_key(make_key, self, bs) for bs in self.capture_bs)

    graphs.around_capture_one_stream(capture, runner)
    labels = {}
    for k in keys:
        labels.setdefault(k.variant_label, []).append(k.size)
    assert labels == {None: [1, 2, 4, 8, 16], "pariskv": [1, 2, 4, 8, 16],
                      "pariskv-all": [1, 2, 4]}  # 3 rows at most: padded to 4 at most
    assert runner.capture_bs == [1, 2, 4, 8, 16] and not backend.capture_only_sparse

    def replay_key(size, active, all_rows):
        backend.sparse.active, backend.sparse.all_rows = active, all_rows
        return graphs.around_make_graph_key(make_key, runner, size)

    assert replay_key(2, True, True) == ShapeKey(size=2, stream_idx=None,
                                                 variant_label="pariskv-all")
    assert replay_key(2, True, False).variant_label == "pariskv"  # a dense row beside
    assert replay_key(8, True, True).variant_label == "pariskv"  # not captured that large
    assert replay_key(2, False, False).variant_label is None
    # the triton backend cannot skip its decode: no third set
    assert graphs._sparse_backend(runner) is backend
    backend.skips_dense = False
    keys.clear()
    graphs.around_capture_one_stream(capture, runner)
    assert "pariskv-all" not in {k.variant_label for k in keys}
    assert replay_key(2, True, True).variant_label == "pariskv"


def test_a_decode_of_only_sparse_rows_writes_the_kv_and_skips_the_dense_kernel(monkeypatch):
    """``forward_decode`` with every request row sparse: the new K/V go into the pool as the
    backend's decode writes them, its dense attention is not run, and every row's output is the
    sparse attention's. With a dense row beside, the dense decode runs as before."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang_pic.sparse.backends import ParisKVTorchNativeBackend

    pool = FakePool(2)
    backend = object.__new__(ParisKVTorchNativeBackend)
    backend.sparse = state = make_state(pool, TorchIndexOps, max_context=MAX_CTX)
    backend.swa_out_cache_loc = None
    writes = []
    backend.token_to_kv_pool = SimpleNamespace(
        set_kv_buffer=lambda layer, loc, k, v: writes.append((loc.loc, k, v)))
    dense_calls = []

    def dense(self, q, k, v, layer, fb, save_kv_cache=True):
        dense_calls.append(q.shape[0])
        return torch.zeros(q.shape[0], HQ * D)

    monkeypatch.setattr(TorchNativeAttnBackend, "forward_decode", dense)
    layer = SimpleNamespace(tp_q_head_num=HQ, qk_head_dim=D, v_head_dim=D, layer_id=0,
                            scaling=1 / math.sqrt(D))
    q, k, v = torch.randn(2, HQ * D), torch.randn(2, HKV * D), torch.randn(2, HKV * D)
    fb = SimpleNamespace(out_cache_loc=torch.tensor([7, 9]))
    step(state, [0, 1], [300, 400])  # both rows long: all sparse
    assert state.all_rows
    o = backend.forward_decode(q, k, v, layer, fb)
    assert dense_calls == [] and len(writes) == 1 and writes[0][0].tolist() == [7, 9]
    want = torch.zeros(2, HQ, D)
    state.attend(0, q.view(2, HQ, D), want, layer.scaling)
    assert torch.equal(o.view(2, HQ, D), want)
    step(state, [0, 1], [301, 40])  # request 1 is short now: a dense row
    assert state.active and not state.all_rows
    backend.forward_decode(q, k, v, layer, fb)
    assert dense_calls == [2] and len(writes) == 1  # the dense decode wrote the K/V itself


def test_a_batch_with_no_long_request_reads_nothing_from_the_gpu():
    """The backend's per-step bookkeeping: a batch whose lengths (known on the CPU) are all
    within the threshold skips the pool-index read that would wait for the previous step."""
    from types import SimpleNamespace

    from sglang_pic.sparse.backends import ParisKVTritonBackend

    class NoRead:  # stands for fb.req_pool_indices on the GPU
        def __getitem__(self, _):
            raise AssertionError("read the GPU")

    backend = object.__new__(ParisKVTritonBackend)
    backend.sparse = make_state(FakePool(2), TorchIndexOps)
    decode = SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False)
    lens = torch.tensor([50, 120, 1])  # the last row is graph padding
    fb = SimpleNamespace(forward_mode=decode, batch_size=3, num_padding=1, seq_lens=lens,
                         seq_lens_cpu=lens, req_pool_indices=NoRead(), rids=None)
    assert backend._note_batch(fb) is None and not backend.sparse.active
    fb.seq_lens_cpu = fb.seq_lens = torch.tensor([50, 300, 1])  # a long request: it is read
    fb.req_pool_indices = torch.tensor([0, 1, 0])
    assert backend._note_batch(fb).tolist() == [50, 1, 1] and backend.sparse.rows == [1]


@pytest.mark.parametrize("change,message", [
    (dict(prefill_attention_backend="flashinfer"), "--prefill-attention-backend flashinfer"),
    (dict(decode_attention_backend="triton"), "--decode-attention-backend triton"),
    (dict(enable_two_batch_overlap=True), "--enable-two-batch-overlap"),
    (dict(enable_pdmux=True), "--enable-pdmux"),
    (dict(disaggregation_mode="decode"), "--disaggregation-mode decode"),
    (dict(speculative_algorithm="EAGLE"), "speculative decoding"),
    (dict(layer_ids=[0, 3]), "hybrid models"),
    (dict(head_dim=96), "head dim 96"),
    (dict(logit_cap=30.0), "soft-capping"),
    (dict(kv_cache_dtype=torch.float8_e4m3fn), "KV cache dtype"),
])
def test_unsupported_settings_are_refused_with_the_reason(change, message, monkeypatch):
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import AttentionArch
    from sglang_pic.sparse import backends

    args = dict(prefill_attention_backend=None, decode_attention_backend=None,
                enable_two_batch_overlap=False, enable_pdmux=False, disaggregation_mode="null",
                speculative_algorithm=None, dcp_size=1, enable_dp_attention=False)
    layer = dict(head_dim=128, logit_cap=0.0)
    layer_ids, kv_dtype = [0, 1], torch.bfloat16
    for k, v in change.items():
        if k in args:
            args[k] = v
        elif k in layer:
            layer[k] = v
        elif k == "layer_ids":
            layer_ids = v
        else:
            kv_dtype = v
    layers = [SimpleNamespace(layer_id=i, logit_cap=layer["logit_cap"], is_cross_attention=False,
                              tp_q_head_num=32, tp_k_head_num=8, qk_head_dim=layer["head_dim"],
                              v_head_dim=layer["head_dim"]) for i in layer_ids]
    monkeypatch.setattr(backends, "attention_layers", lambda runner: layers)
    runner = SimpleNamespace(
        model_config=SimpleNamespace(attention_arch=AttentionArch.MHA, is_encoder_decoder=False),
        server_args=SimpleNamespace(**args), sliding_window_size=None, kv_cache_dtype=kv_dtype,
        token_to_kv_pool=SimpleNamespace(start_layer=0, layer_num=2))
    with pytest.raises(SparseDecodeUnsupported, match=message):
        backends.check_server_settings(runner, "pariskv_triton")


@pytest.mark.parametrize("change,message", [
    (dict(disable_radix_cache=False), "add --disable-radix-cache"),
    (dict(enable_mixed_chunk=True), "--enable-mixed-chunk"),
    (dict(page_size=16), "--page-size 16"),
])
def test_offload_refuses_settings_that_would_read_freed_slots(change, message):
    from types import SimpleNamespace

    from sglang_pic.sparse import backends

    args = dict(disable_radix_cache=True, enable_mixed_chunk=False, page_size=1)
    runner = SimpleNamespace(server_args=SimpleNamespace(**args),
                             token_to_kv_pool_allocator=FakeAllocator())
    backends.check_offload_settings(runner)  # the supported settings pass
    runner.server_args = SimpleNamespace(**{**args, **change})
    with pytest.raises(SparseDecodeUnsupported, match=message):
        backends.check_offload_settings(runner)


def test_a_pool_too_small_for_an_offloaded_prefill_is_refused_at_start():
    """A prompt longer than the pool holds threshold + 2 chunks + sink + local pool tokens while
    it is prefilled; a pool smaller than that would leave it waiting for good (as a 64K-token
    pool with threshold 32K and 16K chunks did on the H200), so the server does not start."""
    from sglang_pic.sparse import backends

    cfg = SparseDecodeConfig(threshold=32768, sink=16, local=128)

    def runner(pool, chunk=16384):
        return SimpleNamespace(server_args=SimpleNamespace(chunked_prefill_size=chunk),
                               max_total_num_tokens=pool)

    with pytest.raises(SparseDecodeUnsupported, match=r"= 65680 pool tokens.*--sparse-threshold"):
        backends.check_offloaded_prefill_fits(runner(65536), cfg, 1 << 20)
    backends.check_offloaded_prefill_fits(runner(65536, chunk=8192), cfg, 1 << 20)
    backends.check_offloaded_prefill_fits(runner(65680), cfg, 1 << 20)
    backends.check_offloaded_prefill_fits(runner(65536), cfg, 65536)  # no prompt over the pool


def test_a_release_lets_the_scheduler_try_to_admit_waiting_requests_again(monkeypatch):
    """SGLang stops admitting once a waiting request did not fit, until a request finishes;
    slots offloading frees mid-request clear that mark (once per release)."""
    from types import SimpleNamespace

    from sglang_pic.sparse import offload, prefill_offload

    monkeypatch.setattr(prefill_offload, "_state", None)  # no sparse slots in this process
    pool = FakePool(1)
    release = PoolSlotRelease(FakeAllocator(), pool.req_to_token)
    seen = []

    def original(scheduler, running_batch):
        seen.append(running_batch.batch_is_full)

    batch = SimpleNamespace(batch_is_full=True, reqs=[])
    offload._freed_since_admission = False
    offload.around_get_new_batch_prefill(original, None, batch)
    release.release(0, 4, 20)
    offload.around_get_new_batch_prefill(original, None, running_batch=batch)
    batch.batch_is_full = True
    offload.around_get_new_batch_prefill(original, None, batch)
    assert seen == [True, False, True]


# ---- bad input: host memory and request lengths (issue 27) ------------------------------------


def test_host_memory_available_is_lowered_by_the_memory_cgroup(tmp_path):
    """A container over its cgroup limit is killed whatever the host has free: the limit left
    (v2 ``memory.max - memory.current`` plus the inactive page cache, or v1) caps
    ``MemAvailable``; "max" means no limit."""
    from sglang_pic.sparse.config import host_memory_available

    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cgroup.mkdir()
    (proc / "meminfo").write_text("MemTotal: 100000000 kB\nMemAvailable: 50000000 kB\n")
    host = 50000000 * 1024
    assert host_memory_available(str(proc), str(cgroup)) == host  # no cgroup files
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    assert host_memory_available(str(proc), str(cgroup)) == host
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    (cgroup / "memory.current").write_text(f"{4 << 30}\n")
    # inactive page cache is reclaimed before the limit kills anything: it counts as free
    (cgroup / "memory.stat").write_text(f"anon 123\ninactive_file {1 << 30}\nactive_file 7\n")
    assert host_memory_available(str(proc), str(cgroup)) == 5 << 30
    (cgroup / "memory.max").unlink()
    (cgroup / "memory").mkdir()
    (cgroup / "memory" / "memory.limit_in_bytes").write_text(f"{4 << 30}\n")
    (cgroup / "memory" / "memory.usage_in_bytes").write_text(f"{5 << 30}\n")
    assert host_memory_available(str(proc), str(cgroup)) == 0


def _offload_runner():
    from types import SimpleNamespace

    args = SimpleNamespace(disable_radix_cache=True, enable_mixed_chunk=False, page_size=1)
    return SimpleNamespace(server_args=args, token_to_kv_pool_allocator=FakeAllocator(),
                           req_to_token_pool=SimpleNamespace(req_to_token=FakePool(1).req_to_token),
                           device="cpu")


def test_offload_without_the_host_memory_is_refused_at_start_with_the_gib(monkeypatch):
    """``--sparse-offload`` sizes its host region at start: more than the memory left (here a
    cgroup limit the host's free memory would not show) is refused naming the GiB, and so is an
    allocation the driver or a limit refuses (pinning), instead of a crash."""
    from sglang_pic.sparse import backends

    state = make_state(FakePool(1), TorchIndexOps)
    capacity = state.capacity  # 2 requests x 988 tokens x 2 layers x 2 heads x 64 x 4 bytes x 2
    monkeypatch.setattr(backends, "host_memory_available", lambda: 1 << 20)
    with pytest.raises(SparseDecodeUnsupported, match=r"host KV needs 0\.0 GiB and 0\.0 GiB of "
                       r"host memory are available \(lower --sparse-max-requests"):
        backends._offload(state, _offload_runner(), LAYERS, HKV, D, capacity, torch.float32)
    monkeypatch.setattr(backends, "host_memory_available", lambda: 64 << 30)

    class Refused(HostKVRegion):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("CUDA error: out of memory\nmore")

    monkeypatch.setattr(backends, "HostKVRegion", Refused)
    with pytest.raises(SparseDecodeUnsupported,
                       match=r"allocating it failed \(CUDA error: out of memory\)"):
        backends._offload(state, _offload_runner(), LAYERS, HKV, D, capacity, torch.float32)
    monkeypatch.undo()
    backends._offload(state, _offload_runner(), LAYERS, HKV, D, capacity, torch.float32)
    assert state.host is not None and state.host.capacity == capacity


class _TokenizerManager:
    """What ``admission.check_request_length`` reads of SGLang's TokenizerManager."""

    def __init__(self, context_len: int = 8192):
        from types import SimpleNamespace

        self.context_len = context_len
        self.model_config = SimpleNamespace(num_hidden_layers=32, head_dim=128,
                                            dtype=torch.bfloat16,
                                            get_num_kv_heads=lambda tp: 8 // tp)
        self.server_args = SimpleNamespace(kv_cache_dtype="auto", tp_size=1)


def test_a_request_longer_than_the_host_region_is_refused_with_the_gib(monkeypatch):
    """With ``--sparse-offload`` and ``--sparse-max-context`` below the context length, prompt +
    max_new_tokens over the region is a ValueError (SGLang's HTTP 400) naming the GiB."""
    from types import SimpleNamespace

    from sglang_pic.sparse.admission import check_request_length

    tm = _TokenizerManager()
    for name, value in (("OFFLOAD", "1"), ("MAX_CONTEXT", "4096"), ("THRESHOLD", "1024")):
        monkeypatch.setenv(f"SGLANG_PIC_SPARSE_{name}", value)

    def request(prompt: int, new: int | None = None):
        params = {} if new is None else {"max_new_tokens": new}
        return SimpleNamespace(sampling_params=params), list(range(prompt))

    check_request_length(tm, *request(4000, 96))  # exactly the region
    # 4097 tokens x 32 layers x 8 KV heads x 128 x 2 bytes x 2 (K, V): 0.50 GiB
    with pytest.raises(ValueError, match=r"needs 4097 tokens of context \(4000 prompt \+ 97 "
                       r"new\): 0\.50 GiB of host KV.*holds 4096 tokens \(0\.50 GiB, "
                       r"--sparse-max-context 4096\)"):
        check_request_length(tm, *request(4000, 97))
    with pytest.raises(ValueError, match=r"4100 prompt \+ 128 new"):  # SGLang's default
        check_request_length(tm, *request(4100))
    with pytest.raises(ValueError, match="2.00 GiB of host KV"):
        check_request_length(tm, *request(16000, 384))
    monkeypatch.setenv("SGLANG_PIC_SPARSE_MAX_CONTEXT", "0")  # the region is the context length
    check_request_length(tm, *request(7000, 1000))  # longer: SGLang's own check refuses it
    monkeypatch.setenv("SGLANG_PIC_SPARSE_MAX_CONTEXT", "4096")
    monkeypatch.setenv("SGLANG_PIC_SPARSE_OFFLOAD", "0")  # no host region: long ones are dense
    check_request_length(tm, *request(7000, 1000))


def test_sparse_flashinfer_twin_shares_the_gpu_sparse_path():
    """``pariskv_flashinfer``: SGLang's FlashInfer backend with the same sparse metadata calls
    and decode overwrite as ``pariskv_triton``, and the sparse graph hooks recognise it."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang_pic.sparse import BACKEND_FOR, graphs
    from sglang_pic.sparse.backends import (
        ParisKVFlashInferBackend,
        ParisKVTritonBackend,
        _GpuSparseMixin,
    )

    assert BACKEND_FOR["flashinfer"] == "pariskv_flashinfer"
    mro = ParisKVFlashInferBackend.__mro__
    assert mro.index(_GpuSparseMixin) < mro.index(FlashInferAttnBackend)
    for method in ("init_forward_metadata", "init_forward_metadata_out_graph",
                   "init_cuda_graph_state", "forward_decode"):
        assert getattr(ParisKVFlashInferBackend, method) is getattr(ParisKVTritonBackend, method)
    backend = object.__new__(ParisKVFlashInferBackend)
    runner = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend))
    assert graphs._sparse_backend(runner) is backend


def test_the_sparse_flashinfer_capture_reuses_the_dense_captures_decode_wrappers():
    """Both graph sets of a batch size must read the decode wrappers a replay plans: SGLang's
    FlashInfer backend keeps the wrappers of the last capture per batch size and makes new ones
    (each with its own device workspace) at every capture, so the second, sparse capture reuses
    the first's, and so does the third (only-sparse) capture of the small sizes. Driven as
    ``graphs.around_capture_one_stream`` captures: three times for size 4."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_pic.sparse import graphs
    from sglang_pic.sparse.backends import ParisKVFlashInferBackend

    backend = object.__new__(ParisKVFlashInferBackend)
    backend.decode_cuda_graph_metadata = {}
    backend.sparse = SimpleNamespace(deactivate=lambda: None,
                                     cfg=SimpleNamespace(max_requests=4))
    made = []

    def create(bs, num_tokens):
        made.append([object()])  # a wrapper list with its own workspace
        return made[-1]

    backend._create_decode_wrappers = create
    seen = []

    def capture(runner):  # what SGLang's capture of one size does with the metadata
        backend._prepare_cuda_graph_metadata(4, 4, ForwardMode.DECODE, None)
        seen.append((backend.capture_sparse, backend.forward_metadata.decode_wrappers))

    runner = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend), capture_bs=[4])
    graphs.around_capture_one_stream(capture, runner)
    assert len(made) == 1  # the sparse captures made none
    assert seen == [(False, made[0]), (True, made[0]), (True, made[0])]
    assert backend.decode_cuda_graph_metadata[4] is made[0]  # what a replay plans
    backend.capture_sparse = False  # a later dense capture (a recapture) makes new ones
    backend._prepare_cuda_graph_metadata(4, 4, ForwardMode.DECODE, None)
    assert len(made) == 2 and backend.decode_cuda_graph_metadata[4] is made[1]


def test_the_sparse_dense_view_shrinks_the_sum_the_kernel_sizes_buffers_by():
    from sglang_pic.sparse.backends import _SparseDecodeMixin

    mixin = object.__new__(_SparseDecodeMixin)
    mixin.sparse = SimpleNamespace(active=True, rows=torch.tensor([1]))
    fb = SimpleNamespace(seq_lens=torch.tensor([5, 900]), seq_lens_cpu=torch.tensor([5, 900]),
                         seq_lens_sum=905)
    with mixin._dense_view(fb, torch.tensor([5, 1])):
        assert fb.seq_lens_cpu.tolist() == [5, 1] and fb.seq_lens_sum == 6
    assert fb.seq_lens_cpu.tolist() == [5, 900] and fb.seq_lens_sum == 905


def _causal_reference(pool: FakePool, layer: int, q: torch.Tensor, pool_index: int,
                      start: int, end: int) -> torch.Tensor:
    """Dense causal attention of positions ``start..end-1``'s queries ``q`` over the request's
    keys in the pool (as SGLang's extend computes it)."""
    out = []
    for i in range(end - start):
        out.append(pool.dense(layer, q[i], pool_index, start + i + 1))
    return torch.stack(out)


def test_a_chunked_prefill_offloads_its_prefix_and_attends_exactly():
    """``--sparse-offload`` prefill: once the computed prefix is past the threshold, each chunk
    first moves the finished positions (but the last ``local``) to host memory and frees their
    pool slots; the chunk's attention over sink + host region + resident tail + itself equals
    dense causal attention over the whole prefix, with another request in the batch; the dense
    kernel is shown no prefix for that row; the first decode step continues from the region."""
    pools = [FakePool(2) for _ in range(2)]  # the same KV: one stays whole as the reference
    original = pools[0].req_to_token.clone()
    state = make_state(pools[1], TorchIndexOps, topk=988, candidates=988, max_context=MAX_CTX)
    alloc = offloaded(state, pools[1])
    prompt, chunk, scale = 600, 96, 1 / math.sqrt(D)
    g = torch.Generator().manual_seed(1)
    for start in range(0, prompt, chunk):
        e = min(chunk, prompt - start)
        rows = [(0, start, e)] + ([(1, 0, 20)] if start == 384 else [])  # a short one alongside
        state.note_extend([p for p, _, _ in rows], [f"r{p}" for p, _, _ in rows],
                          [s for _, s, _ in rows], [n for _, _, n in rows])
        offloading = start > 200
        assert [r[:4] for r in state.prefill_rows] == ([(0, 0, start, e)] if offloading else [])
        if not offloading:
            continue
        slot = state.slots[0]
        assert slot.n_ret == start - 4 - 32 and slot.seq_len == start + e
        view = state.extend_view([s for _, s, _ in rows], [s + n for _, s, n in rows])
        assert view[0][0] == 0 and view[1][0] == e and view[0][1:] == [s for _, s, _ in rows[1:]]
        tokens = sum(n for _, _, n in rows)
        q = torch.randn(tokens, HQ, D, generator=g)
        for layer in range(LAYERS):
            new = original[0, start:start + e].long()  # the chunk's keys, as SGLang wrote them
            k = torch.zeros(tokens, HKV, D)
            v = torch.zeros(tokens, HKV, D)
            k[:e], v[:e] = pools[0].k[layer][new], pools[0].v[layer][new]
            o = torch.full((tokens, HQ, D), 7.0)
            state.attend_prefill(layer, q, k, v, o, scale)
            torch.testing.assert_close(o[:e], _causal_reference(pools[0], layer, q[:e], 0,
                                                                start, start + e),
                                       atol=2e-5, rtol=1e-4)
            assert torch.equal(o[e:], torch.full((tokens - e, HQ, D), 7.0))  # not its row
    n_ret = state.slots[0].n_ret
    assert n_ret == 576 - 36
    assert sorted(alloc.freed) == sorted(original[0, 4:4 + n_ret].tolist())
    assert (pools[1].req_to_token[0, 4:4 + n_ret] == 0).all()
    # the first decode step: the region as prefilled, the last chunk's excess slides in
    assert step(state, [0], [prompt + 1]).tolist() == [1]
    assert state.slots[0].n_ret == n_ret + 16  # a window of 57 > 32 + 16: one step of 16
    q = torch.randn(1, HQ, D, generator=g)
    for layer in range(LAYERS):
        o = torch.zeros(1, HQ, D)
        state.attend(layer, q, o, scale)
        torch.testing.assert_close(o[0], pools[0].dense(layer, q[0], 0, prompt + 1),
                                   atol=2e-5, rtol=1e-4)


def test_the_extend_view_shows_no_prefix_for_offloaded_rows_and_restores_the_batch():
    """What the GPU backends' metadata init sees of an extend batch whose row 1 attends an
    offloaded prefix: prefix 0 and the chunk's own length for that row, the rest as it was."""
    from sglang_pic.sparse.backends import _SparseDecodeMixin

    mixin = object.__new__(_SparseDecodeMixin)
    mixin.sparse = make_state(FakePool(2), TorchIndexOps)
    mixin.sparse.prefill_rows = [(1, 0, 900, 64, 5)]
    fb = SimpleNamespace(
        forward_mode=SimpleNamespace(is_extend=lambda: True),
        extend_prefix_lens=torch.tensor([0, 900]), extend_prefix_lens_cpu=[0, 900],
        seq_lens=torch.tensor([5, 964]), seq_lens_cpu=torch.tensor([5, 964]), seq_lens_sum=969)
    with mixin._extend_view(fb):
        assert fb.extend_prefix_lens.tolist() == [0, 0] and fb.extend_prefix_lens_cpu == [0, 0]
        assert fb.seq_lens.tolist() == fb.seq_lens_cpu.tolist() == [5, 64]
        assert fb.seq_lens_sum == 69
    assert fb.extend_prefix_lens_cpu == [0, 900] and fb.seq_lens.tolist() == [5, 964]
    assert fb.seq_lens_sum == 969
    mixin.sparse.prefill_rows = []
    with mixin._extend_view(fb):
        assert fb.seq_lens_sum == 969


def test_a_prompt_that_finishes_during_its_offloaded_prefill_gives_its_slot_back(monkeypatch):
    """A slot taken by an offloaded prefill is kept from the decode steps of other long requests
    while the prefill goes on, and given back before the scheduler next admits requests once its
    request has finished without decoding (``max_new_tokens`` 1): otherwise the next prompt
    longer than the pool would wait for that slot for good (SGLang's "no room" mark set)."""
    from sglang_pic.sparse import offload, prefill_offload

    pool = FakePool(2)
    state = make_state(pool, TorchIndexOps, max_requests=1, max_context=MAX_CTX)
    offloaded(state, pool)
    monkeypatch.setattr(prefill_offload, "_state", state)
    for start in (0, 256):  # two chunks of prompt r0 in row 0: the second offloads
        state.note_extend([0], ["r0"], [start], [256])
    assert state.slots[0].pool_index == 0 and state.slots[0].prefilling
    # a long request in row 1 decodes between r0's chunks: no free slot, and r0's is not taken
    assert step(state, [1], [400]).tolist() == [400]
    assert state.slots[0].pool_index == 0 and state.stats["refused_full"] == 1
    monkeypatch.setattr(offload, "_freed_since_admission", False)  # r0's offload released some
    seen = []

    def admit(scheduler, running_batch):
        seen.append(running_batch.batch_is_full)

    row = SimpleNamespace
    # r0 still the chunked request, or running: its slot stays
    offload.around_get_new_batch_prefill(
        admit, row(chunked_req=row(req_pool_idx=0)), row(batch_is_full=True, reqs=[]))
    offload.around_get_new_batch_prefill(
        admit, row(chunked_req=None), row(batch_is_full=True, reqs=[row(req_pool_idx=0)]))
    assert state.slots[0] is not None and seen == [True, True]
    # r0 finished with its prefill: before admitting, its slot is released and the mark cleared
    offload.around_get_new_batch_prefill(
        admit, row(chunked_req=None), row(batch_is_full=True, reqs=[row(req_pool_idx=1)]))
    assert state.slots[0] is None and seen[-1] is False
    # the next decode step of the long request takes it
    assert step(state, [1], [401]).tolist() == [1] and state.slots[0].pool_index == 1
    assert not state.slots[0].prefilling


def test_an_offloaded_prompt_is_admitted_on_a_credit_while_a_slot_is_free(monkeypatch):
    """A prompt longer than the pool is charged its peak in the pool (``pool_need``) while a
    sparse slot is free for it; a credited prompt keeps a slot for itself until it takes one,
    and once it has finished (in its prefill, never taking one) the next prompt gets the slot."""
    from sglang_pic.sparse import prefill_offload

    state = make_state(FakePool(2), TorchIndexOps, max_requests=1, max_context=MAX_CTX)
    monkeypatch.setattr(prefill_offload, "_state", state)
    monkeypatch.setattr(prefill_offload, "_credited", __import__("weakref").WeakSet())
    credits = []

    def add_one_req(adder, req):  # SGLang's, as far as the offsets go: what it sees credited
        credits.append(-adder.rem_total_token_offset)
        adder.can_run_list.append(req)

    class Req(SimpleNamespace):  # hashed by identity and weakly referenced, as SGLang's Req
        __hash__ = object.__hash__
        __slots__ = ("__weakref__",)

    def request(rid, n, done=False):
        return Req(rid=rid, origin_input_ids=[1] * n, prefix_indices=[], finished=lambda: done)

    def admit(req):
        adder = SimpleNamespace(rem_chunk_tokens=64, rem_total_token_offset=0,
                                cur_rem_token_offset=0, can_run_list=[])
        prefill_offload.admit_offloaded_prompt(add_one_req, adder, req)
        assert adder.rem_total_token_offset == adder.cur_rem_token_offset == 0  # restored
        return credits[-1]

    need = 200 + 2 * 64 + 4 + 32  # threshold + 2 chunks + sink + local
    r1 = request("r1", 900)
    assert admit(r1) == 900 - need  # charged need tokens instead of 900
    assert admit(request("r2", 900)) == 0  # r1 keeps the only slot for itself
    assert admit(request("short", 150)) == 0  # below the threshold: never credited
    r1.finished = lambda: True  # r1 ended in its prefill (one new token), no slot taken
    assert admit(request("r3", 900)) == 900 - need


def test_a_decode_step_finds_its_request_rows_without_reading_the_gpu():
    """Per decode step the backend needs each row's request row (``req_to_token`` index). The
    ForwardBatch has it as a GPU tensor, whose ``tolist`` waits for the previous step and costs
    the overlap scheduler its overlap; the ``init_new`` hook copies it from the batch's requests
    as host ints, and a graph replay's view (which lacks it) gets the batch from the
    ``load_batch`` hook. A batch without it (no requests) falls back to the tensor."""
    from sglang_pic.sparse import graphs
    from sglang_pic.sparse.backends import REQUEST_ROWS, _SparseDecodeMixin, record_request_rows

    class NoRead:  # a GPU tensor that must not be read on the CPU
        def __getitem__(self, _):
            return self

        def tolist(self):
            raise AssertionError("read the request rows from the GPU")

    mixin = object.__new__(_SparseDecodeMixin)
    mixin.sparse = state = make_state(FakePool(3), TorchIndexOps, topk=64, candidates=64)
    runner = SimpleNamespace(attn_backend=mixin)
    decode = SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False)

    def forward_batch(reqs, lens, pools=None):
        """What ForwardBatch.init_new builds, through the AFTER hook."""
        fb = SimpleNamespace(forward_mode=decode, batch_size=len(lens), num_padding=0,
                             req_pool_indices=NoRead() if pools is None else pools,
                             seq_lens_cpu=torch.tensor(lens), seq_lens=torch.tensor(lens),
                             rids=[r.rid for r in reqs])
        record_request_rows(fb, None, SimpleNamespace(reqs=reqs), runner)
        return fb

    a, b = (SimpleNamespace(rid=rid, req_pool_idx=p) for rid, p in (("a", 2), ("b", 0)))
    prefill = forward_batch([a, b], [300, 40])  # an extend batch: its rows the same way
    prefill.forward_mode = SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True)
    prefill.extend_prefix_lens_cpu, prefill.extend_seq_lens_cpu = [0, 0], [300, 40]
    assert mixin._note_batch(prefill) is None and state.rid_of_pool == {2: "a", 0: "b"}
    dense = mixin._note_batch(forward_batch([a, b], [301, 41]))
    assert dense.tolist() == [1, 41] and state.slots[0].pool_index == 2
    assert state.slot_of_row[:2].tolist() == [0, -1] and state.row_of_slot.tolist() == [0, -1]
    # a graph replay: the backend sees a padded view without the batch's host-side fields
    graph_runner = SimpleNamespace(model_runner=runner)
    seen = []

    def load_batch(runner_self, fb):
        padded = SimpleNamespace(forward_mode=decode, batch_size=4, num_padding=2,
                                 req_pool_indices=NoRead(), seq_lens=torch.tensor([41, 302, 1, 1]),
                                 seq_lens_cpu=torch.tensor([41, 302, 1, 1]))
        seen.append(mixin._note_batch(padded).tolist())

    graphs._mixin = _SparseDecodeMixin
    try:
        graphs.around_load_batch(load_batch, graph_runner, forward_batch([b, a], [41, 302]))
    finally:
        graphs._mixin = None
    assert seen == [[41, 1, 1, 1]] and mixin.replay_batch is None
    assert state.slot_of_row[:2].tolist() == [-1, 0] and state.row_of_slot.tolist() == [1, -1]
    # not a sparse server: the hook leaves the batch alone
    other = SimpleNamespace()
    record_request_rows(other, None, SimpleNamespace(reqs=[a]), SimpleNamespace(attn_backend=1))
    assert not hasattr(other, REQUEST_ROWS)
    # a batch whose rows are unknown: the tensor is read
    fb = forward_batch([], [500, 303], pools=torch.tensor([1, 2]))
    fb.rids = ["c", "a"]
    assert mixin._note_batch(fb).tolist() == [1, 1]  # both long: "c" (row 1) took a slot
    assert sorted(slot.pool_index for slot in state.slots) == [1, 2]


def test_a_batch_that_may_attend_an_offloaded_prefix_keeps_off_prefill_graphs(monkeypatch):
    """SGLang's prefill graph runner builds the dense kernel's metadata from its own view of the
    batch, which would read an offloaded prefix's freed slots: a batch with a row past the
    threshold (or one that does not say its prefixes) runs eagerly; others ask SGLang."""
    from sglang_pic.sparse import prefill_offload

    state = make_state(FakePool(1), TorchIndexOps)  # threshold 200
    asked = []

    def can_run_graph(runner, fb):
        asked.append(fb.extend_prefix_lens_cpu)
        return True

    def run(prefix):
        fb = SimpleNamespace(extend_prefix_lens_cpu=prefix)
        return prefill_offload.keep_offloaded_prefill_eager(can_run_graph, None, fb)

    monkeypatch.setattr(prefill_offload, "_state", None)  # no offloading in this process
    assert run([900]) is True
    monkeypatch.setattr(prefill_offload, "_state", state)
    assert run([0, 200]) is True and run([0, 201]) is False and run(None) is False
    assert asked == [[900], [0, 200]]


def test_a_held_slot_whose_request_is_not_in_the_step_is_not_selected_for():
    """A slot kept for a request absent from this decode step (finished, or waiting) costs the
    selection nothing: its row is -1 and the keys the kernels read for it are 0, while the slot
    and its retrieval region are kept for the request's return."""
    pool = FakePool(2)
    state = make_state(pool, TorchIndexOps)
    step(state, [0, 1], [300, 400])
    assert state.n_ret.tolist() == [300 - 36, 400 - 36] and state.row_of_slot.tolist() == [0, 1]
    step(state, [1], [401])
    assert state.slots[0] is not None and state.slots[0].n_ret == 300 - 36
    assert state.n_ret.tolist() == [0, 400 - 36] and state.row_of_slot.tolist() == [-1, 0]
    step(state, [0, 1], [301, 402])  # it returns: selected over its whole region again
    assert state.n_ret.tolist() == [300 - 36, 400 - 36]


INTERVAL_N0, INTERVAL_STEPS, INTERVAL_UPDATE, INTERVAL_GROW = 408, 9, 4, 5
"""The interval tests' decode steps: from context 408, 9 steps, the window sliding in updates of
4 tokens; the region grows at step 5 (by 4 keys), off an interval of 3's own cadence, so the
restart it causes shows."""


def _interval_fresh_steps(every: int = 3) -> list[bool]:
    """The steps of ``_interval_steps`` at which a request with an interval of ``every`` selects
    (votes): its first, every ``every``-th, and the step the region grew (``INTERVAL_GROW``),
    which restarts the count."""
    grow = INTERVAL_GROW
    return [t < grow and t % every == 0 or t >= grow and (t - grow) % every == 0
            for t in range(INTERVAL_STEPS)]


def _interval_steps(state, every, device: str, n0: int = INTERVAL_N0,
                    steps: int = INTERVAL_STEPS):
    """``steps`` decode steps of request 0 from context ``n0`` in ``state`` and the every-step
    state ``every`` (both made with ``update=INTERVAL_UPDATE``): yields each step's query,
    whether ``state`` selected (voted) at it and the region's keys, which grow at
    ``INTERVAL_GROW`` only (checked)."""
    g = torch.Generator().manual_seed(0)
    first = None
    for t in range(steps):
        q = torch.randn(1, HQ, D, generator=g).to(device)
        before = state.stats["selections"]
        step(state, [0], [n0 + t])
        step(every, [0], [n0 + t])
        n_ret = state.slots[0].n_ret
        first = n_ret if first is None else first
        assert (n_ret > first) == (t >= INTERVAL_GROW), (t, n_ret, first)
        yield q, state.stats["selections"] > before, n_ret


@pytest.mark.parametrize("ops_cls,device", OPS_GPU_KERNELS)
def test_a_selection_serves_reselect_interval_steps_and_keys_entering_the_region_reselect(
        ops_cls, device):
    """``--sparse-reselect-interval 3``: a request selects at its first step, then at every third
    step and at the step its window slid keys into the region; between, every layer attends the
    rows it selected last moved on by the steps since (a copying head reads on), rows moved
    into the window dropped, even for a query that would select others. A selecting step is the
    every-step state's exactly; interval 1 selects at every step."""
    pool = FakePool(2, seed=3, device=device)
    state = make_state(pool, ops_cls, reselect_interval=3, update=INTERVAL_UPDATE)
    every = make_state(pool, ops_cls, update=INTERVAL_UPDATE)
    base, age, fresh_steps = None, 0, []
    for q, fresh, n_ret in _interval_steps(state, every, device):
        fresh_steps.append(fresh)
        outs = []
        for layer in range(LAYERS):
            o = torch.zeros_like(q)
            state.attend(layer, q, o, 1 / math.sqrt(D))
            outs.append((o, state.selected[0].clone()))
        ref = _sparse_output(every, q, {0: 0})
        if fresh_steps[-1]:
            base, age = [rows for _, rows in outs], 0
            for (o, rows), (o_ref, rows_ref) in zip(outs, ref, strict=True):
                assert set(rows.flatten().tolist()) == rows_ref[0]
                assert torch.allclose(o, o_ref, atol=1e-5)
        else:
            age += 1
            for layer, (_o, rows) in enumerate(outs):
                moved = base[layer] + age
                want = torch.where((base[layer] >= 0) & (moved < n_ret), moved, -1)
                assert torch.equal(rows.cpu(), want.cpu())
    # steps 0, 3, then 5 (the region grew, which restarts the count), 8
    want = _interval_fresh_steps()
    assert fresh_steps == want and want == [t in (0, 3, 5, 8) for t in range(INTERVAL_STEPS)]
    steps = INTERVAL_STEPS
    assert state.stats["selections"] == sum(want) and state.stats["sparse_steps"] == steps
    assert every.stats["selections"] == every.stats["sparse_steps"] == steps
    # a slot whose request sat a step out (retracted, paused) selects again when it is back
    step(state, [1], [300])
    selections = state.stats["selections"]
    step(state, [0], [INTERVAL_N0 + INTERVAL_STEPS])
    assert state.stats["selections"] == selections + 1


def _kept_vote(state, layer: int, slot: int) -> list[set[int]]:
    """Per KV head, the ids of ``layer``'s last vote's candidates for ``slot``, whichever ops
    keep them."""
    ops = state.ops
    kept = (ops.cand[layer, slot] if isinstance(ops, KernelIndexOps)
            else ops.last_cand[layer][slot])
    return [set(head.tolist()) - {-1} for head in kept]


def _selected_per_head(state, q: torch.Tensor) -> list[list[set[int]]]:
    """Per layer and KV head, the retrieval rows slot 0 attends for the batch ``q``."""
    out = []
    for layer in range(LAYERS):
        state.attend(layer, q, torch.zeros_like(q), 1 / math.sqrt(D))
        out.append([set(head.tolist()) - {-1} for head in state.selected[0]])
    return out


@pytest.mark.parametrize("ops_cls,device", OPS_GPU_KERNELS)
def test_a_vote_serves_vote_interval_steps_and_the_steps_between_rerank_it(ops_cls, device):
    """``--sparse-vote-interval 3``: a request votes when ``--sparse-reselect-interval 3`` would
    select (its first step, every third, keys entering the region) and then selects as the
    every-step state; at the steps between, each layer and KV head picks its ``topk`` rows
    among its last vote's candidates moved on by the steps since (rows moved into the window
    dropped), with the step's own query: unlike a kept selection, a query wanting other
    candidates gets them."""
    pool = FakePool(2, seed=3, device=device)
    state = make_state(pool, ops_cls, vote_interval=3, update=INTERVAL_UPDATE)
    every = make_state(pool, ops_cls, update=INTERVAL_UPDATE)
    votes, kept, last, age, changed = [], None, None, 0, 0
    for q, voted, n_ret in _interval_steps(state, every, device):
        votes.append(voted)
        got = _selected_per_head(state, q)
        if votes[-1]:
            assert got == _selected_per_head(every, q)
            kept = [_kept_vote(state, layer, 0) for layer in range(LAYERS)]
            last, age = got, 0
            continue
        age += 1
        for layer in range(LAYERS):
            for h in range(HKV):
                moved = {c + age for c in kept[layer][h] if c + age < n_ret}
                assert got[layer][h] <= moved and len(got[layer][h]) == min(8, len(moved))
                changed += got[layer][h] != {r + age for r in last[layer][h] if r + age < n_ret}
    assert votes == _interval_fresh_steps()
    assert changed > 0  # the steps between chose by their own queries, not the vote's picks
