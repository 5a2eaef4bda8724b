"""SGLang 0.5.23's post-warm-up GC freeze, run in process instead of through an admin route.

After its warm-up request, SGLang 0.5.23 freezes the garbage collector of the HTTP server, the
schedulers and the detokenizer (``gc.freeze``: objects alive at start are left out of every later
collection) by POSTing its own ``/freeze_gc`` with the admin key or, without one, the API key.
``/freeze_gc`` is an admin route here (``frontdoor.endpoints``: a client calling it over and over
would freeze garbage that is never collected), served only to the admin key, which no server has
unless the operator gives one. The call then gets a 403 and SGLang logs a traceback and leaves
the GC unfrozen, unlike vanilla. ``freeze_gc_in_process`` does what the route's handler does, on
the server's event loop, with no HTTP call.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

FREEZE_TIMEOUT_S = 10.0
"""What SGLang's own call waits for the route (its ``requests.post`` timeout)."""


def freeze_gc_in_process(server_args: Any) -> None:
    """REPLACE for ``http_server._freeze_gc_after_server_warmup(server_args)`` (0.5.23): the
    tokenizer manager's ``freeze_gc`` (it asks the schedulers to freeze theirs, then freezes its
    own), run on the manager's event loop from SGLang's warm-up thread."""
    from sglang.srt.entrypoints import http_server

    manager = getattr(http_server._global_state, "tokenizer_manager", None)
    loop = getattr(manager, "event_loop", None)
    if loop is None:
        logger.warning("post-warmup GC freeze skipped: the tokenizer manager has no event loop")
        return
    try:
        asyncio.run_coroutine_threadsafe(manager.freeze_gc(), loop).result(FREEZE_TIMEOUT_S)
    except Exception as e:  # as SGLang's own call: a failed freeze is logged, the server serves
        logger.warning("post-warmup GC freeze failed: %s: %s", type(e).__name__, e)
