"""``compat.request_state``: a request's KV fields read and written where the installed SGLang
keeps them (on the ``Req`` up to 0.5.17, in ``req.kv`` from 0.5.23)."""

from __future__ import annotations

import types

from sglang_pic.compat import request_state


def test_the_installed_release_is_read_where_a_real_request_keeps_the_fields():
    """A real ``Req`` of the installed SGLang: the row and the protected length SGLang itself
    set are what the accessors read, and a write is what SGLang then reads."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("r", "hi", [1, 2, 3], SamplingParams(max_new_tokens=1))
    # where SGLang's constructor put the row: on the request, or in its ``kv``
    holder = req if hasattr(req, "req_pool_idx") else req.kv
    holder.req_pool_idx, holder.cache_protected_len = 3, 16
    assert request_state.pool_row(req) == 3 and request_state.protected_len(req) == 16
    request_state.set_protected_len(req, 32)
    assert holder.cache_protected_len == 32


def test_a_release_with_req_kv_is_read_and_written_there(monkeypatch):
    """Where the fields live in ``req.kv``, a write lands there and adds no attribute of the
    old name to the request (which that release would never read)."""
    monkeypatch.setattr(request_state, "_kv_info_on_req", lambda: True)
    req = types.SimpleNamespace(kv=types.SimpleNamespace(req_pool_idx=5, cache_protected_len=8))
    assert request_state.pool_row(req) == 5 and request_state.protected_len(req) == 8
    request_state.set_protected_len(req, 24)
    assert req.kv.cache_protected_len == 24 and not hasattr(req, "cache_protected_len")
