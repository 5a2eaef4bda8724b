"""The HTTP API key of ``sglang-pic serve``: where it comes from, what is refused, and how it
reaches SGLang without being on any process's command line.

SGLang does the checking: once ``ServerArgs.api_key`` is set, its middleware
(``sglang.srt.utils.auth``) answers 401 to every request without ``Authorization: Bearer KEY``,
compared with ``secrets.compare_digest``, except ``/health*`` and ``/metrics*`` (liveness probes
and Prometheus). This module only decides the key, because a server that anyone on the machine
can use is not a default we want: the server binds loopback, but any local process or user
reaches loopback.

Sources, the first found wins:

1. SGLang's ``--api-key KEY``, kept so SGLang command lines work unchanged; a note says that
   every user of the machine sees a command line (``ps``);
2. ``--api-key-file PATH``: a regular file of mode 600 (``secret_files.read_private``, the check
   PTStore's token files get), the key on its one line;
3. ``$SGLANG_PIC_API_KEY``.

With none of them ``sglang-pic serve`` generates a key at each start
(``secrets.token_urlsafe(32)``) into ``<cache>/api-keys/<port>`` (``~/.cache/sglang-pic`` or
``$SGLANG_PIC_CACHE``; the file 600 in a 700 folder, ``secret_files.write_private``) and says on
stderr where it is and how to send it, never the key itself. It does so in the server process
after every check of the start has passed, and refuses a port another process listens on: a
start that fails, or a second server started on a port in use, leaves the running server's key
file alone. ``--insecure`` serves without a key,
with a warning (a loud one when ``--host`` is not a loopback address); it is refused together with
a key source. Without it, what SGLang serves without checking the key is refused
(``refuse_unchecked``: gRPC listeners, several tokenizer workers). A key has at least 16 characters, printable ASCII without spaces: SGLang compares
the header as ``str``, which ``compare_digest`` refuses for non-ASCII text (every request would
be a 500). For the same reason a request whose ``Authorization`` header is not ASCII was a 500
with a traceback in the log (any client could fill the log); an AROUND hook on SGLang's
``decide_request_auth`` decides it as a request without the header instead (401), and
``register()`` adds it.

The key reaches SGLang in ``$SGLANG_PIC_API_KEY``: the launcher moves a ``--api-key`` of its
command line there before it starts the server process, and in that process the hook on
``prepare_server_args`` (``sglang_launcher``) takes the variable out of the environment and
appends ``--api-key=KEY`` to the argument list SGLang parses there (a list in memory, not a
command line). So SGLang's own checks of the key apply (it refuses one with ``--grpc-port`` or
several tokenizer workers), and SGLang's processes get it inside ``ServerArgs``, in neither
their argv nor their environment.

SGLang's own launchers (``python -m sglang.launch_server`` with our plugin) take the same three
sources but require none: they stay drop-in SGLang.

Standard library only: the launcher checks all this before it imports SGLang.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sglang_pic import environment
from sglang_pic.launcher.default_model import cache_dir
from sglang_pic.launcher.serve_conflicts import value_of
from sglang_pic.launcher.server_flags import UsageError, parse
from sglang_pic.security.secret_files import MAKE_ONE, MIN_SECRET_CHARS, read_private, write_private

ENV = "SGLANG_PIC_API_KEY"
SGLANG_FLAG = "--api-key"
FILE_FLAG = "--api-key-file"
ADMIN_ENV = "SGLANG_PIC_ADMIN_API_KEY"
ADMIN_SGLANG_FLAG = "--admin-api-key"
ADMIN_FILE_FLAG = "--admin-api-key-file"
INSECURE_FLAG = "--insecure"
DEFAULT_PORT = 30000
"""SGLang's ``ServerArgs.port``."""
DEFAULT_HOST = "127.0.0.1"
"""SGLang's ``ServerArgs.host``."""
KEY_DIR = "api-keys"
"""The folder of generated keys, in the cache folder."""


@dataclass(frozen=True)
class Choice:
    """What the command line and the environment say about the key."""

    key: str | None
    source: str | None
    """Where the key came from, as the messages name it (None: no key given)."""
    insecure: bool


def without_argv_key(argv: list[str], flag: str = SGLANG_FLAG) -> list[str]:
    """``argv`` without ``--api-key KEY`` / ``--api-key=KEY`` (or ``flag``'s)."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a.startswith(flag + "="):
            pass
        elif a == flag and i + 1 < len(argv):
            skip = True
        else:
            out.append(a)
    return out


def check_key(key: str, source: str) -> str:
    """``key`` if it is long enough and printable ASCII without spaces, else ``UsageError``
    naming ``source`` (never the key)."""
    if len(key) < MIN_SECRET_CHARS or not all("!" <= c <= "~" for c in key):
        raise UsageError(f"{source}: an API key needs at least {MIN_SECRET_CHARS} characters, "
                         f"printable ASCII without spaces (make one with: {MAKE_ONE})")
    return key


def read_key_file(path: str, flag: str = FILE_FLAG) -> str:
    """The key in the file at ``path`` (one line); ``UsageError`` when the file is not private
    or cannot be read."""
    try:
        text = read_private(path)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageError(f"{flag} {path}: {reason.removeprefix(f'{path}: ')}") from None
    return check_key(text.strip(), f"{flag} {path}")


def choose(given: Mapping[str, Any], argv: list[str],
           environ: Mapping[str, str] | None = None) -> Choice:
    """The key of our flags ``given``, SGLang's ``argv`` and ``environ`` (default
    ``os.environ``), checked; nothing written or printed. Raises ``UsageError``."""
    env = os.environ if environ is None else environ
    insecure = INSECURE_FLAG in given
    key = source = None
    if (flag_key := value_of(argv, SGLANG_FLAG)) is not None:
        key, source = flag_key, SGLANG_FLAG
    elif FILE_FLAG in given:
        source = f"{FILE_FLAG} {given[FILE_FLAG]}"
    elif environment.read(ENV, env):
        key, source = environment.read(ENV, env), f"${ENV}"
    if source is None:
        return Choice(None, None, insecure)
    if insecure:
        raise UsageError(f"{INSECURE_FLAG} and an API key ({source}) exclude each other")
    key = read_key_file(given[FILE_FLAG]) if key is None else check_key(key, source)
    return Choice(key, source, insecure)


def choose_admin(given: Mapping[str, Any], argv: list[str], api_key: str | None,
                 environ: Mapping[str, str] | None = None) -> str | None:
    """The admin key (SGLang's ``--admin-api-key``, ``--admin-api-key-file``,
    ``$SGLANG_PIC_ADMIN_API_KEY``: the first found), checked, or None: the admin API stays off.
    It must differ from the API key, or every client would hold it. Raises ``UsageError``."""
    env = os.environ if environ is None else environ
    if (key := value_of(argv, ADMIN_SGLANG_FLAG)) is not None:
        key = check_key(key, ADMIN_SGLANG_FLAG)
    elif ADMIN_FILE_FLAG in given:
        key = read_key_file(given[ADMIN_FILE_FLAG], ADMIN_FILE_FLAG)
    elif environment.read(ADMIN_ENV, env):
        key = check_key(environment.read(ADMIN_ENV, env), f"${ADMIN_ENV}")
    if key is not None and api_key is not None and secrets.compare_digest(key, api_key):
        raise UsageError("the admin key must differ from the API key")
    return key


UNCHECKED_LISTENERS = {
    "--grpc-port": "SGLang's gRPC listener does not check the API key (SGLang refuses a key "
                   "with it)",
    "--grpc-mode": "its gRPC server does not check the API key",
    "--smg-grpc-mode": "its gRPC server does not check the API key",
}
"""SGLang flags that serve without checking the key, and why."""


def refuse_unchecked(choice: Choice, argv: list[str]) -> None:
    """``UsageError`` for a server that must check a key (no ``--insecure``) but would serve
    where SGLang does not check it: a gRPC listener, several tokenizer workers."""
    if choice.insecure:
        return
    for flag, why in UNCHECKED_LISTENERS.items():
        if flag in argv or value_of(argv, flag) is not None:
            raise UsageError(f"{flag}: {why}; serve it with {INSECURE_FLAG}, only where no "
                             "one else reaches the port")
    workers = value_of(argv, "--tokenizer-worker-num")
    if workers is not None and workers.strip() not in ("1", ""):
        raise UsageError(f"--tokenizer-worker-num {workers}: SGLang checks the API key with one "
                         f"tokenizer worker only (it refuses a key with more); use one, or "
                         f"{INSECURE_FLAG} where no one else reaches the port")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def port_of(argv: list[str]) -> int:
    """The HTTP port SGLang will bind (``--port``, default 30000); ``UsageError`` unless an
    integer in 1..65535 (it names the key file)."""
    raw = value_of(argv, "--port")
    if raw is None:
        return DEFAULT_PORT
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise UsageError(f"--port: {raw!r} is not a port (1-65535)")
    return port


def key_dir() -> Path:
    """Where generated keys go: ``api-keys`` in the cache folder (``$SGLANG_PIC_CACHE``, else
    ``~/.cache/sglang-pic``: the default model's folder is beside it)."""
    return cache_dir().parent / KEY_DIR


def key_file(port: int) -> Path:
    """The file a server on ``port`` writes its generated key to."""
    return key_dir() / str(int(port))


def generate(port: int) -> tuple[str, Path]:
    """A new key, written to ``key_file(port)`` (600, its folder 700); ``UsageError`` when the
    folder cannot be made private."""
    key = secrets.token_urlsafe(32)
    try:
        path = write_private(key_dir(), str(int(port)), key + "\n")
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot write the generated API key ({e}): give {FILE_FLAG} PATH, "
                         f"${ENV} or {INSECURE_FLAG}") from None
    return key, path


def _note_command_line(prog: str) -> None:
    print(f"{prog}: note: {SGLANG_FLAG} puts the key on the command line, which every user of "
          f"this machine sees (ps); {FILE_FLAG} PATH (mode 600) or ${ENV} keep it off",
          file=sys.stderr, flush=True)


def off_command_line(argv: list[str], prog: str) -> tuple[list[str], dict[str, str]]:
    """For the launcher, before it starts the server process: ``argv`` without ``--api-key``,
    and the variables that carry its key instead (a note on stderr says why)."""
    env = {}
    for flag, name in ((SGLANG_FLAG, ENV), (ADMIN_SGLANG_FLAG, ADMIN_ENV)):
        key = value_of(argv, flag)
        if key is not None:
            env[name] = key
            argv = without_argv_key(argv, flag)
    if env:
        _note_command_line(prog)
    return argv, env


def _warn_insecure(argv: list[str], prog: str) -> None:
    host = value_of(argv, "--host") or DEFAULT_HOST
    if is_loopback(host):
        print(f"{prog}: warning: {INSECURE_FLAG}: no API key; every process on this machine can "
              "use the server", file=sys.stderr, flush=True)
    else:
        print(f"{prog}: WARNING: {INSECURE_FLAG} with --host {host}: NO API KEY, and the server "
              f"listens beyond this machine: ANYONE WHO REACHES PORT {port_of(argv)} CAN USE IT",
              file=sys.stderr, flush=True)


def hand_over(given: Mapping[str, Any], argv: list[str], prog: str,
              require: bool) -> list[str]:
    """Decide the key (``choose``) and put it in ``$SGLANG_PIC_API_KEY`` of this process, where
    the hook on ``prepare_server_args`` takes it (``to_sglang``); returns ``argv`` without
    ``--api-key``. ``require`` (``sglang-pic serve``): ``--insecure`` is warned about, and with
    neither a key nor ``--insecure`` the port that names the key file must be valid (the key is
    generated once the server's start has passed every check: ``generate_unless_given``).
    Raises ``UsageError``."""
    choice = choose(given, argv)
    admin = choose_admin(given, argv, choice.key)
    if choice.source == SGLANG_FLAG or value_of(argv, ADMIN_SGLANG_FLAG) is not None:
        _note_command_line(prog)
    argv = without_argv_key(without_argv_key(argv), ADMIN_SGLANG_FLAG)
    if require and choice.insecure:
        _warn_insecure(argv, prog)
    elif require and choice.key is None:
        port_of(argv)
    if choice.key is not None:
        environment.hand_over(ENV, choice.key)
    if admin is not None:
        environment.hand_over(ADMIN_ENV, admin)
    return argv


def port_taken(host: str, port: int) -> bool:
    """Whether another process listens on ``host:port`` already (a bind there fails with
    "address already in use"; SO_REUSEADDR, as SGLang's own check, so a port in TIME_WAIT is
    free)."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def generate_unless_given(argv: list[str], prog: str) -> None:
    """In the server process, once every check of its start has passed (so a start that fails
    leaves the key file of a running server alone): with neither a key handed over nor
    ``--insecure`` in ``argv`` (the user's), generate one (``generate``), say where it is on
    stderr, and hand it over. A port another process listens on is refused (``UsageError``):
    the server there keeps its key file, and this one could not bind anyway."""
    given, rest = parse(argv, prog)
    if INSECURE_FLAG in given or environment.read(ENV):
        return
    port = port_of(rest)
    host = value_of(rest, "--host") or DEFAULT_HOST
    if port_taken(host, port):
        raise UsageError(f"--port {port}: address already in use (another server?); its key "
                         f"file {key_file(port)} is left as it is")
    key, path = generate(port)
    print(f"{prog}: API key generated into {path} (mode 600, new at each start); clients send "
          f"it: -H \"Authorization: Bearer $(cat {path})\"", file=sys.stderr, flush=True)
    environment.hand_over(ENV, key)


def to_sglang(argv: list[str]) -> list[str]:
    """In the process that parses SGLang's flags (``prepare_server_args``): ``argv`` with
    ``--api-key`` set to the key handed over, which leaves this process's environment (SGLang's
    processes get it inside ``ServerArgs``); ``argv`` unchanged when none was."""
    for flag, name in ((SGLANG_FLAG, ENV), (ADMIN_SGLANG_FLAG, ADMIN_ENV)):
        key = environment.take(name)
        if key:
            # one token: argparse reads a separate value that starts with "-" (token_urlsafe's
            # alphabet has it) as the next option and stops with "--api-key: expected one
            # argument"
            argv = [*without_argv_key(argv, flag), f"{flag}={key}"]
    return argv


def decide_auth(original: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's auth decision, with two changes: a request whose ``Authorization`` header is not
    ASCII is decided as one without the header (``compare_digest`` raises on such text: a 500),
    and the admin routes of ``frontdoor.endpoints`` need the admin key (SGLang's
    ``ADMIN_FORCE``: 403 without an admin key configured), whatever level SGLang gave them (it
    lets the API key reach most of them when no admin key is set), and ``/health_generate``
    needs the API key (SGLang exempts every ``/health*`` path; ``/health`` stays open for
    liveness probes)."""
    from sglang.srt.utils.auth import AuthLevel

    from sglang_pic.frontdoor.endpoints import ADMIN

    header = kwargs.get("authorization_header")
    if header is not None and not header.isascii():
        kwargs["authorization_header"] = None
    path = kwargs.get("path")
    if path in ADMIN:
        kwargs["auth_level"] = AuthLevel.ADMIN_FORCE
    elif path == "/health_generate":  # generates on demand: the key, as /generate
        kwargs["path"] = "/keyed" + path
    return original(*args, **kwargs)


def client_key(url: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The key a client of ``url`` sends: ``$SGLANG_PIC_API_KEY``, else, for a URL naming an IPv4
    loopback address (``127.0.0.1``, what the server binds by default), the key a
    ``sglang-pic serve`` on its port generated (if readable and private); else None. Not for
    ``localhost``: it may resolve to ``::1`` first, where another user's process could listen
    on the same port and would receive the key."""
    env = os.environ if environ is None else environ
    if environment.read(ENV, env):
        return environment.read(ENV, env)
    parts = urlsplit(url)
    try:
        local = ipaddress.IPv4Address(parts.hostname or "").is_loopback
    except ValueError:
        local = False
    if not local:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return read_private(key_file(port)).strip() or None
    except (OSError, ValueError):
        return None
