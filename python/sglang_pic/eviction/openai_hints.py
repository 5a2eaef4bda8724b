"""Session hints from the OpenAI fields clients already send.

``sae`` scores a conversation's blocks by when its session comes back, which it can only know
when requests name their session (``custom_params.session_id``, docs/eviction.md). OpenAI's API
already has fields that group requests, which SDKs and gateways send without knowing about us:

* ``prompt_cache_key``: "used to cache responses for similar requests", a key the client keeps
  per conversation or per shared prefix: the best session hint there is;
* ``safety_identifier`` (and the older ``user``): one end user, whose requests are one
  requester to the cache (several conversations, but one person's).

``with_session_hint`` turns the first of them present into ``custom_params.session_id`` (a hint
the client set itself there wins) and removes ``prompt_cache_key`` and ``safety_identifier``,
which SGLang's request models do not take. The front door applies it to the OpenAI completion
routes before their schema is checked.
"""

from __future__ import annotations

from typing import Any

HINT_FIELDS = ("prompt_cache_key", "safety_identifier", "user")
"""Fields read as the session, first present wins."""
DROPPED = ("prompt_cache_key", "safety_identifier")
"""Fields SGLang's models do not have: read here, then removed."""
MAX_HINT_CHARS = 256


def with_session_hint(body: Any) -> Any:
    """``body`` with its session hint in ``custom_params`` (a new dict), or ``body`` itself when
    it carries none. A hint that is not a string of 1-256 characters raises ``ValueError``."""
    if not isinstance(body, dict) or not any(k in body for k in HINT_FIELDS):
        return body
    session = None
    for name in HINT_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not 0 < len(value) <= MAX_HINT_CHARS:
            raise ValueError(f"{name!r} must be a string of 1 to {MAX_HINT_CHARS} characters")
        session = session or value
    out = {k: v for k, v in body.items() if k not in DROPPED}
    custom = out.get("custom_params")
    if custom is not None and not isinstance(custom, dict):
        return out  # the schema refuses it
    if session is not None and not (custom or {}).get("session_id"):
        out["custom_params"] = {**(custom or {}), "session_id": session}
    return out
