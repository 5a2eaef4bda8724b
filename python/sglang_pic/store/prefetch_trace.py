"""With ``--ptstore-trace``: one stderr line when SGLang's scheduler takes a finished prefetch.

The backend's trace (``hicache_backend._traced``) says when a load from the storage tier ended;
the benchmark knows when the first token came. Between the two, SGLang's scheduler must notice
that the prefetch finished (``HiRadixCache.check_prefetch_progress``, asked for each waiting
request on each scheduler pass), insert the loaded pages into the radix tree, copy them to the
GPU and run the prompt's uncached tail. This line splits that time in two: the wait until the
scheduler took the pages (``[ptstore-trace] prefetch_done at <wall clock>: <tokens> tokens``),
and the rest (``benchmark/store/bench_store_ttft.py``'s ``phases_<n>``).

Seam: an AROUND hook on ``HiRadixCache.check_prefetch_progress`` (listed in ``plugin.py``),
registered only with ``--ptstore-trace``.
"""

from __future__ import annotations

import sys
import time

TARGET = "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.check_prefetch_progress"


def around_check_prefetch_progress(original, self, req_id: str, *args, **kwargs):
    """SGLang's check; a trace line when it took a prefetch of this request (the request was
    in ``ongoing_prefetch`` and no longer is)."""
    ongoing = getattr(self, "ongoing_prefetch", {})
    pending = req_id in ongoing
    done = original(self, req_id, *args, **kwargs)
    if pending and done and req_id not in ongoing:
        tokens = getattr(self, "prefetch_loaded_tokens_by_reqid", {}).get(req_id, 0)
        print(f"[ptstore-trace] prefetch_done at {time.time():.3f}: {tokens} tokens",
              file=sys.stderr, flush=True)
    return done


def register() -> None:
    """Hook the check when ``--ptstore-trace`` is on."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_pic.server_flags import setting

    if setting("--ptstore-trace"):
        HookRegistry.register(TARGET, around_check_prefetch_progress, HookType.AROUND)
