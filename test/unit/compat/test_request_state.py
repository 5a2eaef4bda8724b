"""``compat.request_state``: a request's KV fields read and written where the installed SGLang
keeps them (on the ``Req`` up to 0.5.17, in ``req.kv`` from 0.5.23)."""

from __future__ import annotations

import types

from sglang_pic.compat import request_state


def test_the_installed_release_is_read_as_it_keeps_the_fields():
    from sglang.srt.managers import schedule_batch

    assert request_state._kv_info_on_req() == hasattr(schedule_batch, "ReqKvInfo")
    req = types.SimpleNamespace(req_pool_idx=3, cache_protected_len=16)
    if not request_state._kv_info_on_req():  # 0.5.17: on the request
        assert request_state.pool_row(req) == 3 and request_state.protected_len(req) == 16
        request_state.set_protected_len(req, 32)
        assert req.cache_protected_len == 32


def test_a_release_with_req_kv_is_read_and_written_there(monkeypatch):
    """Where the fields live in ``req.kv``, a write lands there and adds no attribute of the
    old name to the request (which that release would never read)."""
    monkeypatch.setattr(request_state, "_kv_info_on_req", lambda: True)
    req = types.SimpleNamespace(kv=types.SimpleNamespace(req_pool_idx=5, cache_protected_len=8))
    assert request_state.pool_row(req) == 5 and request_state.protected_len(req) == 8
    request_state.set_protected_len(req, 24)
    assert req.kv.cache_protected_len == 24 and not hasattr(req, "cache_protected_len")
