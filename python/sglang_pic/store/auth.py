"""PTStore credentials: tokens, the CurveZMQ keys derived from them, and the server's ZAP check.

Why CURVE. A token inside each request could only be checked once zmq had received the whole
message, so anyone who reached the port could make a server buffer frames of any size and hold
half-sent ones forever. With CurveZMQ a client proves its key during the connection handshake:
the server's ZAP handler (pyzmq's ``ThreadAuthenticator``) accepts only client keys derived from
a configured token, and an unauthenticated peer never gets a message accepted. CURVE encrypts
every message and gives each connection its own session keys and nonces, so a recorded message
cannot be replayed into another connection.

Keys. Both sides derive fixed key pairs from a token (no key files to distribute): the server's
secret key is ``z85(blake2b(token, person="ptstore-server", 32 bytes))``, a client's the same with
``"ptstore-client"``; public keys follow with ``zmq.curve_public``. A server with several tokens
takes its key pair from the first one; clients of the other tokens are given the server's public
key (``server_key``; public, printed by ``sglang-pic store`` at start), since they cannot derive
it. Whoever knows a token can act as a client of that tenant, and whoever knows the first token
can act as the server; tokens must be kept secret and be long and random
(``secrets.token_urlsafe(32)``: the server's public key lets anyone test guesses offline).

Tenants. A server may accept several tokens (a token file, one per line, ``token`` or
``name token``); each is a tenant, named by the file (or, for a bare token, by a digest of it).
ZAP hands a connection's tenant name to the server as the messages' ``User-Id``, and the server
keeps every tenant's pages and objects apart. Two lines with the same name are one tenant with
two valid tokens (to rotate a token without losing the tenant's pages).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Mapping
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from sglang_pic import environment
from sglang_pic.security.secret_files import MIN_SECRET_CHARS, check_strength, read_private

SERVE_TOKEN_ENV = "SGLANG_PIC_PTSTORE_TOKEN"
"""Where ``sglang-pic serve``'s processes (SGLang's schedulers inherit it) find the token."""
STORE_TOKEN_ENV = "SGLANG_PIC_STORE_TOKEN"
"""The token of ``sglang-pic store`` and ``store-status`` when no ``--token-file`` is given."""

HANDSHAKE_MS = 5000
"""A connection that has not completed its handshake by then is dropped."""
HEARTBEAT_MS = 10_000
HEARTBEAT_TIMEOUT_MS = 60_000
"""A server pings every connection each ``HEARTBEAT_MS`` and drops one that sent nothing for
``HEARTBEAT_TIMEOUT_MS`` after a ping (a dead peer, or one stuck in the middle of a message;
a 1 GiB batch must arrive at more than ~18 MB/s)."""

MIN_TOKEN_CHARS = MIN_SECRET_CHARS
_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _secret(token: str, role: bytes) -> bytes:
    digest = hashlib.blake2b(token.encode(), digest_size=32, person=role).digest()
    return z85.encode(digest)


def server_keys(token: str) -> tuple[bytes, bytes]:
    """The server's ``(public, secret)`` CURVE keys (z85) for ``token``."""
    secret = _secret(token, b"ptstore-server")
    return zmq.curve_public(secret), secret


def client_keys(token: str) -> tuple[bytes, bytes]:
    """A client's ``(public, secret)`` CURVE keys (z85) for ``token``."""
    secret = _secret(token, b"ptstore-client")
    return zmq.curve_public(secret), secret


def tenant_of(token: str) -> str:
    """The tenant name of a token given without a name: a digest, never the token itself."""
    return "t-" + hashlib.blake2b(token.encode(), digest_size=8, person=b"ptstore-tenant").hexdigest()


def parse_tokens(text: str, source: str = "token file") -> dict[str, str]:
    """``{token: tenant}`` of a token file: one token per line, optionally preceded by a tenant
    name (``[A-Za-z0-9_.-]``, at most 64 characters); blank lines and ``#`` comments skipped."""
    tokens: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2 or (len(fields) == 2 and not _TENANT_NAME.fullmatch(fields[0])):
            raise ValueError(f"{source}, line {n}: expected 'TOKEN' or 'NAME TOKEN'")
        token = check_token(fields[-1], f"{source}, line {n}")
        tokens[token] = fields[0] if len(fields) == 2 else tenant_of(token)
    if not tokens:
        raise ValueError(f"{source}: no token")
    return tokens


def read_token_file(path: str | os.PathLike) -> dict[str, str]:
    """``parse_tokens`` of a file (refused when others may read it, or it is not a regular file:
    ``secret_files.read_private``)."""
    return parse_tokens(read_private(path), str(Path(path)))


def server_tokens(path: str | os.PathLike | None, env: str) -> dict[str, str] | None:
    """A server's ``{token: tenant}``: the file at ``path``, else the one token of the variable
    ``env``, else None."""
    if path is not None:
        return read_token_file(path)
    token = environment.read(env)
    return {check_token(token, env): tenant_of(token)} if token else None


def client_token(path: str | os.PathLike | None, env: str) -> str | None:
    """A client's token: the first token of the file at ``path``, else the variable ``env``,
    else None (no authentication)."""
    if path is not None:
        return next(iter(read_token_file(path)))
    token = environment.read(env)
    return check_token(token, env) if token else None


def check_token(token: str, source: str) -> str:
    """``token`` if it is long enough to resist guessing, else ValueError."""
    return check_strength(token, source, "a token")


def secure_client(sock: zmq.Socket, token: str | None, server_key: bytes | str | None = None
                  ) -> None:
    """Make ``sock`` (not yet connected) a CURVE client with ``token``'s keys, of the server
    whose public key is ``server_key`` (default: the one derived from ``token``); with no token
    it stays a NULL-mechanism socket, which only a ``--insecure`` server accepts."""
    if token is None:
        return
    if isinstance(server_key, str):
        server_key = server_key.encode()
    if server_key is not None and len(server_key) != 40:
        raise ValueError("a server key is 40 characters of z85 (as `sglang-pic store` prints it)")
    sock.curve_serverkey = server_key or server_keys(token)[0]
    sock.curve_publickey, sock.curve_secretkey = client_keys(token)


class _KnownClients:
    """pyzmq's credentials provider: a client key is accepted when it is one of ``tenants``."""

    def __init__(self, tenants: Mapping[bytes, str]) -> None:
        self.tenants = tenants

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.tenants


class _TenantAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread; names each connection's tenant as its ``User-Id``."""

    def __init__(self, context: zmq.Context, tenants: Mapping[bytes, str]) -> None:
        super().__init__(context)
        self.tenants = dict(tenants)  # client public key (z85) -> tenant name
        self.configure_curve_callback("*", _KnownClients(self.tenants))

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.tenants[z85.encode(client_public_key)]


class ServerAuth:
    """The CURVE side of one server socket: ``tokens`` maps each accepted token to its tenant.
    ``None`` (``--insecure``) leaves the socket on the NULL mechanism: no authentication, no
    encryption, one tenant. The ZAP handler is bound to ``context``: one server per context."""

    def __init__(self, context: zmq.Context, tokens: Mapping[str, str] | None) -> None:
        self.tokens = dict(tokens) if tokens else None
        self.public = self.secret = b""
        self._auth: _TenantAuthenticator | None = None
        if self.tokens:
            self.public, self.secret = server_keys(next(iter(self.tokens)))
            self._auth = _TenantAuthenticator(
                context, {client_keys(t)[0]: name for t, name in self.tokens.items()})
            self._auth.start()

    @property
    def secure(self) -> bool:
        return self.tokens is not None

    def apply(self, sock: zmq.Socket) -> None:
        """Set ``sock`` (before bind) up as a CURVE server, with handshake and heartbeat
        time-outs."""
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if self.tokens:
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = self.public, self.secret

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def same_secret(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two secrets."""
    return hmac.compare_digest(a, b)
