"""Seams in SGLang's HTTP server and its ASGI stack (uvicorn): the front door and the API key."""

from __future__ import annotations

from .seam import Seam

TITLE = "HTTP server"

_AUTH = "sglang.srt.utils.auth"

ROWS: tuple[Seam, ...] = (
    Seam("sglang.srt.entrypoints.http_server.launch_server", "sglang_pic.frontdoor:install",
         "BEFORE", "front-door",
         why="the `FrontDoor` ASGI middleware goes on SGLang's app before it serves: route "
             "allowlist, admin key, body size and time, the `spans` field, one schema per body"),
    Seam("sglang.srt.entrypoints.http_server.app.state.pic_front_door",
         "sglang_pic.frontdoor:install", "attribute", "front-door",
         why="marks the app whose middleware stack has the front door (added once)"),
    Seam("uvicorn.config.Config.load", "sglang_pic.frontdoor.connections:around_config_load",
         "AROUND", "front-door",
         why="uvicorn's HTTP protocol class, guarded: header deadline "
             "(`--http-header-timeout-s`), connection cap (`--max-connections`) and write "
             "deadline (`--http-write-timeout-s`)"),
    Seam("uvicorn.config.Config.http_protocol_class", "sglang_pic.frontdoor.connections:guarded",
         "instance-patch", "front-door",
         why="the loaded config's protocol class becomes its guarded subclass"),
    Seam(f"{_AUTH}.add_api_key_middleware", "sglang_pic.frontdoor.unauthorized:add_hint",
         "AFTER", "front-door",
         why="a 401 that names the header and the key file"),
    Seam("sglang.srt.runtime_context.get_server_args", "sglang_pic.frontdoor.unauthorized:add_hint",
         "call", "front-door",
         why="the hint's key file is named by the server's port"),
    Seam("sglang.srt.entrypoints.http_server._freeze_gc_after_server_warmup",
         "sglang_pic.frontdoor.warmup:freeze_gc_in_process", "REPLACE", "front-door",
         releases=("0.5.23",),
         why="0.5.23's warm-up freezes the GC through its own `/freeze_gc`, an admin route "
             "here: the same freeze in process"),
    Seam("sglang.srt.entrypoints.http_server._global_state", None, "call", "front-door",
         releases=("0.5.23",), why="the tokenizer manager the freeze runs on"),
    Seam(f"{_AUTH}.decide_request_auth", "sglang_pic.security.api_key:decide_auth", "AROUND", "api-key",
         why="a non-ASCII `Authorization` header is decided as none (401, not a 500 with a "
             "traceback); the admin routes of `frontdoor.endpoints` need the admin key; "
             "`/health_generate` the API key"),
)
