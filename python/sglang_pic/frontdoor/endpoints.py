"""Which HTTP endpoints a server answers, and to whom: one allowlist.

SGLang's app has ~90 routes. Most change the server (weights, logging, profiling, memory, other
clients' requests) and SGLang lets the normal API key reach them when no admin key is set; one
(``/update_weights_from_tensor``) unpickles client bytes. sglang-pic serves:

* ``INFERENCE``: to the API key (SGLang's check), the generation endpoints, the OpenAI and
  Anthropic routes we validate (``schemas``), and read-only status;
* ``ADMIN``: only to the admin key (``--admin-api-key-file``), which no server has unless the
  operator gives one; ``PICKLED`` ones also need ``--enable-weights-from-tensor``; fields named in
  ``ADMIN_PATHS`` must lie in a folder of ``--admin-path-root``;
* anything else: 404, whatever the key (``FrontDoor``).

A route is ``(method, path)``; paths are exact (SGLang's router matches exactly, and Starlette's
slash redirect never reaches a handler we did not list), except ``PREFIX_ROUTES``.
"""

from __future__ import annotations

from enum import Enum


class Access(str, Enum):
    INFERENCE = "inference"
    ADMIN = "admin"
    UNKNOWN = "unknown"


_GET, _POST, _PUT = "GET", "POST", "PUT"

INFERENCE: frozenset[tuple[str, str]] = frozenset({
    # generation
    (_POST, "/generate"), (_PUT, "/generate"),
    (_POST, "/v1/completions"),
    (_POST, "/v1/chat/completions"),
    (_POST, "/v1/messages"),
    (_POST, "/v1/messages/count_tokens"),
    (_POST, "/v1/tokenize"), (_POST, "/tokenize"),
    (_POST, "/v1/detokenize"), (_POST, "/detokenize"),
    # read-only status (SGLang's health and metrics routes need no key)
    (_GET, "/health"), (_GET, "/health_generate"),
    (_GET, "/metrics"),
    (_GET, "/v1/models"),
    (_GET, "/get_model_info"), (_GET, "/model_info"),
    (_GET, "/get_server_info"), (_GET, "/server_info"),
    (_GET, "/get_load"), (_GET, "/v1/loads"),
    (_GET, "/get_weight_version"), (_GET, "/weight_version"),
    (_GET, "/ping"),
})
"""``(method, path)`` served to the API key. Bodies of the POST/PUT ones are validated by
``schemas.SCHEMAS`` (a route here without a schema takes no body)."""

PREFIX_ROUTES: frozenset[tuple[str, str]] = frozenset({(_GET, "/v1/models/")})
"""``(method, prefix)`` served to the API key: ``/v1/models/{model}``."""

ADMIN: frozenset[str] = frozenset({
    "/flush_cache", "/abort_request", "/pause_generation", "/continue_generation", "/slow_down",
    "/configure_logging", "/set_trace_level", "/freeze_gc", "/set_internal_state",
    "/start_profile", "/stop_profile",
    "/start_expert_distribution_record", "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/update_weights_from_ipc", "/update_weight_version", "/get_weights_by_name",
    "/init_weights_update_group", "/destroy_weights_update_group",
    "/init_weights_send_group_for_remote_instance", "/send_weights_to_remote_instance",
    "/get_remote_instance_transfer_engine_info", "/remote_instance_transfer_engine_info",
    "/release_memory_occupation", "/resume_memory_occupation", "/weights_checker",
    "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
    "/clear_hicache_storage_backend", "/hicache/storage-backend/clear", "/hicache/storage-backend",
    "/add_external_corpus", "/remove_external_corpus", "/list_external_corpora",
    "/open_session", "/close_session",
})
"""Paths served to the admin key only (any method SGLang's route takes)."""

PICKLED: frozenset[str] = frozenset({"/update_weights_from_tensor", "/load_lora_adapter_from_tensors"})
"""Admin paths whose bodies SGLang unpickles: code execution for whoever sends them. Refused even
to the admin key unless the operator starts the server with ``--enable-weights-from-tensor``."""

ADMIN_PATHS: dict[str, tuple[str, ...]] = {
    "/start_profile": ("output_dir",),
    "/configure_logging": ("dump_requests_folder", "crash_dump_folder"),
    "/update_weights_from_disk": ("model_path",),
    "/load_lora_adapter": ("lora_path",),
    "/add_external_corpus": ("corpus_path", "path", "file_path"),
}
"""Body fields of admin requests that name a file or folder on the server: each must lie in a
folder named by ``--admin-path-root`` (none named: such a field is refused)."""

ADMIN_NAMES: dict[str, tuple[str, ...]] = {
    "/start_profile": ("profile_prefix", "profile_id"),
}
"""Body fields of admin requests that SGLang joins into a file name under a checked folder: each
must be a plain name (no ``/``, no ``..``), or it would lead the file out of that folder."""


def access(method: str, path: str) -> Access:
    """Who may call ``method path``: ``Access.INFERENCE`` (the API key), ``ADMIN`` (the admin
    key), ``UNKNOWN`` (nobody: 404)."""
    if (method, path) in INFERENCE or (method == "HEAD" and (_GET, path) in INFERENCE):
        return Access.INFERENCE
    if any(method == m and path.startswith(p) and len(path) > len(p) for m, p in PREFIX_ROUTES):
        return Access.INFERENCE
    if path in ADMIN:
        return Access.ADMIN
    return Access.UNKNOWN
