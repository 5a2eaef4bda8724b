"""Files that hold secrets (PTStore token files, the HTTP API key): read only when private,
written private.

Why: a secret in a file other users can read is theirs too, so a file with any group or other
permission bit is refused rather than read (the user fixes it with ``chmod 600``), and only a
regular file is read (a FIFO would block the start, a device would never end). The file is
opened once and checked through that descriptor, so what is checked is what is read.

A file written here is created with ``O_EXCL | O_NOFOLLOW`` and mode 600 under a temporary name
in a folder only its user can enter (700), then renamed over the final name: no one else can
read it at any moment, a link planted at the final name is replaced rather than followed, and a
reader never sees half a file.

Secrets themselves must be long enough to resist guessing (``check_strength``).

Standard library only: the launcher checks these before it imports SGLang.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

MIN_SECRET_CHARS = 16
"""The shortest token or key accepted."""
MAKE_ONE = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
"""How to make a good secret, as the refusals say it."""


def read_private(path: str | os.PathLike) -> str:
    """The text of the regular file ``path``; ``ValueError`` when group or others have any
    permission on it (or it is not a regular file), ``OSError`` when it cannot be read."""
    p = Path(path)
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{p}: not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(f"{p}: readable by other users; chmod 600 it")
        with os.fdopen(fd, "rb") as f:
            fd = -1  # closed with f
            return f.read().decode()
    finally:
        if fd >= 0:
            os.close(fd)


def private_directory(directory: str | os.PathLike) -> Path:
    """``directory``, created (with its parents) if missing, and made 700 if it is this user's
    folder; ``ValueError`` for a link, another user's folder, or anything else there."""
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{d}: not a directory (a link?)")
    if st.st_uid != os.getuid():
        raise ValueError(f"{d}: owned by another user")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


def write_private(directory: str | os.PathLike, name: str, text: str) -> Path:
    """Write ``text`` to ``directory/name`` (mode 600, ``directory`` 700: ``private_directory``)
    through a new temporary file renamed over the name; returns the path."""
    d = private_directory(directory)
    final = d / name
    tmp = d / f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def check_strength(secret: str, source: str, what: str = "a token") -> str:
    """``secret`` if it has at least ``MIN_SECRET_CHARS`` characters and no whitespace, else
    ``ValueError`` naming ``source`` (never the secret)."""
    if len(secret) < MIN_SECRET_CHARS or any(c.isspace() for c in secret):
        raise ValueError(f"{source}: {what} needs at least {MIN_SECRET_CHARS} characters and no "
                         f"spaces (make one with: {MAKE_ONE})")
    return secret
