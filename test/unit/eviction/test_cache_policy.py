"""The ``CachePolicy`` interface: our policies are policies, SGLang's are adapted, and the hooks
send every event to either without asking what it has."""

from __future__ import annotations

from array import array

import pytest

pytestmark = pytest.mark.capability("eviction")

EVENTS = ("on_request", "on_lookup", "on_store", "on_match", "on_hit", "on_insert", "on_split",
          "on_evict", "on_demote", "begin_evict", "end_evict", "worth_host_copy")


@pytest.fixture(scope="module", autouse=True)
def hooks_registered():
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_pic.plugin import register_feature

    register_feature("eviction")
    HookRegistry.apply_hooks()


def test_every_policy_of_ours_is_a_cache_policy():
    from sglang.srt.mem_cache.utils import get_eviction_strategy
    from sglang_pic.eviction import POLICIES
    from sglang_pic.eviction.policy import CachePolicy, as_policy

    for name in POLICIES:
        strategy = get_eviction_strategy(name)
        assert isinstance(strategy, CachePolicy), name
        assert as_policy(strategy) is strategy  # the object SGLang orders with, as it is


def test_sglangs_policies_are_adapted_with_no_op_events():
    from sglang.srt.mem_cache.evict_policy import LRUStrategy
    from sglang.srt.mem_cache.utils import get_eviction_strategy
    from sglang_pic.eviction.policy import SGLangPolicy, as_policy

    lru = get_eviction_strategy("lru")
    assert isinstance(lru, LRUStrategy)
    policy = as_policy(lru)
    assert isinstance(policy, SGLangPolicy) and policy.strategy is lru

    class Node:
        last_access_time = 3.5

    assert policy.get_priority(Node()) == lru.get_priority(Node())
    node = Node()
    for call in (lambda: policy.on_request(None, 0.0), lambda: policy.on_lookup([1], None, 1),
                 lambda: policy.on_store([1], None, 1, 1), lambda: policy.on_match([node], None),
                 lambda: policy.on_hit(node, 1, None), lambda: policy.on_insert(node, None, 0, True),
                 lambda: policy.on_split(node, node), lambda: policy.on_evict(node),
                 lambda: policy.on_demote(node), policy.begin_evict, policy.end_evict):
        assert call() is None
    assert policy.worth_host_copy(node) is True
    assert policy.sample_size == 0 and not policy.records_offsets
    assert vars(node) == {}  # no event touched the block


def test_a_cache_on_an_sglang_policy_takes_no_events(monkeypatch):
    """A cache on SGLang's own ``lru`` (a server that does not use our policies) goes through
    the hooks without any event or bookkeeping: no policy method runs, no block is marked, and
    it evicts as SGLang does."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.evict_policy import LRUStrategy
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_pic.eviction.context import RequestContext, using
    from sglang_pic.eviction.policy import SGLangPolicy
    from sglang_pic.eviction.shadow import ShadowCache

    seen: list[str] = []
    for event in EVENTS:
        method = getattr(SGLangPolicy, event)

        def record(self, *args, _method=method, _event=event):
            seen.append(_event)
            return _method(self, *args)

        monkeypatch.setattr(SGLangPolicy, event, record)

    tree = ShadowCache("lru", 1)  # SGLang's RadixCache with SGLang's lru, hooked
    cache = tree.cache
    strategy = cache.eviction_strategy
    a = list(range(100, 120))
    for i, tokens in enumerate((a, a[:12] + [7] * 8)):  # the second splits the first node
        ctx = RequestContext(f"s{i}", "chat", [(0, "user")], decode_start=20, prompt_len=20)
        with using(ctx):
            cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), None)))
            tree.store(array("q", tokens), 10**9)  # nothing evicted here
    nodes = list(cache.evictable_leaves)
    cache.evict(EvictParams(num_tokens=40))

    assert cache.eviction_strategy is strategy and isinstance(strategy, LRUStrategy)
    assert cache.evictable_size() == 0
    assert seen == []
    assert all(not hasattr(n, "_pic_seen") and not hasattr(n, "_pic_offset") for n in nodes)
