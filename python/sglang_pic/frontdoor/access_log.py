"""uvicorn's access log with request targets cut to ``MAX_LOGGED_TARGET`` characters.

Why: uvicorn logs each request's path and query string whole, and ``/health`` needs no key, so
anyone could grow the log by a byte for every byte sent (60 KB query strings: 333 MB of log in
10 s). A target longer than the bound is logged as its first ``MAX_LOGGED_TARGET`` characters
and its length.
"""

from __future__ import annotations

import logging

MAX_LOGGED_TARGET = 512
ACCESS_LOGGER = "uvicorn.access"


class ShortTargets(logging.Filter):
    """Cuts the target of uvicorn's access records (``'%s - "%s %s HTTP/%s" %d'``: client,
    method, target, version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) \
                and len(args[2]) > MAX_LOGGED_TARGET:
            target = f"{args[2][:MAX_LOGGED_TARGET]}... ({len(args[2])} chars)"
            record.args = (*args[:2], target, *args[3:])
        return True


def install() -> None:
    """Add the filter to uvicorn's access logger, once."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, ShortTargets) for f in logger.filters):
        logger.addFilter(ShortTargets())
