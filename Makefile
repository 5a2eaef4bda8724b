# Two commands do everything on a fresh machine; each creates .venv first if it is missing.
#   make serve   the SGLang server with sglang-pic (embedded SmolLM2 unless ARGS names a model)
#   make test    lint (ruff) + the test suite
ARGS ?=
VENV ?= .venv

.PHONY: serve test test-latest test-unit test-kernels test-gpu env

env:
	@bash scripts/setup_env.sh

serve: env
	$(VENV)/bin/sglang-pic serve $(ARGS)

test:
	@TEST_PATHS=test bash scripts/run_tests.sh $(ARGS)

# The unit and server tiers on SGLang 0.5.23, in its own environment (.venv-latest, created on
# first use like .venv). Tests of a capability 0.5.23 does not serve yet are skipped with the
# gap's line (sglang_pic/compat/gaps.py); the kernel tier is ours and runs in `make test`.
test-latest:
	@VENV=.venv-latest SGLANG_RELEASE=0.5.23 TEST_PATHS="test/unit test/server" \
		bash scripts/run_tests.sh -m "not gpu and not kernels" $(ARGS)

# The unit tier alone: every test that starts no SGLang (no server, Engine or fleet) and runs
# no Triton kernel under the interpreter.
test-unit:
	@TEST_PATHS=test/unit bash scripts/run_tests.sh -m "not server and not gpu and not kernels" $(ARGS)

# The kernel tier alone: our Triton kernels under the interpreter on CPU, against their references.
test-kernels:
	@TEST_PATHS="test/kernels test/unit" bash scripts/run_tests.sh -m "kernels and not gpu" $(ARGS)

# On the device (after the devkit's three steps, see docs/benchmarks.md): the GPU-marked tests
# and the kernel tests at model sizes; the log goes to benchmark/results/ with machine and versions.
test-gpu:
	@bash scripts/run_gpu_tests.sh
