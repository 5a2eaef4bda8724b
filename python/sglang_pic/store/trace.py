"""``--ptstore-trace``'s lines: ``[ptstore-trace] <event> at <wall clock>: <details>``.

Several threads of one scheduler process write them (HiCache's prefetch and backup threads
through the backend, the scheduler thread through ``prefetch_trace``): ``print`` writes the text
and its newline in two calls, so two lines could interleave. One ``write`` per line keeps each
whole for ``benchmark/store/bench_store_ttft.py``, which parses them.
"""

from __future__ import annotations

import sys


def trace(event: str, wall: float, details: str) -> None:
    """One whole trace line on stderr."""
    sys.stderr.write(f"[ptstore-trace] {event} at {wall:.3f}: {details}\n")
    sys.stderr.flush()
