"""A fresh interpreter that loads the plugin as SGLang does: for the tests of what it refuses."""

from __future__ import annotations

import os
import subprocess
import sys


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, with ``env`` added to this one's environment."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=None if env is None else {**os.environ, **env})


def refused(setup: str) -> str:
    """Run ``setup``, then SGLang's plugin loader, in a fresh interpreter; the process must stop
    instead of serving. Returns its stderr."""
    out = run_python(setup + "\nfrom sglang.srt.plugins import load_plugins; load_plugins(); "
                     "print('SERVED')")
    assert out.returncode != 0
    assert "SERVED" not in out.stdout
    assert "refusing to start" in out.stderr
    return out.stderr
