#!/usr/bin/env bash
# `make test-gpu`: the tests marked `gpu` (and every kernel test, at its GPU sizes: test/kernels and
# the unit tests parametrized with the kernel ops) on a CUDA machine,
# with python/ and sgl-kernel/ from this tree on the path. test/gpu starts servers on the embedded
# SmolLM2 model: stage it first (its GGUF package on PYTHONPATH, SGLANG_PIC_CACHE set; see
# benchmark/quality/real_weights.py); without it those tests fail at the model fixture. Writes the log, headed by the machine and
# versions, to ${GPU_TEST_LOG:-benchmark/results/gpu_tests.log}.
set -uo pipefail
cd "$(dirname "$0")/.."
log="${GPU_TEST_LOG:-benchmark/results/gpu_tests.log}"
export PYTHONPATH="$PWD/python:$PWD/sgl-kernel/python${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "# make test-gpu, $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "import sglang; print('sglang', sglang.__version__)" 2>&1
  git rev-parse --short HEAD 2>/dev/null || true
} > "$log"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "run_gpu_tests: no CUDA device" | tee -a "$log" >&2; exit 1; }
# GPU_TEST_PATHS: the folders or modules to run (default all three; pytest's --ignore does not
# drop a path named on its command line, so a device call that runs part of them names it here)
read -r -a paths <<< "${GPU_TEST_PATHS:-test/kernels test/gpu test/unit}"
[ "${#paths[@]}" -gt 0 ] || paths=(test/kernels test/gpu test/unit)
python3 -m pytest -p no:cacheprovider -o addopts="" "${paths[@]}" \
  -m "gpu or kernels" -q \
  -W ignore::DeprecationWarning "$@" 2>&1 | tee -a "$log"
exit "${PIPESTATUS[0]}"
