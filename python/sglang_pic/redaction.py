"""Secrets in SGLang's ``ServerArgs`` kept out of what SGLang shows: its log and ``/server_info``.

SGLang 0.5.17 shows every ``ServerArgs`` field, its secrets included:

- its launcher logs ``server_args=ServerArgs(..., api_key='...', ...)`` at start
  (``Engine._launch_subprocesses``), which ends up in log files and terminals others may read;
- ``/server_info`` (and the deprecated ``/get_server_info``) returns the tokenizer manager's
  ``resolved_config_dict`` and, under ``internal_states``, each scheduler's
  ``resolved_server_args_dict``: any client holding the API key read ``admin_api_key`` there,
  the key that should keep the admin endpoints from it; request dumps snapshot the same dict.

So those three are wrapped, and a secret that is set is shown as ``REDACTED`` (one not set stays
``None``, so the answer still says whether a key is set). SGLang itself keeps reading the real
values from ``ServerArgs``: only what it prints or returns changes.

| SGLang seam | hook |
|---|---|
| ``ServerArgs.__repr__`` | AROUND: the secrets' values replaced in the text |
| ``TokenizerManager.resolved_config_dict`` | AFTER: the secrets' fields replaced |
| ``RuntimeContext.resolved_server_args_dict`` | AFTER: the same, in each scheduler |
"""

from __future__ import annotations

from typing import Any

SECRET_FIELDS = ("api_key", "admin_api_key", "ssl_keyfile_password")
"""``ServerArgs`` fields that hold secrets."""
REDACTED = "<redacted>"


def redact_config(config: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``config`` (a ``ServerArgs`` as a dict) with every secret that is set replaced."""
    out = dict(config)
    for name in SECRET_FIELDS:
        if out.get(name):
            out[name] = REDACTED
    return out


def redact_repr(original: Any, server_args: Any) -> str:
    """``repr(server_args)`` with the secrets' values replaced."""
    text = original(server_args)
    for name in SECRET_FIELDS:
        value = getattr(server_args, name, None)
        if value:
            text = text.replace(f"{name}={value!r}", f"{name}={REDACTED!r}")
    return text


HOOKS = [
    ("sglang.srt.server_args.ServerArgs.__repr__", redact_repr, "AROUND"),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager.resolved_config_dict",
     redact_config, "AFTER"),
    ("sglang.srt.runtime_context.RuntimeContext.resolved_server_args_dict", redact_config,
     "AFTER"),
]
"""(SGLang target, hook, HookType name)."""


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in HOOKS:
        HookRegistry.register(target, hook, HookType[kind])
