"""Seams in SGLang's server arguments: our flags in its launchers, and the secrets it shows."""

from __future__ import annotations

from .seam import Seam

TITLE = "Server arguments"

_ARGS = "sglang.srt.server_args"

ROWS: tuple[Seam, ...] = (
    Seam(f"{_ARGS}.ServerArgs.add_cli_args", "sglang_pic.launcher.sglang_launcher:around_add_cli_args",
         "AROUND", "server-flags",
         why="our flag groups on SGLang's parser, first in `--help`, so SGLang's own launchers "
             "take them too"),
    Seam(f"{_ARGS}.prepare_server_args", "sglang_pic.launcher.sglang_launcher:around_prepare_server_args",
         "AROUND", "server-flags",
         why="our flags taken out of argv, checked and translated; the API key handed over as "
             "`--api-key` in memory (`api_key.to_sglang`); the CPU engine's defaults"),
    Seam(f"{_ARGS}.ServerArgs.__repr__", "sglang_pic.security.redaction:redact_repr", "AROUND",
         "secret-redaction",
         why="the start-up log shows `api_key`, `admin_api_key`, `ssl_keyfile_password` as "
             "`<redacted>`"),
    Seam("sglang.srt.runtime_context.RuntimeContext.resolved_server_args_dict",
         "sglang_pic.security.redaction:redact_config", "AFTER", "secret-redaction",
         why="`/server_info` shows the secrets as `<redacted>`"),
)
