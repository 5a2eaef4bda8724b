"""The shifted KV layout's bookkeeping, without a model: recorded positions, which batches are
marked, which backend a batch goes to, and that marked batches stay off the CUDA graphs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang_pic.position_free import shifted_batches, stored_positions
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


def test_a_batch_holding_a_span_request_is_shifted_and_runs_without_graphs():
    stored_positions.allocate(8, "cpu")
    fb = _forward_batch([1], [5])
    plain, span = SimpleNamespace(), SimpleNamespace(pic_segments=[object()])
    shifted_batches.mark_forward_batch(fb, None, SimpleNamespace(reqs=[plain, span]))
    assert shifted_batches.is_shifted(fb)
    calls = []

    def original(runner, forward_batch):
        calls.append(forward_batch)
        return True

    assert shifted_batches.no_graph_for_shifted(original, object(), fb) is False
    assert calls == []  # the graph runner's own checks are not even asked
    dense = _forward_batch([2], [6])
    shifted_batches.mark_forward_batch(dense, None, SimpleNamespace(reqs=[plain]))
    assert shifted_batches.no_graph_for_shifted(original, object(), dense) is True


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
    backend = object.__new__(PositionFreeFlashInferBackend)
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
