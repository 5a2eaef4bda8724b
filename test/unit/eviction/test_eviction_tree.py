"""The tree our policies run on where SGLang's default tree orders evictions natively
(``sglang_pic.eviction.tree``, SGLang 0.5.23): a device-only cache on one of our policies is
SGLang's ``RadixCache`` with the policy as its strategy; with HiCache (and for ``tlru``) it is
``UnifiedRadixCache`` on its Python tree core, which orders evictions by our policy and whose
events reach it (``eviction.unified_hooks``: matches, inserts, splits, evictions, demotions,
write-through copies, access times in seconds; HiCache's host tier end to end is the ``sae``
HiCache server test); SGLang's own policies keep SGLang's choice; a setting that needs another
tree is refused in one line naming it."""

from __future__ import annotations

import importlib.util
import time
from types import SimpleNamespace

import pytest
import torch

pytestmark = [
    pytest.mark.capability("eviction"),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang.srt.mem_cache.unified_radix_cache") is None,
        reason="the installed SGLang builds RadixCache itself (no UnifiedRadixCache)"),
]


@pytest.fixture(scope="module", autouse=True)
def policies_registered():
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_pic.plugin import register_feature

    register_feature("eviction")
    HookRegistry.apply_hooks()


@pytest.fixture()
def settings(monkeypatch):
    """SGLang's published settings the factory reads, all off (a test turns one on)."""
    from sglang.srt import runtime_context

    memory = SimpleNamespace(enable_lmcache=False, enable_flexkv=False,
                             enable_unified_cache_external_linker=False)
    disagg = SimpleNamespace(disaggregation_decode_retraction_backup=None)
    monkeypatch.setattr(runtime_context, "get_memory", lambda: memory)
    monkeypatch.setattr(runtime_context, "get_disagg", lambda: disagg)
    return SimpleNamespace(memory=memory, disagg=disagg)


def _ctx(policy: str, **flags):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=None, page_size=1,
                             eviction_policy=policy,
                             enable_session_radix_cache=flags.pop("session", False))
    server_args = SimpleNamespace(enable_streaming_session=flags.pop("streaming", False))
    base = dict(params=params, enable_hierarchical_cache=False, disable_radix_cache=False,
                is_hybrid_swa=False, is_hybrid_ssm=False, is_dsa=False, server_args=server_args)
    return SimpleNamespace(**{**base, **flags})


def _sglangs(ctx):
    return ("sglang's choice", ctx)


@pytest.mark.parametrize("policy", ["sae", "auto", "gdsf", "s3fifo"])
def test_a_cache_on_our_policy_is_sglangs_radix_cache_with_it(settings, policy):
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang_pic.eviction.policy import CachePolicy
    from sglang_pic.eviction.tree import around_default_radix_cache_factory

    cache = around_default_radix_cache_factory(_sglangs, _ctx(policy))
    assert type(cache) is RadixCache
    assert isinstance(cache.eviction_strategy, CachePolicy)


@pytest.mark.parametrize("ctx", [_ctx("lru"), _ctx("slru"), _ctx("sae", disable_radix_cache=True)],
                         ids=["lru", "slru", "sae-without-a-cache"])
def test_sglangs_own_policies_and_no_cache_keep_sglangs_tree(settings, ctx):
    from sglang_pic.eviction.tree import around_default_radix_cache_factory

    assert around_default_radix_cache_factory(_sglangs, ctx) == ("sglang's choice", ctx)


@pytest.mark.parametrize("setting, flag", [
    ({"session": True}, "--enable-session-radix-cache"),
    ({"streaming": True}, "--enable-streaming-session"),
    ({"is_hybrid_swa": True}, "a hybrid model"),
    ("lmcache", "--enable-lmcache"),
    ("retraction", "--disaggregation-decode-retraction-backup host_pool"),
])
def test_a_setting_that_needs_another_tree_is_refused_naming_it(settings, setting, flag):
    from sglang_pic.compat.gaps import CapabilityUnavailable
    from sglang_pic.eviction.tree import around_default_radix_cache_factory

    if setting == "lmcache":
        settings.memory.enable_lmcache, setting = True, {}
    elif setting == "retraction":
        settings.disagg.disaggregation_decode_retraction_backup, setting = "host_pool", {}
    with pytest.raises(CapabilityUnavailable) as refused:
        around_default_radix_cache_factory(_sglangs, _ctx("sae", **setting))
    line = str(refused.value)
    assert "\n" not in line and line.startswith("--radix-eviction-policy sae: ") and flag in line


def _has_python_tree_core() -> bool:
    """Whether SGLang's cache parameters choose the unified tree's core (0.5.23; 0.5.17's
    unified tree has one core and is not built for our policies)."""
    from dataclasses import fields

    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    return any(f.name == "tree_core_backend" for f in fields(CacheInitParams))


needs_python_tree_core = pytest.mark.skipif(
    not _has_python_tree_core(), reason="the installed SGLang has no tree_core_backend (0.5.17)")


@pytest.fixture()
def clock_on():
    from sglang_pic.eviction import unified_hooks

    unified_hooks.use_clock()
    yield
    unified_hooks.use_clock(False)


def _params(policy: str, backend: str | None = "python"):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang_pic.eviction.replay.simulator import CountingAllocator

    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=CountingAllocator(), page_size=1,
                             eviction_policy=policy, tree_core_backend=backend)
    params.tree_components = (ComponentType.FULL,)
    return params


def _unified(params):
    """SGLang's factory stand-in: a device-only ``UnifiedRadixCache`` (``init_hicache`` needs a
    KV pool and a cache controller; the server test runs it)."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return UnifiedRadixCache(params)


class _Spy:
    """Records the policy's callbacks (their names and first arguments), calling through."""

    def __init__(self, strategy, monkeypatch) -> None:
        self.calls: list[tuple[str, object]] = []
        for name in ("on_split", "on_evict", "on_demote", "on_hit", "on_insert", "begin_evict",
                     "end_evict"):
            real = getattr(strategy, name)

            def record(*args, _name=name, _real=real, **kwargs):
                self.calls.append((_name, args[0] if args else None))
                return _real(*args, **kwargs)

            monkeypatch.setattr(strategy, name, record)

    def names(self, name: str) -> list:
        return [arg for n, arg in self.calls if n == name]


def _insert(cache, rid: str, ids: list[int], slots: torch.Tensor):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction import context as ctxmod

    ctx = ctxmod.RequestContext(session_id=rid, app_type=None, segments=[],
                                decode_start=len(ids), prompt_len=len(ids), rid=rid)
    with ctxmod.using(ctx):
        return cache.insert(InsertParams(key=RadixKey(ids, None), value=slots))


@needs_python_tree_core
@pytest.mark.parametrize("policy, hicache", [("sae", True), ("gdsf", True), ("tlru", False)])
def test_the_factory_builds_the_python_tree_core_with_our_policy(settings, policy, hicache,
                                                                clock_on):
    from sglang_pic.eviction.policy import CachePolicy
    from sglang_pic.eviction.tree import around_default_radix_cache_factory

    ctx = _ctx(policy, enable_hierarchical_cache=hicache)
    ctx.params = _params(policy, backend=None)
    seen = []

    def sglangs(ctx):
        seen.append(ctx.params.tree_core_backend)
        return _unified(ctx.params)

    cache = around_default_radix_cache_factory(sglangs, ctx)
    assert seen == ["python"]  # asked for before SGLang picks its core (Rust by default)
    assert type(cache.tree_core).__name__ == "UnifiedTreeCore"
    assert isinstance(cache.tree_core.eviction_strategy, CachePolicy)


@needs_python_tree_core
def test_a_native_tree_core_is_refused_naming_it(settings, clock_on):
    from sglang_pic.compat.gaps import CapabilityUnavailable
    from sglang_pic.eviction.tree import around_default_radix_cache_factory

    ctx = _ctx("sae", enable_hierarchical_cache=True)
    native = SimpleNamespace(tree_core=SimpleNamespace())
    with pytest.raises(CapabilityUnavailable, match="tree core SimpleNamespace"):
        around_default_radix_cache_factory(lambda ctx: native, ctx)


@needs_python_tree_core
def test_the_policy_sees_splits_evictions_and_orders_them(monkeypatch, clock_on):
    """Two requests share 4 tokens: the second splits the first's node (``on_split``: head and
    tail). An evict pass is one ``begin_evict`` / ``end_evict``, each removed block an
    ``on_evict``; the core evicts in the policy's ``get_priority`` order; access times are
    seconds of the monotonic clock."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    t0 = time.monotonic()
    cache = _unified(_params("gdsf"))
    strategy = cache.tree_core.eviction_strategy
    spy = _Spy(strategy, monkeypatch)
    _insert(cache, "r0", list(range(8)), torch.arange(8))
    _insert(cache, "r1", [0, 1, 2, 3, 50, 51, 52, 53], torch.arange(100, 108))
    splits = [c for c in spy.calls if c[0] == "on_split"]
    assert len(splits) == 1
    root = cache.root_node
    shared = root.children[0]
    assert [int(t) for t in shared.key.token_ids] == [0, 1, 2, 3] and len(shared.children) == 2
    assert splits[0][1] is shared  # the head: the shared part, parent of the old node's tail
    assert t0 <= shared.last_access_time <= time.monotonic()  # seconds, not SGLang's counter

    victims = []
    monkeypatch.setattr(strategy, "get_priority", lambda node: (
        victims.append(node) or (0 if node.key.token_ids[0] == 50 else 1)))
    got = cache.evict(EvictParams(num_tokens=4))
    assert got.num_tokens_evicted == 4
    evicted = spy.names("on_evict")
    assert [list(n.key.token_ids) for n in evicted] == [[50, 51, 52, 53]]  # the lower priority
    assert len(spy.names("begin_evict")) == 1 and len(spy.names("end_evict")) == 1
    assert victims  # the core asked our policy


@needs_python_tree_core
def test_a_match_is_reported_as_hits_when_its_request_is_cached(monkeypatch, clock_on):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache = _unified(_params("sae"))
    spy = _Spy(cache.tree_core.eviction_strategy, monkeypatch)
    _insert(cache, "r0", list(range(8)), torch.arange(8))
    req = SimpleNamespace(rid="r1", session=None)
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(range(8)) + [9], None),
                                                 req=req))
    assert isinstance(match.last_device_node, int)  # 0.5.23 hands out node ids
    assert spy.names("on_hit") == []  # kept until the request is cached
    _insert(cache, "r1", list(range(8)) + [9], torch.arange(200, 209))
    hit = cache.resolve_node_handle(match.last_device_node)
    assert spy.names("on_hit") == [hit]


def test_a_demotion_is_on_demote():
    from sglang_pic.eviction import unified_hooks
    from sglang_pic.eviction.policy import CachePolicy

    calls = []

    class Policy(CachePolicy):
        def get_priority(self, node):
            return 0

        def on_demote(self, node):
            calls.append(node)

    core = SimpleNamespace(eviction_strategy=Policy())
    node = object()
    assert unified_hooks.around_demote(lambda self, n, *a: "done", core, node, {}) == "done"
    assert calls == [node]


def test_write_through_copies_the_chain_up_to_the_first_block_the_policy_declines():
    """A write-through ``BackupKV`` chain (root first): the policy declines the third block, so
    the first two are copied and the rest wait for their next insert; a chain it declines at
    once copies nothing; a ``write_back`` copy is not asked."""
    from sglang.srt.mem_cache.unified_cache.cache_action import BackupKV
    from sglang_pic.eviction import unified_hooks
    from sglang_pic.eviction.policy import CachePolicy

    root = SimpleNamespace(key=[], parent=None)
    chain, parent = [], root
    for i in range(4):
        node = SimpleNamespace(key=[0] * 4, parent=parent, backuped=i == 0, n=i)
        chain.append(node)
        parent = node

    class Policy(CachePolicy):
        asked: list = []

        def get_priority(self, node):
            return 0

        def worth_host_copy(self, node, ctx=None, offset=0):
            self.asked.append((node.n, offset))
            return node.n != 2 and node.n != 5

    cache = SimpleNamespace(tree_core=SimpleNamespace(eviction_strategy=Policy()), root_node=root,
                            buffer_pipeline=None, resolve_node_handle=lambda i: chain[i])
    copied = []

    def sglangs(self, action, write_back=False):
        copied.append(list(action.node_ids))
        return 4 * len(action.node_ids)

    assert unified_hooks.around_kv_backup(sglangs, cache, BackupKV(node_ids=[0, 1, 2, 3])) == 8
    assert copied == [[0, 1]]
    assert Policy.asked == [(1, 4), (2, 8)]  # block 0 has its copy; depth types a new block
    copied.clear()
    assert unified_hooks.around_kv_backup(sglangs, cache, BackupKV(node_ids=[2, 3])) == 0
    assert copied == []
    assert unified_hooks.around_kv_backup(sglangs, cache, BackupKV(node_ids=[2, 3]),
                                          write_back=True) == 8
    assert copied == [[2, 3]]


@needs_python_tree_core
def test_a_sampling_policy_scores_samples_and_still_frees_what_the_pass_needs(monkeypatch,
                                                                              clock_on):
    """``sae`` with a sample of 2 leaves over 6: the walk's heap starts from 2 scored leaves
    (not all 6), and a pass that needs 4 leaves' tokens gets them from new samples when a
    sample runs dry."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = _unified(_params("sae"))
    strategy = cache.tree_core.eviction_strategy
    strategy.sample_size = 2
    for i in range(6):
        _insert(cache, f"r{i}", [100 * i + j for j in range(4)], torch.arange(4 * i, 4 * i + 4))
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    full = cache.tree_core.components_by_type[ComponentType.FULL]
    scored = []
    real = strategy.get_priority
    monkeypatch.setattr(strategy, "get_priority", lambda node: scored.append(node) or real(node))
    full._ensure_eviction_strategy()
    full.session_ref_eviction_strategy = None  # bound again, to the spy
    full._evict_device_start(16)
    assert len(scored) == 2 and len(full._evict_device_heap) == 2
    full._evict_device_end()
    scored.clear()
    got = cache.evict(EvictParams(num_tokens=16))
    assert got.num_tokens_evicted == 16 and cache.evictable_size() == 8
    assert len(scored) == 4  # two samples of 2 (all 6 leaves without sampling)
