#!/usr/bin/env bash
# The project's test command (`make test`): set up the environment if needed, lint, run pytest.
# pytest's exit code 5 ("no tests collected") is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
VENV="${VENV:-.venv}"
"$VENV/bin/ruff" check python sgl-kernel benchmark test || exit 1
# Two workers, each taking whole test files (a module's shared server stays in one worker); each
# CPU server runs torch on one thread, so two workers keep both cores busy.
workers="${PYTEST_WORKERS:-2}"
"$VENV/bin/python" -m pytest test --durations=15 -n "$workers" --dist loadfile "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; treating as failure" >&2
  exit 1
fi
exit "$rc"
