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

The hooks (the ``secret-redaction`` rows of ``sglang_pic.compat``): ``redact_repr`` replaces the
secrets' values in ``ServerArgs.__repr__``'s text; ``redact_config`` their fields in
``TokenizerManager.resolved_config_dict`` and each scheduler's
``RuntimeContext.resolved_server_args_dict``; ``redacted_dump`` builds request and crash dumps,
which pickle ``ServerArgs`` itself and the launch command line, from redacted copies of both.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

SECRET_FIELDS = ("api_key", "admin_api_key", "ssl_keyfile_password",
                 "hicache_storage_backend_extra_config")
"""``ServerArgs`` fields that hold secrets (a HiCache storage backend's extra config is the
backend's own: a third-party backend's credentials go there)."""
REDACTED = "<redacted>"


def redact_config(config: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``config`` (a ``ServerArgs`` as a dict) with every secret that is set replaced."""
    out = dict(config)
    for name in SECRET_FIELDS:
        if out.get(name):
            out[name] = REDACTED
    return out


def redact_server_info(info: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """AFTER ``build_server_info`` (SGLang 0.5.23's ``/server_info``): the resolved fields as
    ``redact_config`` leaves them, and ``launch_command`` (the argv SGLang parsed, where the API
    key handed over in memory is ``--api-key KEY``; SGLang joins it with spaces) with the
    secrets' values replaced."""
    out = redact_config(info)
    command = out.get("launch_command")
    if isinstance(command, str):
        out["launch_command"] = " ".join(redact_argv(command.split(" ")))
    return out


def redact_repr(original: Any, server_args: Any) -> str:
    """``repr(server_args)`` with the secrets' values replaced."""
    text = original(server_args)
    for name in SECRET_FIELDS:
        value = getattr(server_args, name, None)
        if value:
            text = text.replace(f"{name}={value!r}", f"{name}={REDACTED!r}")
    return text


SECRET_FLAGS = tuple("--" + name.replace("_", "-") for name in SECRET_FIELDS)


def redact_argv(argv: list[str]) -> list[str]:
    """``argv`` with the values of ``--api-key``, ``--admin-api-key`` and
    ``--ssl-keyfile-password`` replaced (``--flag VALUE`` and ``--flag=VALUE``)."""
    out = list(argv)
    for i, arg in enumerate(out):
        name, eq, _ = arg.partition("=")
        if name in SECRET_FLAGS and eq:
            out[i] = f"{name}={REDACTED}"
        elif arg in SECRET_FLAGS and i + 1 < len(out):
            out[i + 1] = REDACTED
    return out


def redacted_server_args(server_args: Any) -> Any:
    """A shallow copy of ``server_args`` with every secret that is set replaced, or None when
    it cannot be copied (the dump then holds no ``ServerArgs``, as SGLang's own fallback for
    arguments that do not pickle). ``ServerArgs`` refuses assignments once resolved: 0.5.17's
    dataclass copy is ours, so its fields are set past that guard; 0.5.23's msgspec record is
    copied with the secrets replaced (``msgspec.structs.replace``)."""
    try:
        secrets = {name: REDACTED for name in SECRET_FIELDS if getattr(server_args, name, None)}
        if hasattr(type(server_args), "__struct_fields__"):  # 0.5.23: a msgspec record
            import msgspec

            return msgspec.structs.replace(server_args, **secrets)
        out = copy.copy(server_args)
        for name, value in secrets.items():
            object.__setattr__(out, name, value)
    except Exception:  # never let a dump take the tokenizer's output loop down
        return None
    return out


def redacted_dump(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """Build a request or crash dump from redacted ``ServerArgs`` and command line: SGLang
    pickles ``manager.server_args`` and ``" ".join(sys.argv)`` into the file. Both are put back
    before the call returns (the dump's writing thread has its dict by then)."""
    real_args, real_argv = manager.server_args, sys.argv
    manager.server_args = redacted_server_args(real_args)
    sys.argv = redact_argv(real_argv)
    try:
        return original(manager, *args, **kwargs)
    finally:
        manager.server_args, sys.argv = real_args, real_argv

