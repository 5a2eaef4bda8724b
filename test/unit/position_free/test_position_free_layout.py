"""The shifted KV layout's bookkeeping, without a model: recorded positions, which batches are
marked, which backend a batch goes to, and that marked batches stay off the CUDA graphs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang_pic.position_free import shifted_batches, span_graphs, stored_positions
from sglang_pic.position_free.backends import PositionFreeFlashInferBackend
from sglang_pic.position_free.segmented_backend import SegmentedAttention


@pytest.fixture(autouse=True)
def fresh_table():
    stored_positions.reset()
    yield
    stored_positions.reset()


def _forward_batch(slots: list[int], positions: list[int]) -> SimpleNamespace:
    return SimpleNamespace(out_cache_loc=torch.tensor(slots), positions=torch.tensor(positions))


def test_every_batch_records_where_its_keys_were_computed():
    table = stored_positions.allocate(16, "cpu")
    fb = _forward_batch([3, 7, 8], [0, 1, 2])
    shifted_batches.mark_forward_batch(fb, None, SimpleNamespace(reqs=[SimpleNamespace()]))
    assert table[[3, 7, 8]].tolist() == [0, 1, 2]
    assert fb.pic_shifted is False
    # a span's pages loaded without a forward (the span store tier) record their run
    stored_positions.record_run(torch.tensor([10, 11, 12]), 64)
    assert table[10:13].tolist() == [64, 65, 66]


def test_a_batch_holding_a_span_request_is_marked_shifted():
    stored_positions.allocate(8, "cpu")
    plain, span = SimpleNamespace(), SimpleNamespace(pic_segments=[object()])
    fb = _forward_batch([1], [5])
    shifted_batches.mark_forward_batch(fb, None, SimpleNamespace(reqs=[plain, span]))
    assert shifted_batches.is_shifted(fb)
    dense = _forward_batch([2], [6])
    shifted_batches.mark_forward_batch(dense, None, SimpleNamespace(reqs=[plain]))
    assert not shifted_batches.is_shifted(dense)


def _twin(span_graphs: bool) -> PositionFreeFlashInferBackend:
    backend = object.__new__(PositionFreeFlashInferBackend)
    backend.dense, backend.shifted = "flashinfer", "triton"
    backend.span_graphs, backend.capture_shifted, backend.replay_shifted = span_graphs, False, False
    return backend


def _runner(kind, backend):
    runner = object.__new__(kind)
    runner.model_runner = SimpleNamespace(attn_backend=backend)
    return runner


def _graph_calls():
    calls = []

    def original(runner, forward_batch):
        calls.append(forward_batch)
        return True

    return original, calls


def test_graphs_a_shifted_batch_may_replay():
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    stored_positions.allocate(8, "cpu")
    span, plain = _marked(span=True), _marked(span=False)
    can_run = span_graphs.around_can_run_graph
    # pic_triton: its graphs hold the shift-aware kernels every batch needs
    original, calls = _graph_calls()
    assert can_run(original, _runner(DecodeCudaGraphRunner, object()), span) and calls == [span]
    # pic_flashinfer without the second set: FlashInfer's graphs only for unmarked batches
    twin = _twin(span_graphs=False)
    original, calls = _graph_calls()
    assert can_run(original, _runner(DecodeCudaGraphRunner, twin), span) is False and not calls
    assert can_run(original, _runner(DecodeCudaGraphRunner, twin), plain) and calls == [plain]
    # with it: a shifted decode batch replays the second set
    twin = _twin(span_graphs=True)
    original, calls = _graph_calls()
    span = _marked(span=True)  # init_new builds each batch right before its forward
    assert can_run(original, _runner(DecodeCudaGraphRunner, twin), span) and twin.replay_shifted
    assert twin._pick(SimpleNamespace()) == "triton"  # the runner's view of the batch
    # a shifted extend: a prefill graph that calls attention eagerly between its pieces
    # (SGLang's breakable default), never one holding FlashInfer's kernels (full)
    calls.clear()
    for name, runs in (("breakable", True), ("full", False), ("tc_piecewise", False),
                       (None, False)):
        prefill = _runner(PrefillCudaGraphRunner, twin)
        prefill.prefill_backend_name = SimpleNamespace(value=name) if name else None
        assert can_run(original, prefill, span) is runs, name
    assert calls == [span]
    prefill = _runner(PrefillCudaGraphRunner, _twin(span_graphs=False))  # the decode set's flag
    prefill.prefill_backend_name = "breakable"  # does not matter to it
    assert can_run(original, prefill, span)
    plain = _marked(span=False)
    assert can_run(original, _runner(DecodeCudaGraphRunner, twin), plain)
    assert not twin.replay_shifted and twin._pick(SimpleNamespace()) == "flashinfer"
    # segmented attention's captured steps: a batch whose runs do not fit them runs eagerly
    fits = [True]
    twin.shifted = SimpleNamespace(graph_fits=lambda: fits[0])
    span = _marked(span=True)
    assert can_run(original, _runner(DecodeCudaGraphRunner, twin), span)
    fits[0] = False
    assert can_run(original, _runner(DecodeCudaGraphRunner, twin), span) is False
    _marked(span=False)  # the process's last batch: plain again


def _marked(span: bool) -> SimpleNamespace:
    """A batch as ``ForwardBatch.init_new`` leaves it: marked, and the process's last one."""
    req = SimpleNamespace(pic_segments=[object()]) if span else SimpleNamespace()
    fb = _forward_batch([1], [5])
    shifted_batches.mark_forward_batch(fb, None, SimpleNamespace(reqs=[req]))
    return fb


def test_the_second_decode_graph_set_is_captured_under_its_own_label():
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    twin = _twin(span_graphs=True)
    runner = _runner(DecodeCudaGraphRunner, twin)
    keys = []

    def make_key(runner, size, stream_idx=None, variant_label=None):
        return (size, variant_label)

    def capture(runner):  # what SGLang's capture does per batch size: key, backend, forward
        view = SimpleNamespace()  # capture batches carry no mark
        keys.append((span_graphs.around_make_graph_key(make_key, runner, 8, None, "nolora"),
                     twin._pick(view)))

    span_graphs.around_capture_one_stream(capture, runner)
    assert keys == [((8, "nolora"), "flashinfer"), ((8, "nolora+shifted"), "triton")]
    assert not twin.capture_shifted
    # without the flag: one set, as SGLang captures it
    twin.span_graphs, keys[:] = False, []
    span_graphs.around_capture_one_stream(capture, runner)
    assert keys == [((8, "nolora"), "flashinfer")]


def test_one_hook_per_runner_method_serves_the_span_and_the_sparse_graph_sets(monkeypatch):
    """``graph_sets``: the seam table's one hook on ``_capture_one_stream`` / ``_make_graph_key``
    runs the span decode steps' wrapper around the sparse decoder's, so each set is captured and
    labelled as its own hooks would (the sparse wrapper passes through for a span backend)."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang_pic import graph_sets
    from sglang_pic.sparse import graphs as sparse_graphs

    twin = _twin(span_graphs=True)
    runner = _runner(DecodeCudaGraphRunner, twin)
    sparse_calls = []

    def sparse_capture(original, self, *args, **kwargs):
        sparse_calls.append("capture")
        return original(self, *args, **kwargs)

    def sparse_key(original, self, size, stream_idx=None, variant_label=None):
        sparse_calls.append("key")
        return original(self, size, stream_idx, variant_label)

    monkeypatch.setattr(sparse_graphs, "around_capture_one_stream", sparse_capture)
    monkeypatch.setattr(sparse_graphs, "around_make_graph_key", sparse_key)
    keys = []

    def make_key(runner, size, stream_idx=None, variant_label=None):
        return (size, variant_label)

    def capture(runner):
        keys.append((graph_sets.around_make_graph_key(make_key, runner, 8, None, "nolora"),
                     twin._pick(SimpleNamespace())))

    graph_sets.around_capture_one_stream(capture, runner)
    assert keys == [((8, "nolora"), "flashinfer"), ((8, "nolora+shifted"), "triton")]
    assert sparse_calls == ["capture", "key", "capture", "key"]


def test_without_a_position_free_backend_the_hook_does_nothing():
    fb = _forward_batch([1], [5])
    shifted_batches.mark_forward_batch(fb, None, SimpleNamespace(reqs=[SimpleNamespace(
        pic_segments=[object()])]))
    assert not hasattr(fb, "pic_shifted") and stored_positions.table() is None


class _Recorder:
    """Stands in for one of the two backends: records the calls it gets."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.workspace_buffer = f"{name}-workspace"

    def __getattr__(self, method: str):
        if method.startswith("__"):
            raise AttributeError(method)
        return lambda *a, **k: self.log.append((self.name, method)) or self.name


def test_flashinfer_twin_sends_each_batch_to_one_backend():
    log: list = []
    backend = _twin(span_graphs=False)
    backend.dense, backend.shifted = _Recorder("flashinfer", log), _Recorder("triton", log)
    plain = SimpleNamespace(pic_shifted=False)
    span = SimpleNamespace(pic_shifted=True)
    backend.init_forward_metadata(plain)
    backend.init_forward_metadata(span)
    assert backend.forward(None, None, None, None, plain) == "flashinfer"
    assert backend.forward(None, None, None, None, span) == "triton"
    backend.init_forward_metadata_out_graph(plain, in_capture=True)
    backend.init_cuda_graph_state(8, 64)
    assert log == [("flashinfer", "init_forward_metadata"), ("triton", "init_forward_metadata"),
                   ("flashinfer", "forward"), ("triton", "forward"),
                   ("flashinfer", "init_forward_metadata_out_graph"),
                   ("flashinfer", "init_cuda_graph_state")]
    # what SGLang reads from its backend beyond the interface is FlashInfer's
    assert backend.workspace_buffer == "flashinfer-workspace"


@pytest.mark.parametrize("span_graphs", [False, True])
def test_pic_flashinfer_keeps_the_positions_table_whatever_reads_moved_keys(
        monkeypatch, span_graphs):
    """``pic_flashinfer`` built for real (FlashInfer's backend and kernels stubbed): segmented
    attention (the default, and the reader of what copy on reuse has not copied), eager or
    with its decode graphs, leaves the table that ``mark_forward_batch`` needs; without it no span batch is marked shifted and FlashInfer reads the moved keys
    unturned (what the H100's real-weights test caught)."""
    from sglang.srt.layers.attention import flashinfer_backend
    from sglang_pic.launcher import server_flags
    from sglang_pic.position_free import backends, model_check, moved_copies
    from sglang_pic.position_free.run_kernels import TorchRunKernels

    class _FlashInfer:
        needs_cpu_seq_lens = False

        def __init__(self, model_runner, init_new_workspace=False):
            self.workspace_buffer = None

    monkeypatch.setattr(flashinfer_backend, "FlashInferAttnBackend", _FlashInfer)
    monkeypatch.setattr(backends, "ShiftedTritonBackend",
                        lambda runner: SimpleNamespace(needs_cpu_seq_lens=False))
    monkeypatch.setattr(backends, "_flashinfer_run_kernels",
                        lambda runner, dense: TorchRunKernels(0.125))
    monkeypatch.setattr(model_check, "check_server_settings", lambda runner: None)
    rotary = SimpleNamespace(cos_sin_cache=torch.zeros(64, 8))
    monkeypatch.setattr(model_check, "model_rotary", lambda runner: rotary)
    flags = {"--position-free-span-graphs": span_graphs, "--span-copy-on-reuse": "auto",
             "--span-graph-runs": 12}
    monkeypatch.setattr(server_flags, "setting", flags.get)
    keys = torch.zeros(32, 1, 8)
    runner = SimpleNamespace(
        server_args=SimpleNamespace(radix_cache_backend="pic_span",
                                    attention_backend="pic_flashinfer", enable_metrics=False),
        token_to_kv_pool=SimpleNamespace(k_buffer=[keys], layer_num=1, start_layer=0,
                                         get_key_buffer=lambda layer: keys),
        token_to_kv_pool_allocator=SimpleNamespace(size=32, page_size=1),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 8, dtype=torch.int64)),
        model_config=SimpleNamespace(context_len=8), device="cpu")
    assert moved_copies.wanted(runner)
    backend = PositionFreeFlashInferBackend(runner)
    assert isinstance(backend.shifted, SegmentedAttention)  # the span cache gives key runs
    assert stored_positions.table() is not None and stored_positions.table().numel() >= 32
    # the process's first batch starts the copier, which finds each span request's moved runs
    monkeypatch.setattr(shifted_batches, "_started", False)
    monkeypatch.setattr(moved_copies, "_copier", None)
    decode = SimpleNamespace(out_cache_loc=torch.tensor([0]), positions=torch.tensor([0]),
                             forward_mode=SimpleNamespace(is_extend=lambda: False))
    shifted_batches.mark_forward_batch(decode, None, SimpleNamespace(reqs=[SimpleNamespace()]),
                                       runner)
    assert moved_copies.copier() is not None and moved_copies.copier().copies is False
    # then a span request reading moved keys sends its batch to the shifted backend (asked
    # directly here: without the copier, each request is asked)
    monkeypatch.setattr(moved_copies, "_copier", None)
    span = SimpleNamespace(pic_segments=[object()])
    fb = _forward_batch([1], [5])
    shifted_batches.mark_forward_batch(fb, None, SimpleNamespace(reqs=[span]))
    assert backend._pick(fb) is backend.shifted
    assert stored_positions.table()[1] == 5


def test_segmented_attention_refuses_to_run_without_the_positions_table(monkeypatch):
    from sglang_pic.position_free import model_check
    from sglang_pic.position_free.run_kernels import TorchRunKernels

    monkeypatch.setattr(model_check, "check_server_settings", lambda runner: None)
    with pytest.raises(RuntimeError, match="stored-positions table is not allocated"):
        SegmentedAttention(SimpleNamespace(), TorchRunKernels(0.125))


def test_the_table_is_made_once_per_pool():
    first = stored_positions.allocate(16, "cpu")
    assert stored_positions.allocate(8, "cpu") is first  # a second backend of the same pool
    assert stored_positions.allocate(32, "cpu").numel() == 32  # a larger pool



def test_a_runners_copy_of_a_batch_follows_the_batch_it_copies():
    """SGLang's runners hand the model a copy of the batch (the eager runner's static buffers, a
    graph's view) without our mark: it belongs to the batch init_new built last."""
    stored_positions.allocate(8, "cpu")
    backend = _twin(span_graphs=False)
    span = SimpleNamespace(pic_segments=[object()])
    shifted_batches.mark_forward_batch(_forward_batch([1], [5]), None, SimpleNamespace(reqs=[span]))
    runner_copy = SimpleNamespace()  # no pic_shifted attribute
    assert shifted_batches.is_shifted(runner_copy) and backend._pick(runner_copy) == "triton"
    shifted_batches.mark_forward_batch(_forward_batch([2], [6]), None,
                                       SimpleNamespace(reqs=[SimpleNamespace()]))
    assert not shifted_batches.is_shifted(runner_copy)
    assert backend._pick(runner_copy) == "flashinfer"


def _rope(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    cos, sin = cache[pos].chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _cos_sin_cache(positions: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(positions).float()[:, None] * inv[None]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def test_turning_a_key_equals_rotating_it_where_it_now_stands():
    from sglang_pic.position_free.moved_copies import turn_keys

    cache = _cos_sin_cache(256, 16)
    keys = torch.randn(5, 2, 16)
    stored = torch.tensor([0, 3, 10, 40, 7])
    shift = torch.tensor([0, 5, 100, -30, 48])
    rotated = _rope(keys, stored, cache)
    turned = turn_keys(rotated, shift, cache)
    torch.testing.assert_close(turned, _rope(keys, stored + shift, cache), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(turn_keys(turned, -shift, cache), rotated, atol=1e-5, rtol=1e-5)


class _Allocator:
    def __init__(self, size: int, page: int) -> None:
        self.size, self.page_size = size, page
        self.free_pages = list(range(16 // page, size // page))  # slots 0-15: the tests' own
        self.freed: list[int] = []

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        pages = n // self.page_size
        if pages > len(self.free_pages):
            return None
        taken, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        return (torch.tensor(taken)[:, None] * self.page_size
                + torch.arange(self.page_size)).flatten()

    def free(self, slots: torch.Tensor) -> None:
        self.freed += slots.tolist()


def _copier(pool_slots: int = 64, page: int = 4, use_kernel: bool = False):
    from sglang_pic.position_free.moved_copies import MovedPageCopier

    table = stored_positions.allocate(pool_slots, "cpu")
    k = [torch.randn(pool_slots, 2, 16) for _ in range(2)]
    v = [torch.randn(pool_slots, 2, 16) for _ in range(2)]
    pool = SimpleNamespace(start_layer=0, layer_num=2, get_key_buffer=lambda i: k[i],
                           get_value_buffer=lambda i: v[i])
    allocator = _Allocator(pool_slots, page)
    runner = SimpleNamespace(token_to_kv_pool=pool, token_to_kv_pool_allocator=allocator,
                             req_to_token_pool=SimpleNamespace(
                                 req_to_token=torch.zeros(3, 32, dtype=torch.int32)))
    cache = _cos_sin_cache(128, 16)
    copier = MovedPageCopier(runner, SimpleNamespace(cos_sin_cache=cache), use_kernel=use_kernel)
    assert (copier.buffers is not None) == use_kernel
    return copier, table, k, v, cache


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "kernel"])
def test_a_span_request_reads_its_own_turned_copy_of_the_pages_it_moved(use_kernel):
    """Torch ops per layer (the CPU path) and the one-launch kernel (the GPU path, here under
    the Triton interpreter) make the same copy."""
    from sglang_pic.position_free import moved_copies

    copier, table, k, v, cache = _copier(use_kernel=use_kernel)
    row = copier.req_to_token[1]
    # a 4-token prompt piece computed in place (slots 4-7), then a span of 8 tokens computed
    # alone from 0 (slots 8-15) and read at positions 4..11, then 4 new tokens
    row[:12] = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], dtype=torch.int32)
    table[4:8] = torch.arange(4, dtype=torch.int32)
    table[8:16] = torch.arange(8, dtype=torch.int32)
    shared_k = [b[8:16].clone() for b in k]
    req = SimpleNamespace(pic_segments=[object()], req_pool_idx=1, prefix_indices=row[:12])
    assert moved_copies.reads_shared_pages(req)
    copier.prepare([req], [12])
    state = getattr(req, moved_copies.ATTR)
    assert isinstance(state, moved_copies.MovedCopy) and not moved_copies.reads_shared_pages(req)
    assert state.positions.tolist() == list(range(4, 12))  # the span's two pages
    slots = state.slots
    assert row[4:12].tolist() == slots.tolist() and row[:4].tolist() == [4, 5, 6, 7]
    assert table[slots].tolist() == list(range(4, 12))  # read where they stand: no turn
    for layer in range(2):
        torch.testing.assert_close(k[layer][slots], turn_keys_expected(shared_k[layer], cache))
        torch.testing.assert_close(v[layer][slots], v[layer][8:16])
        torch.testing.assert_close(k[layer][8:16], shared_k[layer])  # the shared copy is kept
    # SGLang rewrites the prefix before the next chunk: the row points at the copy again
    row[4:12] = torch.arange(8, 16, dtype=torch.int32)
    copier.prepare([req], [16])
    assert row[4:12].tolist() == slots.tolist()
    copier.release(req)
    assert sorted(copier.allocator.freed) == sorted(slots.tolist())
    assert getattr(req, moved_copies.ATTR) is None  # a retracted request is prepared again


def turn_keys_expected(shared: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    from sglang_pic.position_free.moved_copies import turn_keys

    return turn_keys(shared, torch.full((shared.shape[0],), 4), cache)


def test_without_room_or_moved_pages_a_request_keeps_the_shared_pages():
    from sglang_pic.position_free import moved_copies

    copier, table, *_ = _copier(pool_slots=24)
    row = copier.req_to_token[0]
    row[:8] = torch.arange(8, 16, dtype=torch.int32)
    table[8:16] = torch.arange(8, dtype=torch.int32)
    in_place = SimpleNamespace(pic_segments=[object()], req_pool_idx=0, prefix_indices=row[:8])
    copier.prepare([in_place], [8])  # every key read where it was computed
    assert getattr(in_place, moved_copies.ATTR) == moved_copies.NOTHING_MOVED
    assert not moved_copies.reads_shared_pages(in_place)
    table[8:16] = torch.arange(8, dtype=torch.int32) - 3 + 8  # computed 5 positions later
    moved = SimpleNamespace(pic_segments=[object()], req_pool_idx=0, prefix_indices=row[:8])
    free = copier.allocator.free_pages
    copier.allocator.free_pages = free[:2]  # 8 free slots, 2 kept free: no room
    copier.prepare([moved], [8])
    assert isinstance(getattr(moved, moved_copies.ATTR), moved_copies.Waiting)
    assert moved_copies.reads_shared_pages(moved) and row[:8].tolist() == list(range(8, 16))
    assert copier.stats["waiting_requests"] == 1
    copier.retry([moved])  # still no room: nothing changes
    assert isinstance(getattr(moved, moved_copies.ATTR), moved_copies.Waiting)
    copier.allocator.free_pages = free[:2] + [free[-1]]  # a request finished: room now
    copier.retry([moved])  # a later (decode) batch of the request
    state = getattr(moved, moved_copies.ATTR)
    assert isinstance(state, moved_copies.MovedCopy) and not moved_copies.reads_shared_pages(moved)
    assert row[:8].tolist() == state.slots.tolist()


def test_a_batch_of_new_span_requests_is_looked_up_together():
    """Several new span requests in one extend batch: each gets its own outcome (copied, nothing
    moved, or a moved key in a partial last page: left on the shared pages)."""
    from sglang_pic.position_free import moved_copies

    copier, table, *_ = _copier(pool_slots=64)
    table[8:16] = torch.arange(8, dtype=torch.int32)  # a span computed alone from 0
    table[4:8] = torch.arange(4, dtype=torch.int32)
    rows = copier.req_to_token
    rows[0, :12] = torch.tensor([4, 5, 6, 7, *range(8, 16)], dtype=torch.int32)  # moved by 4
    rows[1, :8] = torch.arange(8, 16, dtype=torch.int32)  # read where computed
    moved, in_place = (SimpleNamespace(pic_segments=[object()], req_pool_idx=i,
                                       prefix_indices=rows[i, :n]) for i, n in ((0, 12), (1, 8)))
    plain = SimpleNamespace(req_pool_idx=1)  # no span layout: not looked at
    copier.prepare([moved, plain, in_place], [12, 8, 8])
    assert isinstance(getattr(moved, moved_copies.ATTR), moved_copies.MovedCopy)
    assert getattr(in_place, moved_copies.ATTR) == moved_copies.NOTHING_MOVED
    assert not hasattr(plain, moved_copies.ATTR)
    partial = SimpleNamespace(pic_segments=[object()], req_pool_idx=1, prefix_indices=rows[1, :6])
    rows[1, :6] = torch.tensor([4, 5, 6, 7, 8, 9], dtype=torch.int32)  # moved keys at 4, 5
    copier.prepare([partial], [6])
    assert getattr(partial, moved_copies.ATTR) == moved_copies.SHARED


def test_requests_reading_the_same_pages_at_the_same_shift_share_one_turned_copy():
    """Two requests reading a span at the same offset read one turned copy (reference-counted);
    one reading it at another offset gets its own; the copy is freed with its last reader."""
    from sglang_pic.position_free import moved_copies

    copier, table, k, v, cache = _copier(pool_slots=64)
    table[8:16] = torch.arange(8, dtype=torch.int32)  # a span computed alone from 0
    table[4:8] = torch.arange(4, dtype=torch.int32)  # a 4-token piece in place
    rows = copier.req_to_token
    rows[0, :12] = rows[1, :12] = torch.tensor([4, 5, 6, 7, *range(8, 16)], dtype=torch.int32)
    rows[2, :8] = torch.arange(8, 16, dtype=torch.int32)  # the span at offset 0: nothing moved
    reqs = [SimpleNamespace(pic_segments=[object()], req_pool_idx=i, prefix_indices=rows[i])
            for i in range(3)]
    copier.prepare(reqs[:2], [12, 12])
    a, b = (getattr(r, moved_copies.ATTR) for r in reqs[:2])
    assert torch.equal(a.slots, b.slots) and rows[0, 4:12].tolist() == rows[1, 4:12].tolist()
    assert copier.stats["copied_tokens"] == 8 and copier.stats["reused_copy_tokens"] == 8
    for layer in range(2):
        torch.testing.assert_close(k[layer][a.slots], turn_keys_expected(k[layer][8:16], cache))
    # the span read 4 positions later than the shared copy was made for: its own copy
    rows[2, :16] = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3, *range(8, 16)], dtype=torch.int32)
    table[0:4] = torch.arange(4, 8, dtype=torch.int32)  # a second in-place piece
    copier.prepare([reqs[2]], [16])
    c = getattr(reqs[2], moved_copies.ATTR)
    assert isinstance(c, moved_copies.MovedCopy) and not set(c.slots.tolist()) & set(a.slots.tolist())
    assert table[c.slots].tolist() == list(range(8, 16))
    copier.release(reqs[0])
    assert copier.allocator.freed == []  # the second reader still reads it
    copier.release(reqs[1])
    assert sorted(copier.allocator.freed) == sorted(a.slots.tolist())
    copier.release(reqs[2])
    assert sorted(copier.allocator.freed) == sorted(a.slots.tolist() + c.slots.tolist())
    assert copier.runs == {}


def test_the_copier_logs_a_summary_of_its_counts(monkeypatch, caplog):
    """Every SUMMARY_EVERY copied requests the log says what the copier did (benchmarks run
    without --enable-metrics)."""
    import logging

    from sglang_pic.position_free import moved_copies

    monkeypatch.setattr(moved_copies, "SUMMARY_EVERY", 1)
    copier, table, *_ = _copier(pool_slots=64)
    table[8:16] = torch.arange(8, dtype=torch.int32)
    rows = copier.req_to_token
    rows[0, :12] = torch.tensor([4, 5, 6, 7, *range(8, 16)], dtype=torch.int32)
    table[4:8] = torch.arange(4, dtype=torch.int32)
    req = SimpleNamespace(pic_segments=[object()], req_pool_idx=0, prefix_indices=rows[0])
    with caplog.at_level(logging.INFO, logger=moved_copies.__name__):
        copier.prepare([req], [12])
    assert "copied_requests 1, copied_tokens 8, reused_copy_tokens 0" in caplog.text
    assert "1 shared copies live" in caplog.text


def test_a_batch_of_moved_span_requests_is_read_from_the_device_once(monkeypatch):
    """The batch's lookup (which pages moved, and the slots and shifts the copies are keyed by)
    is one device-to-host read for all new span requests; a read per request waited for the
    previous request's copy kernel each time. The copies are the same as one at a time."""
    from sglang_pic.position_free import moved_copies

    copier, table, k, v, cache = _copier(pool_slots=64)
    table[8:16] = torch.arange(8, dtype=torch.int32)  # a span computed alone from 0
    table[4:8] = torch.arange(4, dtype=torch.int32)
    table[0:4] = torch.arange(4, 8, dtype=torch.int32)  # a piece in place at 4-7
    rows = copier.req_to_token
    rows[0, :12] = torch.tensor([4, 5, 6, 7, *range(8, 16)], dtype=torch.int32)  # moved by 4
    rows[1, :16] = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3, *range(8, 16)], dtype=torch.int32)  # 8
    reqs = [SimpleNamespace(pic_segments=[object()], req_pool_idx=i, prefix_indices=rows[i])
            for i in range(2)]
    shared = [b[8:16].clone() for b in k]
    reads = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **kw: reads.append(t.numel())
                        or real_cpu(t, *a, **kw))
    copier.prepare(reqs, [12, 16])
    assert len(reads) == 1
    a, b = (getattr(r, moved_copies.ATTR) for r in reqs)
    assert isinstance(a, moved_copies.MovedCopy) and isinstance(b, moved_copies.MovedCopy)
    assert table[a.slots].tolist() == list(range(4, 12))
    assert table[b.slots].tolist() == list(range(8, 16))
    for layer in range(2):
        torch.testing.assert_close(k[layer][a.slots], turn_keys_expected(shared[layer], cache))
        torch.testing.assert_close(
            k[layer][b.slots],
            moved_copies.turn_keys(shared[layer], torch.full((8,), 8), cache))
