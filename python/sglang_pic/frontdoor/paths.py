"""Paths named in admin requests stay inside the folders the operator named at start.

``/start_profile``'s ``output_dir``, ``/configure_logging``'s dump folders,
``/update_weights_from_disk``'s ``model_path``, ``/load_lora_adapter``'s ``lora_path`` and
``/add_external_corpus``'s paths are paths on the server: with them the admin key could write
request dumps or traces anywhere the server's user can, or load files from anywhere. Each must
resolve (symbolic links followed) to a folder named by ``--admin-path-root`` or below it; with
none named, such a field is refused. Names SGLang joins to such a folder (``/start_profile``'s
``profile_prefix``, ``profile_id``) are plain names.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import orjson

from .refusal import Refused


def roots(raw: Iterable[str]) -> tuple[str, ...]:
    """The operator's folders, resolved once at start."""
    return tuple(os.path.realpath(r) for r in raw)


def confined(path: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``path`` resolves inside one of ``allowed`` (already resolved)."""
    if not path or "\x00" in path:
        return False
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in allowed)


def check_admin_body(raw: bytes, fields: tuple[str, ...], allowed: tuple[str, ...],
                     names: tuple[str, ...] = ()) -> None:
    """``Refused`` (400/403) unless every one of ``fields`` the JSON body ``raw`` sets is a path
    inside ``allowed``, and every one of ``names`` a plain file name. An empty body sets none."""
    if not raw.strip():
        return
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise Refused(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise Refused(400, "the request body must be a JSON object")
    for name in fields:
        value = body.get(name)
        if value is None or value == "":  # unset, or (dump folders) turned off
            continue
        if not isinstance(value, str):
            raise Refused(400, f"{name!r} must be a path")
        if not allowed:
            raise Refused(403, f"{name!r}: admin requests may name paths only inside folders "
                               "the operator named at start (--admin-path-root)")
        if not confined(value, allowed):
            raise Refused(403, f"{name!r}: {value!r} is outside the folders admin requests may "
                               "name (--admin-path-root)")
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not plain_name(value):
            raise Refused(400, f"{name!r} must be a plain name (no '/', no '..'), got "
                               f"{str(value)[:64]!r}")


def plain_name(value: str) -> bool:
    """Whether ``value`` names a file inside a folder it is joined to, and nothing else."""
    return "/" not in value and "\x00" not in value and ".." not in value and \
        os.sep not in value
