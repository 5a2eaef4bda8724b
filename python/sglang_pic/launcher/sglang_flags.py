"""SGLang's server flag names without importing SGLang, so a mistyped flag is answered at once.

SGLang's parser is built by ``sglang.srt.server_args``, which imports torch and most of SGLang
(4-8 s on 2 cores; 16 s with the rest of a start before argparse said ``unrecognized
arguments`` under 432 lines of usage). So the option strings are kept in a file in our cache
directory, named after SGLang's and our versions and our flag names, and launches read the file
(a few ms). The first launch after an install writes it (``python -m sglang_pic.launcher.sglang_flags``,
quiet, ~5-10 s, once); the server process rewrites it from the parser it builds anyway.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from sglang_pic import environment
from sglang_pic.launcher.server_flags import FLAGS, UsageError


def cache_path() -> Path:
    """The cache file of this SGLang and this sglang-pic, named after their versions and a digest
    of our flag names: SGLang's parser holds our flags too (an abbreviation of SGLang's
    ``--api-key`` is ambiguous beside our ``--api-key-file``), and a development install changes
    them without a new version."""
    from sglang_pic import __version__
    from sglang_pic.launcher.default_model import cache_dir

    try:
        sglang = version("sglang")
    except PackageNotFoundError:
        sglang = "none"
    ours = hashlib.blake2b(" ".join(sorted(FLAGS)).encode(), digest_size=4).hexdigest()
    return cache_dir().parent / f"sglang-{sglang}-sglang-pic-{__version__}-{ours}-server-flags.json"


def cached() -> list[str] | None:
    """SGLang's option strings as the last server process saw them, or None."""
    try:
        names = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return None
    return names if isinstance(names, list) and names else None


def names() -> list[str] | None:
    """SGLang's option strings: the cached ones, else built once now by a quiet child process
    (SGLang's import warnings stay out of the launcher's output). None if that failed."""
    got = cached()
    if got is None:
        try:
            subprocess.run([sys.executable, "-m", "sglang_pic.launcher.sglang_flags"],
                           capture_output=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        got = cached()
    return got


def save(names: Iterable[str]) -> None:
    """Write the option strings (atomically; a read-only cache directory only costs speed)."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(sorted(set(names))))
        os.replace(tmp, path)
    except OSError:
        pass


def option_strings(parser) -> list[str]:
    """Every option string of an argparse parser."""
    return [s for action in parser._actions for s in action.option_strings]


def unknown(argv: list[str], known: Iterable[str]) -> list[str]:
    """The ``--flags`` of ``argv`` that are not exactly a known flag. SGLang's parser would take
    the prefix of one (``--max-total-token``) as that flag, but the value checks here and the
    launcher's rules look flags up by their whole name, so an abbreviation is refused."""
    known = set(known)
    out = []
    for token in argv:
        if not token.startswith("--") or token == "--":
            continue
        name = token.split("=", 1)[0]
        if name not in known:
            out.append(name)
    return out


def nearest(name: str, known: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return matches[0] if matches else None


def refuse_unknown(argv: list[str], known: Iterable[str] | None = None) -> None:
    """Raise ``UsageError`` naming the first unknown flag of ``argv`` (SGLang's flags, ours
    taken out) and the nearest of ours and SGLang's. ``known``: SGLang's option strings, by
    default ``names()``; without them nothing is checked here (the server process checks)."""
    known = names() if known is None else list(known)
    if not known:
        return
    bad = unknown(argv, known)
    if not bad:
        return
    everything = {*known, *(name for name, flag in FLAGS.items() if not flag.hidden)}
    guess = nearest(bad[0], everything)
    hint = f" (did you mean {guess}?)" if guess else ""
    more = f"; also {', '.join(bad[1:])}" if len(bad) > 1 else ""
    raise UsageError(f"unrecognized argument {bad[0]}{hint}{more}")


def _int_in(lo: int, hi: int | None = None):
    def check(raw: str) -> str | None:
        try:
            value = int(raw)
        except ValueError:
            return f"{raw!r} is not an integer"
        if value < lo or (hi is not None and value > hi):
            return f"{value} is out of range ({lo}-{hi})" if hi else f"{value} is below {lo}"
        return None
    return check


def _fraction(raw: str) -> str | None:
    try:
        value = float(raw)
    except ValueError:
        return f"{raw!r} is not a number"
    return None if 0.0 < value < 1.0 else f"{value:g} is not in (0, 1)"


def _local_model(raw: str) -> str | None:
    """A path-looking model (``/``, ``./``, ``../``, ``~``) must exist; anything else may be a
    hub id, which SGLang resolves."""
    if raw.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(raw)):
        return f"{raw!r}: no such file or folder"
    return None


VALUE_CHECKS = {
    "--port": _int_in(1, 65535),
    "--max-total-tokens": _int_in(1),
    "--max-running-requests": _int_in(1),
    "--max-prefill-tokens": _int_in(1),
    "--chunked-prefill-size": _int_in(-1),
    "--context-length": _int_in(1),
    "--page-size": _int_in(1),
    "--tp-size": _int_in(1),
    "--dp-size": _int_in(1),
    "--mem-fraction-static": _fraction,
    "--model-path": _local_model,
    "--tokenizer-path": _local_model,
}
"""SGLang flags whose values are checked here, before anything loads: SGLang's own parser needs
SGLang imported (4-8 s), and some of these it never checks (``--mem-fraction-static 2``) or
checks only after the weights load."""

SERVE_PROG = "sglang-pic serve"
"""The program name SGLang's parser reports errors under (``sglang_parser``)."""

GPU_ONLY_BACKENDS = ("flashinfer", "pic_flashinfer", "pariskv_flashinfer", "fa3", "fa4",
                     "flashmla", "cutlass_mla", "trtllm_mla", "trtllm_mha", "aiter", "wave")
"""Attention backends that cannot run on SGLang's CPU engine."""


def refuse_bad_values(argv: list[str], on_cpu: bool | None = None) -> None:
    """``UsageError`` for the first value of ``VALUE_CHECKS`` that is wrong, and (``on_cpu``)
    an attention backend that needs a GPU."""
    from sglang_pic.launcher.serve_conflicts import value_of

    for flag, check in VALUE_CHECKS.items():
        raw = value_of(argv, flag)
        if raw is not None and (why := check(raw)):
            raise UsageError(f"{flag}: {why}")
    if on_cpu:
        for flag in ("--attention-backend", "--prefill-attention-backend",
                     "--decode-attention-backend"):
            backend = value_of(argv, flag)
            if backend in GPU_ONLY_BACKENDS:
                raise UsageError(f"{flag} {backend} needs a GPU; this machine runs SGLang's CPU "
                                 "engine (torch_native, the default here, or triton)")


def sglang_parser():
    """SGLang's server parser after the plugins loaded (our flag groups first, see
    ``sglang_pic.launcher.sglang_launcher``), reporting errors in one line."""
    from sglang.srt.server_args import ServerArgs

    from sglang_pic.launcher.server_flags import OneLineParser

    parser = OneLineParser(prog=SERVE_PROG,
                            usage=f"{SERVE_PROG} [sglang-pic flags] [SGLang server flags]")
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:
        if "--model-path" in action.option_strings:
            action.required = False  # the launcher's default model
    return parser


def _build() -> None:
    """Build SGLang's parser as the server process does, and cache its option strings."""
    from sglang_pic.cpu import support as cpu_support

    if environment.is_on("SGLANG_USE_CPU_ENGINE") or not cpu_support.has_cuda():
        cpu_support.enable_cpu_engine()  # before SGLang's first import
    from sglang.srt.plugins import load_plugins

    load_plugins()
    save(option_strings(sglang_parser()))


if __name__ == "__main__":
    _build()
