"""The plugin refuses to start when an SGLang seam a feature needs did not apply."""

from __future__ import annotations

import pytest
import sglang
from plugin_process import refused, run_python
from sglang_pic import compat


def test_missing_hook_target_stops_the_process_naming_symbol_and_feature():
    """A hook whose target moved in SGLang (simulated by deleting it) ends the process with a
    message naming the symbol and our feature; SGLang alone would only log it and serve."""
    err = refused("import sglang.srt.managers.tokenizer_manager as tm\n"
                   "del tm.TokenizerManager.generate_request")
    assert "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request" in err
    assert "needed by request-validation, spans" in err


def test_apply_and_verify_names_a_missing_target():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang_pic.plugin import SeamError, apply_and_verify

    target = "sglang.srt.utils.common.no_such_function_in_sglang"
    HookRegistry.register(target, lambda *a, **k: None, HookType.BEFORE)
    try:
        with pytest.raises(SeamError, match=r"no_such_function_in_sglang \(needed by demo\)"):
            apply_and_verify({target: ["demo"]})
    finally:
        HookRegistry._hooks.pop(target, None)


def test_seam_outside_the_registry_is_checked():
    from sglang_pic import plugin
    from sglang_pic.compat import Seam

    with pytest.raises(plugin.SeamError, match=r"demo.seam \(needed by demo\)"):
        plugin.check_seams([Seam("demo.seam", None, "call", "demo")])


def test_a_feature_that_fails_to_register_stops_the_process():
    """An exception in a feature's registration (an ImportError from a moved SGLang module) is a
    SeamError naming the feature, under SGLang's own plugin loader: it would log and swallow an
    Exception and serve with the features registered before it."""
    err = refused("import sglang_pic.eviction as ev\n"
                   "def broken(): raise ImportError('cannot import name X from sglang.srt.demo')\n"
                   "ev.register = broken")
    assert "refusing to start: feature eviction failed to register: ImportError" in err


def test_every_hook_applies_once_by_default():
    """By default (no condition on) every hook our features register patches its target in the
    pinned SGLang, the registry's own record agrees, and no target is wrapped twice: two AROUND
    hooks of ours on one target make SGLang warn at every start. The span decode steps' graph set
    and the sparse decoder's share one hook per graph-runner method (sglang_pic.graph_sets), with
    --position-free-span-graphs too. (Every row with every condition on: test_compat_seams.)"""
    code = ("from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from sglang.srt.plugins.hook_registry import HookRegistry as H; "
            "print(len(H._hooks), sorted(t for t in H._hooks if t not in H._patched))")
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    count, unpatched = out.stdout.strip().splitlines()[-1].split(" ", 1)
    unconditional = {s.target for s in compat.rows_for(sglang.__version__)
                     if s.kind in compat.HOOK_KINDS and s.condition is None}
    assert unpatched == "[]" and int(count) >= len(unconditional) > 30
    assert f"; {count} hooks verified" in out.stderr
    assert "Multiple AROUND hooks" not in out.stderr
    out = run_python("from sglang.srt.plugins import load_plugins; load_plugins()",
                     {"SGLANG_PIC_SPAN_GRAPHS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hooks verified" in out.stderr and "Multiple AROUND hooks" not in out.stderr
