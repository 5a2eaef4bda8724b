"""A capability a supported release does not serve yet (``sglang_pic.compat.gaps``) is refused
where it is asked for, in one line naming the feature and the symbol the release lacks; the
release that serves it takes the same flags."""

from __future__ import annotations

import pytest
from sglang_pic import plugin
from sglang_pic.compat import gaps
from sglang_pic.compat.versions import SUPPORTED_SGLANG
from sglang_pic.launcher import serve_conflicts, server_flags
from sglang_pic.launcher.server_flags import UsageError

ASKING = {  # capability -> flags that ask for it
    "spans": ["--enable-span-cache"],
    "eviction": ["--radix-eviction-policy", "sae"],
    "eviction_with_hicache": ["--radix-eviction-policy", "sae", "--enable-hierarchical-cache"],
    "ptstore_trace": ["--ptstore", "tcp://127.0.0.1:1", "--ptstore-trace"],
    "sparse_offload": ["--sparse-decode", "pariskv", "--sparse-threshold", "700",
                       "--sparse-offload"],
}


def _refuse(args: list[str], release: str, monkeypatch) -> None:
    monkeypatch.setattr(serve_conflicts, "installed_sglang", lambda: release)
    serve_conflicts.refuse(*server_flags.parse(args))


# the mechanism on a gap of its own (every supported release serves every capability now)
EXAMPLE = gaps.Gap("0.5.23", "eviction_with_hicache", "eviction",
                   "sglang.srt.mem_cache.hiradix_cache.HiRadixCache", "an example gap")


@pytest.fixture(params=[EXAMPLE, *gaps.GAPS], ids=lambda g: f"{g.release}-{g.capability}")
def gap(request, monkeypatch):
    monkeypatch.setattr(gaps, "GAPS", (*gaps.GAPS, request.param)
                        if request.param not in gaps.GAPS else gaps.GAPS)
    return request.param


def test_every_gap_names_a_supported_release_a_feature_and_what_asks_for_it(gap):
    asked = serve_conflicts._features_on({}, [])
    assert gap.release in SUPPORTED_SGLANG, gap
    assert gap.feature in plugin.FEATURES, gap
    assert gap.capability in asked and gap.capability in ASKING, gap
    assert gap.symbol.startswith("sglang.srt."), gap


def test_the_launcher_refuses_a_gap_in_one_line(gap, monkeypatch):
    with pytest.raises(UsageError) as refused:
        _refuse(ASKING[gap.capability], gap.release, monkeypatch)
    line = str(refused.value.code)
    assert "\n" not in line
    assert f"(feature {gap.feature}) is not available on SGLang {gap.release}" in line
    assert gap.symbol in line and ASKING[gap.capability][-1] in line
    serving = [r for r in SUPPORTED_SGLANG if r != gap.release]
    assert all(r in line for r in serving)  # and says which release serves it


@pytest.mark.parametrize("capability", sorted(ASKING))
def test_a_release_without_the_gap_takes_the_flags(capability, monkeypatch):
    for release in SUPPORTED_SGLANG:
        if gaps.gap(capability, release) is None:
            _refuse(ASKING[capability], release, monkeypatch)  # no UsageError


def test_a_release_is_matched_by_its_numbers(monkeypatch):
    monkeypatch.setattr(gaps, "GAPS", (EXAMPLE,))
    assert gaps.gap("eviction_with_hicache", "0.5.23+cu130") is not None
    assert gaps.gap("eviction_with_hicache", "0.5.17") is None
    assert gaps.gaps_for(None) == ()


def test_the_launcher_names_the_flag_that_turns_hicache_on(monkeypatch):
    monkeypatch.setattr(gaps, "GAPS", (EXAMPLE,))
    with pytest.raises(UsageError, match="--radix-eviction-policy auto with --ptstore"):
        _refuse(["--radix-eviction-policy", "auto", "--ptstore", "tcp://127.0.0.1:1"], "0.5.23",
                monkeypatch)

