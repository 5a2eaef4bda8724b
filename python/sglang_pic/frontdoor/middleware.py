"""``FrontDoor``: the ASGI middleware every HTTP request passes before SGLang's routes.

In order, for each request (after SGLang's API key check, which runs outside it):

1. the route (``endpoints.access``): unknown routes get 404, admin routes need the admin key
   (403 without one configured, 401 with another key), pickled-weight routes need
   ``--enable-weights-from-tensor`` too;
2. the body, for POST/PUT: at most ``max_body_bytes`` (413, read no further: a
   ``content-length`` over the limit is refused before a byte is read), within
   ``body_timeout_s`` (408: a client trickling its body holds no slot for long);
3. ``spans`` resolved into a prompt (``spans.http.resolve``), markers refused on a server
   without the span cache;
4. the body's schema (``schemas.check_body``), and for admin routes the paths it names
   (``paths.confined``).

Refusals are JSON in the endpoint's error format (OpenAI's for ``/v1/*``) and close the
connection when the body was not read whole, so its rest is never buffered. The body a request
passes with is replayed to SGLang unchanged unless ``spans`` rewrote it.
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from . import endpoints, paths, schemas
from .endpoints import Access
from .refusal import Refused, send_error

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


@dataclass(frozen=True)
class FrontDoorConfig:
    max_body_bytes: int
    body_timeout_s: float
    admin_api_key: str | None
    admin_path_roots: tuple[str, ...]
    weights_from_tensor: bool
    span_cache: bool
    vocab_size: Callable[[], int | None]


class FrontDoor:
    def __init__(self, app: Any, config: FrontDoorConfig) -> None:
        self.app = app
        self.config = config
        self._health_checks: dict[tuple[str, str], asyncio.Future] = {}
        self._health_answers: dict[tuple[str, str], tuple[float, list[dict]]] = {}

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope.get("type") == "lifespan":
            await self.app(scope, receive, send)
            return
        path = _route_path(scope)
        if scope.get("type") != "http":  # websockets: no route of ours takes them
            await _refuse_websocket(send)
            return
        method = scope.get("method", "")
        scope = _without_routing_headers(scope)
        if path in KEYLESS_ROUTES:
            send = _without_cors(send)
        if path in HEALTH_ROUTES:
            await self._health(scope, receive, send)
            return
        access = endpoints.access(method, path)
        try:
            raw = await self._admit(scope, method, path, access, receive)
        except Refused as e:
            await send_error(send, e.status, e.message, openai=path.startswith("/v1/"),
                             close=e.close)
            return
        if raw is not None:
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", [])
                                if k != b"content-length"] + [(b"content-length",
                                                               str(len(raw)).encode())]
            receive = _replay(raw, receive)
        if access is not Access.ADMIN:
            await self.app(scope, receive, send)
            return
        await _admin_call(self.app, scope, receive, send, path)

    async def _health(self, scope: dict, receive: Receive, send: Send) -> None:
        """``/health`` needs no key (liveness probes), and SGLang generates a token for it when
        the server is idle. One check runs at a time per route and method; callers that arrive
        meanwhile get its answer, and a passing answer serves for ``HEALTH_FRESH_S``: a client
        sending probes without end costs one check a second, and a real probe is never turned
        away for want of a slot."""
        key = (scope.get("method", ""), _route_path(scope))
        loop = asyncio.get_running_loop()
        fresh = self._health_answers.get(key)
        if fresh is not None and loop.time() - fresh[0] < HEALTH_FRESH_S:
            messages = fresh[1]
        else:
            running = self._health_checks.get(key)
            if running is None:
                running = self._health_checks[key] = asyncio.ensure_future(
                    self._check_health(key, scope))
                running.add_done_callback(lambda _: self._health_checks.pop(key, None))
            # shielded: a caller that hangs up does not cancel the others' check
            messages = await asyncio.shield(running)
        for message in messages:
            await send(message)

    async def _check_health(self, key: tuple[str, str], scope: dict) -> list[dict]:
        """SGLang's answer to one health check, as the ASGI messages it sent (a 503 if it
        raised); kept as the fresh answer when it passed."""
        messages: list[dict] = []

        async def no_body() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def keep(message: dict) -> None:
            messages.append(message)

        try:
            await self.app(scope, no_body, keep)
        except Exception as e:  # answered as a failed check, to every caller waiting on it
            messages.clear()
            await send_error(keep, 503, f"health check failed: {type(e).__name__}",
                             openai=False)
        if messages and messages[0].get("status") == 200:
            self._health_answers[key] = (asyncio.get_running_loop().time(), messages)
        return messages

    async def _admit(self, scope: dict, method: str, path: str, access: Access,
                     receive: Receive) -> bytes | None:
        """The body to replay (None: the request passes as it came); raises ``Refused``."""
        if access is Access.UNKNOWN:
            raise Refused(404, f"{method} {path} is not served by this server (sglang-pic "
                               "serves generation, the OpenAI and Anthropic routes and status; "
                               "see docs/security.md)")
        if access is Access.ADMIN:
            self._check_admin(scope, path)
        if access is Access.INFERENCE and method not in ("POST", "PUT"):
            return None  # the GET routes read no body
        raw = await read_body(scope, receive, self.config.max_body_bytes,
                              self.config.body_timeout_s)
        if access is Access.ADMIN:  # any method: SGLang's admin handlers parse GET bodies too
            fields, names = endpoints.ADMIN_PATHS.get(path), endpoints.ADMIN_NAMES.get(path)
            if fields or names:
                paths.check_admin_body(raw, fields or (), self.config.admin_path_roots,
                                       names or ())
            return raw
        return self._checked(path, raw)

    def _check_admin(self, scope: dict, path: str) -> None:
        key = self.config.admin_api_key
        if not key:
            raise Refused(403, f"{path} is an admin endpoint, and the admin API is off: the "
                               "operator turns it on with its own key (--admin-api-key-file)")
        if not _bearer_matches(scope, key):
            raise Refused(401, f"{path} needs the admin key (Authorization: Bearer ADMIN_KEY)")
        if path in endpoints.PICKLED and not self.config.weights_from_tensor:
            raise Refused(403, f"{path} unpickles its body, which runs code on the server: "
                               "refused unless the server was started with "
                               "--enable-weights-from-tensor")

    def _checked(self, path: str, raw: bytes) -> bytes:
        from sglang_pic.security.request_validation import refuse_openai_span_markers
        from sglang_pic.spans import http as span_http

        try:
            raw = span_http.resolve(path, raw, self.config.span_cache)
        except RecursionError:
            raise Refused(400, schemas.TOO_DEEP) from None
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise Refused(400, str(e) or f"malformed spans ({type(e).__name__})") from None
        try:
            raw = _with_session_hint(path, raw)
            parsed = schemas.check_body(path, raw, self.config.vocab_size)
            if not self.config.span_cache and parsed is not None:
                refuse_openai_span_markers(parsed)
        except ValueError as e:  # BodyError, and the markers' refusal
            raise Refused(400, str(e)) from None
        except RecursionError:
            raise Refused(400, schemas.TOO_DEEP) from None
        return raw


async def _admin_call(app: Any, scope: dict, receive: Receive, send: Send, path: str) -> None:
    """An admin route whose handler refuses the operation by raising (``/stop_profile`` with no
    profile running raises RuntimeError) answers 409 with the reason, not a 500."""
    started = False

    async def tracked(message: dict) -> None:
        nonlocal started
        started = started or message.get("type") == "http.response.start"
        await send(message)

    try:
        await app(scope, receive, tracked)
    except (RuntimeError, ValueError) as e:
        if started:
            raise
        await send_error(send, 409, f"{path}: {e}", openai=False)


HINTED_ROUTES = ("/v1/chat/completions", "/v1/completions")
_USER_KEY = re.compile(rb'\s*:')


def _may_hold_hint(raw: bytes) -> bool:
    """Whether a hint field can be a key of ``raw``: its name in the bytes (or an escape that
    could spell it), and ``"user"`` followed by a colon (it is also a chat role, as a value).
    Substring scans, a few per body: a regular expression over a 128K-token body took 4 ms."""
    if b"prompt_cache_key" in raw or b"safety_identifier" in raw or b"\\u" in raw:
        return True
    at = raw.find(b'"user"')
    while at >= 0:
        if _USER_KEY.match(raw, at + 6):
            return True
        at = raw.find(b'"user"', at + 6)
    return False


def _with_session_hint(path: str, raw: bytes) -> bytes:
    """The OpenAI fields that name a session (``prompt_cache_key``, ``safety_identifier``,
    ``user``) as the eviction policy's session hint (``eviction.openai_hints``)."""
    if path not in HINTED_ROUTES or not _may_hold_hint(raw):
        return raw
    from sglang_pic.eviction.openai_hints import with_session_hint

    try:
        body = orjson.loads(raw)
        hinted = with_session_hint(body)
        return raw if hinted is body else orjson.dumps(hinted)
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):
        return raw  # the schema says what is wrong (not JSON, nested too deeply)


HEALTH_ROUTES = frozenset({"/health", "/health_generate"})
HEALTH_FRESH_S = 1.0
"""How long a passing health check answers the probes after it."""
ROUTING_HEADERS = (b"x-data-parallel-rank", b"x-smg-routing-key")
"""Request headers SGLang reads into fields the schema refuses or bounds in bodies (a DP rank,
a routing key), dropped with every ``x-override-*`` header (SGLang's optional per-request
overrides of internal fields)."""


KEYLESS_ROUTES = frozenset({"/health", "/metrics"})
"""Routes SGLang answers without a key. Their answers lose SGLang's CORS headers (it echoes
any ``Origin`` and allows credentials): any web page open in a local browser could otherwise
read ``/metrics`` (the model's path, the traffic's counters). Routes that need a key keep
them: a page cannot send the key it does not have."""


def _without_cors(send: Send) -> Send:
    async def send_without_cors(message: dict) -> None:
        if message.get("type") == "http.response.start":
            message = {**message, "headers": [
                (k, v) for k, v in message.get("headers", ())
                if not bytes(k).lower().startswith(b"access-control-")]}
        await send(message)

    return send_without_cors


def _without_routing_headers(scope: dict) -> dict:
    headers = scope.get("headers", [])
    kept = [(k, v) for k, v in headers
            if k not in ROUTING_HEADERS and not k.startswith(b"x-override-")]
    if len(kept) == len(headers):
        return scope
    return {**scope, "headers": kept}


def _route_path(scope: dict) -> str:
    """The path SGLang's router matches: the request's, less the app's ``root_path``."""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _bearer_matches(scope: dict, key: str) -> bool:
    header = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token, key.encode())


async def read_body(scope: dict, receive: Receive, limit: int, timeout_s: float) -> bytes:
    """The whole body, or ``Refused`` (413 past ``limit`` bytes, 408 past ``timeout_s``)."""
    declared = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise Refused(400, "invalid content-length", close=True) from None
        if size > limit:
            raise Refused(413, _too_large(limit), close=True)
    chunks: list[bytes] = []
    total = 0

    async def read() -> None:
        nonlocal total
        more = True
        while more:
            message = await receive()
            if message.get("type") == "http.disconnect":
                raise Refused(400, "client disconnected", close=True)
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise Refused(413, _too_large(limit), close=True)
            chunks.append(chunk)
            more = message.get("more_body", False)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise Refused(408, f"the request body did not arrive within {timeout_s:g} s",
                      close=True) from None
    return b"".join(chunks)


def _too_large(limit: int) -> str:
    return (f"the request body is larger than this server's limit of {limit / 2**20:g} MiB "
            "(--max-request-mb)")


def _replay(raw: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return replay


async def _refuse_websocket(send: Send) -> None:
    await send({"type": "websocket.close", "code": 1008})
