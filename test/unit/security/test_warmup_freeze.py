"""SGLang 0.5.23's post-warm-up GC freeze runs in process (``frontdoor.warmup``), not through
``/freeze_gc``, which the front door serves to the admin key only."""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace

from sglang_pic.frontdoor import warmup


class _Manager:
    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.event_loop = loop
        self.frozen_on: list[int] = []

    async def freeze_gc(self) -> None:
        self.frozen_on.append(threading.get_ident())


def test_the_freeze_runs_on_the_managers_event_loop(monkeypatch):
    from sglang.srt.entrypoints import http_server

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        manager = _Manager(loop)
        monkeypatch.setattr(http_server, "_global_state",
                            SimpleNamespace(tokenizer_manager=manager), raising=False)
        warmup.freeze_gc_in_process(server_args=None)
        assert manager.frozen_on == [runner.ident]  # once, on the loop's thread
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=10)
        loop.close()


def test_without_an_event_loop_the_freeze_is_skipped_with_a_warning(monkeypatch, caplog):
    from sglang.srt.entrypoints import http_server

    manager = _Manager(None)
    monkeypatch.setattr(http_server, "_global_state", SimpleNamespace(tokenizer_manager=manager),
                        raising=False)
    with caplog.at_level(logging.WARNING, logger=warmup.__name__):
        warmup.freeze_gc_in_process(server_args=None)
    assert manager.frozen_on == [] and "no event loop" in caplog.text
