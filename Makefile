# Two commands do everything on a fresh machine; each creates .venv first if it is missing.
#   make serve   the SGLang server with sglang-pic (embedded SmolLM2 unless ARGS names a model)
#   make test    lint (ruff) + the test suite
ARGS ?=
VENV ?= .venv

.PHONY: serve test env

env:
	@bash scripts/setup_env.sh

serve: env
	$(VENV)/bin/sglang-pic serve $(ARGS)

test:
	@bash scripts/run_tests.sh $(ARGS)
