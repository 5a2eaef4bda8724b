"""The front door's settings in the HTTP server's process, from our flags' hand-off variables
(``server_flags.setting``) and SGLang's ``ServerArgs`` (the admin key, the span cache)."""

from __future__ import annotations

from typing import Any

from sglang_pic.launcher.server_flags import setting

from .middleware import FrontDoorConfig
from .paths import roots


def front_door_config(server_args: Any) -> FrontDoorConfig:
    from sglang_pic.spans.request import span_cache_enabled

    return FrontDoorConfig(
        max_body_bytes=int(setting("--max-request-mb")) << 20,
        body_timeout_s=float(setting("--request-body-timeout-s")),
        admin_api_key=getattr(server_args, "admin_api_key", None) or None,
        admin_path_roots=roots(setting("--admin-path-root") or ()),
        weights_from_tensor=bool(setting("--enable-weights-from-tensor")),
        span_cache=span_cache_enabled(server_args),
        vocab_size=_vocab_size,
    )


def _vocab_size() -> int | None:
    """The served model's vocabulary, from the tokenizer manager of this process (None before
    it exists)."""
    from sglang.srt.entrypoints import http_server

    state = getattr(http_server, "_global_state", None)
    manager = getattr(state, "tokenizer_manager", None)
    config = getattr(manager, "model_config", None)
    size = getattr(config, "vocab_size", None)
    return int(size) if size else None
