"""What a span-cache server does for requests without spans beyond vanilla SGLang, without a model.

``benchmark/bench_nonspan_overhead.py`` (H200) measured a span-cache server (``pic_flashinfer`` +
``pic_span``) serving plain requests 9-10 % slower than vanilla SGLang at 32 x 8K and 256 x 1K
context. Its TPOT is a whole ``generate`` call over 32 decode steps, so both kinds of work count:

* per decode step, on the scheduler thread the overlap scheduler needs free to prepare the next
  step: the ``ForwardBatch.init_new`` hook (``shifted_batches.mark_forward_batch``), the copier's
  ``retry``, the output-stream hook (``spans._hide_span_prefills``), the CUDA-graph hooks;
* per request, on the tokenizer's thread before the batch reaches the scheduler: the span
  resolver's and the request validation's pass over every prompt's ids.

Each test asserts the work that must not happen for requests without spans (a request looked at,
a device-to-host read, a prompt scanned twice) against a stand-in that records it, and that a
batch which does hold a span request is still found; so the overhead cannot creep back unseen.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang_pic.position_free import moved_copies, shifted_batches, stored_positions

PAGE = 4


class _Watched:
    """A request stand-in that records the name of every attribute read from it."""

    def __init__(self, log: list, **fields) -> None:
        object.__setattr__(self, "_log", log)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __getattribute__(self, name: str):
        if not name.startswith("__"):
            object.__getattribute__(self, "_log").append(name)
        return object.__getattribute__(self, name)


@contextlib.contextmanager
def _no_device_reads(monkeypatch):
    """Any read of a tensor's values into Python (what waits for the GPU there) raises."""

    def refuse(*args, **kwargs):
        raise AssertionError("a device-to-host read on a decode step without spans")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
            m.setattr(torch.Tensor, name, refuse)
        yield


class _Allocator:
    def __init__(self, size: int) -> None:
        self.size, self.page_size = size, PAGE
        self.free_pages = list(range(16 // PAGE, size // PAGE))

    def available_size(self) -> int:
        return len(self.free_pages) * PAGE

    def alloc(self, n: int) -> torch.Tensor | None:
        pages = n // PAGE
        if pages > len(self.free_pages):
            return None
        taken, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        return (torch.tensor(taken)[:, None] * PAGE + torch.arange(PAGE)).flatten()

    def free(self, slots: torch.Tensor) -> None:
        self.free_pages += sorted({int(s) // PAGE for s in slots.tolist()})


@pytest.fixture
def copier(monkeypatch):
    """The process's copier, as ``pic_flashinfer`` starts one (``--span-copy-on-reuse auto``),
    over a CPU pool of 64 slots; the stored-position table is the process's (its slots from
    128 on take the decode steps' new keys)."""
    stored_positions.reset()
    slots = 64
    stored_positions.allocate(256, "cpu")
    k = [torch.randn(slots, 2, 16) for _ in range(2)]
    v = [torch.randn(slots, 2, 16) for _ in range(2)]
    pool = SimpleNamespace(start_layer=0, layer_num=2, get_key_buffer=lambda i: k[i],
                           get_value_buffer=lambda i: v[i])
    runner = SimpleNamespace(token_to_kv_pool=pool, token_to_kv_pool_allocator=_Allocator(slots),
                             req_to_token_pool=SimpleNamespace(
                                 req_to_token=torch.zeros(4, 32, dtype=torch.int32)))
    half = torch.randn(128, 8)
    made = moved_copies.MovedPageCopier(
        runner, SimpleNamespace(cos_sin_cache=torch.cat([half.cos(), half.sin()], dim=-1)),
        use_kernel=False)
    monkeypatch.setattr(moved_copies, "_copier", made)
    monkeypatch.setattr(shifted_batches, "_started", True)
    yield made
    stored_positions.reset()


def _decode(reqs: list, first_slot: int = 128) -> SimpleNamespace:
    """A decode batch as ``ForwardBatch.init_new`` builds it: one new key per request."""
    n = len(reqs)
    batch = SimpleNamespace(out_cache_loc=torch.arange(first_slot, first_slot + n),
                            positions=torch.arange(n) + 100, forward_mode=ForwardMode.DECODE,
                            seq_lens_cpu=torch.full((n,), 101))
    shifted_batches.mark_forward_batch(batch, None, SimpleNamespace(reqs=reqs))
    return batch


def _shared_span_request(copier) -> SimpleNamespace:
    """A span request that reads moved keys for its whole life: one of them is in its partial
    last page, which cannot be copied (``moved_copies.SHARED``)."""
    row = copier.req_to_token[1]
    row[:6] = torch.tensor([4, 5, 6, 7, 8, 9], dtype=torch.int32)
    table = stored_positions.table()
    table[4:8] = torch.arange(4, dtype=torch.int32)
    table[8:10] = torch.tensor([0, 1], dtype=torch.int32)  # computed at 0-1, read at 4-5
    req = SimpleNamespace(pic_segments=[object()], req_pool_idx=1, prefix_indices=row[:6])
    extend = SimpleNamespace(out_cache_loc=torch.tensor([30]), positions=torch.tensor([6]),
                             forward_mode=ForwardMode.EXTEND, extend_prefix_lens_cpu=[6])
    shifted_batches.mark_forward_batch(extend, None, SimpleNamespace(reqs=[req]))
    assert getattr(req, moved_copies.ATTR) == moved_copies.SHARED and extend.pic_shifted
    return req


def test_a_decode_step_without_spans_reads_no_request_and_nothing_from_the_device(
        copier, monkeypatch):
    """The batch's new keys are recorded (a plain request's pages may later be read by a span
    request), and that is all: the copier's CPU counts say that no request of the process reads
    moved keys, so neither the copier's retry nor the shifted check asks any request, whatever
    the batch size; nothing is read back from the device."""
    for size in (1, 8, 64):
        log: list = []
        reqs = [_Watched(log, rid=f"plain-{i}") for i in range(size)]
        with _no_device_reads(monkeypatch):
            batch = _decode(reqs)
        assert log == [], f"a plain decode batch of {size} looked at its requests: {log[:4]}"
        assert batch.pic_shifted is False and not shifted_batches.current()
        table = stored_positions.table()
        assert table[128:128 + size].tolist() == list(range(100, 100 + size))


def test_while_a_request_reads_shared_pages_batches_are_asked_and_found(copier, monkeypatch):
    """The shortcut is taken only while it gives the per-request answer: with a span request
    reading shared pages somewhere in the process, every batch is asked again (the one holding
    it is shifted, the others are not); once it is released, plain steps ask nobody again."""
    span = _shared_span_request(copier)
    assert copier.reads_shared_anywhere()
    log: list = []
    plain = [_Watched(log, rid=f"plain-{i}") for i in range(4)]
    assert _decode([*plain, span]).pic_shifted is True
    assert _decode(plain).pic_shifted is False and log  # asked: the span request is alive
    copier.release(span)  # it finished (or was retracted: its next extend prepares it again)
    assert not copier.reads_shared_anywhere()
    log.clear()
    with _no_device_reads(monkeypatch):
        assert _decode(plain).pic_shifted is False
    assert log == []


def test_the_copier_counts_every_request_that_reads_shared_pages(copier):
    """``waiting`` / ``shared`` follow each state change (prepare, retry, release), so the
    shortcut above never hides a request that waits for room or cannot be copied."""
    table = stored_positions.table()
    rows = copier.req_to_token
    table[8:16] = torch.arange(8, dtype=torch.int32)  # a span computed alone from 0
    table[4:8] = torch.arange(4, dtype=torch.int32)
    rows[0, :12] = torch.tensor([4, 5, 6, 7, *range(8, 16)], dtype=torch.int32)  # moved by 4
    moved = SimpleNamespace(pic_segments=[object()], req_pool_idx=0, prefix_indices=rows[0, :12])
    free = copier.allocator.free_pages
    copier.allocator.free_pages = []  # no room: it waits, reading the shared pages
    copier.prepare([moved], [12])
    assert isinstance(getattr(moved, moved_copies.ATTR), moved_copies.Waiting)
    assert (copier.waiting, copier.shared) == (1, 0) and copier.reads_shared_anywhere()
    assert _decode([moved]).pic_shifted is True
    copier.allocator.free_pages = free  # room now: the next decode step copies it
    assert _decode([moved]).pic_shifted is False
    assert isinstance(getattr(moved, moved_copies.ATTR), moved_copies.MovedCopy)
    assert (copier.waiting, copier.shared) == (0, 0)
    span = _shared_span_request(copier)
    assert (copier.waiting, copier.shared) == (0, 1)
    copier.release(span)
    copier.release(moved)
    assert (copier.waiting, copier.shared) == (0, 0) and copier.runs == {}


def test_the_stream_hook_looks_at_no_request_until_a_span_prefill_exists():
    """SGLang streams every batch's requests after every step. Unit requests (span prefills)
    exist only once the planner submitted one, so until then the hook hands the batch on
    untouched; afterwards it still hides them."""
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang_pic.spans import _hide_span_prefills
    from sglang_pic.spans import config as span_config
    from sglang_pic.spans.planner import SpanPlanner
    from sglang_pic.spans.segments import Segment

    streamed: list = []

    def stream_output(streamer, reqs, *args, **kwargs):
        streamed.append(list(reqs))

    log: list = []
    reqs = [_Watched(log, rid=f"plain-{i}") for i in range(8)]
    for tree_cache in (SimpleNamespace(), SimpleNamespace(planner=None)):  # no span cache
        _hide_span_prefills(stream_output, SimpleNamespace(tree_cache=tree_cache), reqs, False)
    planner = SpanPlanner(SimpleNamespace(page_size=PAGE), span_config.load())
    streamer = SimpleNamespace(tree_cache=SimpleNamespace(planner=planner))
    _hide_span_prefills(stream_output, streamer, reqs, False)
    assert log == [] and streamed == [reqs] * 3
    # the planner submits a span prefill: from now on its output is hidden
    handled: list = []
    planner.scheduler, planner._handle = None, lambda scheduler, recv: handled.append(recv)
    planner._template = SimpleNamespace(rid=None, input_ids=None, input_text=None,
                                        sampling_params=SamplingParams())
    span = Segment(0, 4, None, 0, 4, True)
    planner._submit_unit("key", [1, 2, 3, 4], span, [span])
    unit = SimpleNamespace(rid=handled[0].rid)
    streamed.clear()
    _hide_span_prefills(stream_output, streamer, [*reqs, unit], False)
    assert streamed == [reqs]


def test_each_prompt_is_scanned_once_per_request(monkeypatch):
    """The span resolver and the request validation (two BEFORE hooks on
    ``TokenizerManager.generate_request``, chained in ``plugin.register``'s order: validation
    registered first, so the resolver runs first) need every prompt's id range; it is computed
    once per prompt, and not kept past the request (the same lists, changed, are checked
    afresh)."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
    from sglang_pic import prompt_ids
    from sglang_pic.security import request_validation
    from sglang_pic.spans.request import SpanRequestResolver, resolve_generate_request

    scanned: list = []
    real = prompt_ids.id_range

    def counting(seq):
        scanned.append(id(seq))
        return real(seq)

    monkeypatch.setattr(prompt_ids, "id_range", counting)
    resolver = SpanRequestResolver.__new__(SpanRequestResolver)
    resolver.enabled, resolver.marker_ids = True, (1000, 1001)  # the added marker tokens
    resolver.cfg = SimpleNamespace(markers=("<|ssep|>", "<|pdep|>"))
    resolver.page_size, resolver.pad_id = PAGE, 0
    manager = SimpleNamespace(_pic_span_resolver=resolver, model_config=SimpleNamespace(
        vocab_size=1000), server_args=SimpleNamespace(radix_cache_backend="pic_span"))

    def generate_request(self, obj):  # SGLang's, after the hooks
        return obj.input_ids

    chain = generate_request
    for hook in (request_validation.check_generate_request, resolve_generate_request):
        chain = _wrap_fn(chain, hook, HookType.BEFORE)
    prompts = [list(range(1, 40)), list(range(500, 900)), [7, 8, 9]]
    obj = SimpleNamespace(text=None, input_ids=prompts, input_embeds=None, rid=None,
                          sampling_params={"max_new_tokens": 4})
    assert chain(manager, obj) == prompts
    assert sorted(scanned) == sorted(id(p) for p in prompts)  # once each
    prompts[1][3] = 5000  # the same list objects again, one id now outside the vocabulary
    with pytest.raises(ValueError, match="5000"):
        chain(manager, obj)


def test_the_graph_hooks_import_nothing_per_step(monkeypatch):
    """``can_run_graph`` and ``_make_graph_key`` run at every decode step (ours, and the sparse
    decoder's, on every server): the classes they test are looked up once, not imported per
    call."""
    import builtins

    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang_pic.position_free import span_graphs
    from sglang_pic.position_free.backends import PositionFreeFlashInferBackend
    from sglang_pic.sparse import graphs

    backend = object.__new__(PositionFreeFlashInferBackend)
    backend.dense, backend.shifted = "flashinfer", "triton"
    backend.span_graphs, backend.capture_shifted, backend.replay_shifted = False, False, False
    runner = object.__new__(DecodeCudaGraphRunner)
    runner.model_runner = SimpleNamespace(attn_backend=backend)
    batch = SimpleNamespace(pic_shifted=False)

    def step():
        assert span_graphs.around_can_run_graph(lambda r, fb: True, runner, batch)
        for hook in (span_graphs.around_make_graph_key, graphs.around_make_graph_key):
            assert hook(lambda r, size, idx, label: (size, label), runner, 8, None, "x") == (8, "x")

    step()  # the first step may import
    imported: list = []
    real_import = builtins.__import__

    def watching(name, *args, **kwargs):
        imported.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", watching)
    step()
    monkeypatch.undo()
    assert imported == []
