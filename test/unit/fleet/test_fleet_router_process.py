"""The router's process takes both keys from the environment, never from its command line."""

from __future__ import annotations

import pytest
from sglang_pic.fleet import router, router_process
from sglang_pic.security.api_key import ENV


@pytest.fixture
def launched(monkeypatch):
    """``launch_router`` replaced: the ``RouterArgs`` it would have served with."""
    import sglang_router.launch_router as launcher

    seen = []
    monkeypatch.setattr(launcher, "launch_router", seen.append)
    return seen


ARGV = router.router_argv("127.0.0.1", 30000, "cache_aware", ["http://127.0.0.1:1"], 29001, [])


def test_the_admin_key_is_an_admin_control_plane_key_apart_from_the_api_key(monkeypatch,
                                                                          launched):
    monkeypatch.setenv(ENV, "client-key-" + "c" * 20)
    monkeypatch.setenv(router_process.CONTROL_ENV, "admin-key-" + "a" * 20)
    assert router_process.main(ARGV) == 0
    (args,) = launched
    assert args.api_key == "client-key-" + "c" * 20
    assert args.control_plane_api_keys == [
        (router_process.CONTROL_KEY_ID, "sglang-pic fleet", "admin-key-" + "a" * 20, "admin")]
    # taken: neither reaches what the router starts
    import os
    assert ENV not in os.environ and router_process.CONTROL_ENV not in os.environ


@pytest.mark.parametrize("missing", [ENV, router_process.CONTROL_ENV])
def test_without_either_key_the_router_does_not_start(monkeypatch, launched, capsys, missing):
    for name in (ENV, router_process.CONTROL_ENV):
        monkeypatch.setenv(name, "k" * 32)
    monkeypatch.delenv(missing)
    assert router_process.main(ARGV) == 2
    assert not launched and f"no key in ${missing}" in capsys.readouterr().err
