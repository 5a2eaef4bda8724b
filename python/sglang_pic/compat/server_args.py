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
    Seam(f"{_ARGS}.ServerArgs.resolved_dict", "sglang_pic.security.redaction:redact_config",
         "AFTER", "secret-redaction", releases=("0.5.23",),
         why="0.5.23 shows its settings as this dict: the start-up log's `server_args=`, "
             "`/server_info`, request dumps (`resolved_config`), `Engine.get_server_info`"),
    Seam("sglang.srt.entrypoints.http_server.build_server_info",
         "sglang_pic.security.redaction:redact_server_info", "AFTER", "secret-redaction",
         releases=("0.5.23",),
         why="0.5.23's `/server_info` adds `launch_command` here: the argv SGLang parsed, with "
             "the API key handed over in memory"),
)
