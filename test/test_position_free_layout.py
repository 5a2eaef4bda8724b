"""The shifted KV layout's bookkeeping, without a model: recorded positions, which batches are
marked, which backend a batch goes to, and that marked batches stay off the CUDA graphs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang_pic.position_free import shifted_batches, span_graphs, stored_positions
from sglang_pic.position_free.backends import PositionFreeFlashInferBackend


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

    span, plain = SimpleNamespace(pic_shifted=True), SimpleNamespace(pic_shifted=False)
    can_run = span_graphs.around_can_run_graph
    # pic_triton: its graphs hold the shift-aware kernels every batch needs
    original, calls = _graph_calls()
    assert can_run(original, _runner(DecodeCudaGraphRunner, object()), span) and calls == [span]
    # pic_flashinfer without the second set: FlashInfer's graphs only for unmarked batches
    twin = _twin(span_graphs=False)
    original, calls = _graph_calls()
    assert can_run(original, _runner(DecodeCudaGraphRunner, twin), span) is False and not calls
    assert can_run(original, _runner(DecodeCudaGraphRunner, twin), plain) and calls == [plain]
    # with it: a shifted decode batch replays the second set, a prefill graph never
    twin = _twin(span_graphs=True)
    original, calls = _graph_calls()
    assert can_run(original, _runner(DecodeCudaGraphRunner, twin), span) and twin.replay_shifted
    assert twin._pick(SimpleNamespace()) == "triton"  # the runner's view of the batch
    assert can_run(original, _runner(PrefillCudaGraphRunner, twin), span) is False
    assert can_run(original, _runner(DecodeCudaGraphRunner, twin), plain)
    assert not twin.replay_shifted and twin._pick(SimpleNamespace()) == "flashinfer"


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


def test_the_table_is_made_once_per_pool():
    first = stored_positions.allocate(16, "cpu")
    assert stored_positions.allocate(8, "cpu") is first  # a second backend of the same pool
    assert stored_positions.allocate(32, "cpu").numel() == 32  # a larger pool

