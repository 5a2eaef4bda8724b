"""A fresh interpreter that loads the plugin as SGLang does: for the tests of what it refuses.

Each run is forked from this test worker's *plain* zygote (``server_zygote``, ``--plain``): a
Python that imported torch and SGLang's heavy modules once, nothing of ours and no CPU engine
selected, as a fresh ``python -c`` would have them. The child runs the code with this process's
environment, so a plugin load costs its own work, not SGLang's imports again (~9 s each).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from server_zygote import ZygoteClient

_zygote: ZygoteClient | None = None


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` as ``python -c`` does, with ``env`` added to this one's environment."""
    global _zygote
    if _zygote is None:
        log = Path(tempfile.gettempdir()) / f"sglang-pic-test-plain-zygote-{os.getpid()}.log"
        _zygote = ZygoteClient(dict(os.environ), log, plain=True)
    return _zygote.run_python(code, {**os.environ, **(env or {})}, timeout=240)


def refused(setup: str) -> str:
    """Run ``setup``, then SGLang's plugin loader, in a fresh interpreter; the process must stop
    instead of serving. Returns its stderr."""
    out = run_python(setup + "\nfrom sglang.srt.plugins import load_plugins; load_plugins(); "
                     "print('SERVED')")
    assert out.returncode != 0
    assert "SERVED" not in out.stdout
    assert "refusing to start" in out.stderr
    return out.stderr
