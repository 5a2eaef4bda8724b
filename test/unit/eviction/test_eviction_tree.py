"""The tree our policies run on where SGLang's default tree orders evictions natively
(``sglang_pic.eviction.tree``, SGLang 0.5.23): a cache on one of our policies is SGLang's
``RadixCache`` with the policy as its strategy; SGLang's own policies keep SGLang's choice; a
setting that needs the unified tree is refused in one line naming it."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

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


@pytest.mark.parametrize("policy", ["sae", "auto", "gdsf", "s3fifo", "tlru"])
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
    ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
    ({"session": True}, "--enable-session-radix-cache"),
    ({"streaming": True}, "--enable-streaming-session"),
    ({"is_hybrid_swa": True}, "a hybrid model"),
    ("lmcache", "--enable-lmcache"),
    ("retraction", "--disaggregation-decode-retraction-backup host_pool"),
])
def test_a_setting_that_needs_the_unified_tree_is_refused_naming_it(settings, setting, flag):
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
