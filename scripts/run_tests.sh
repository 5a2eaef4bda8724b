#!/usr/bin/env bash
# The project's test command (`make test`): set up the environment if needed, lint, run pytest.
# pytest's exit code 5 ("no tests collected") is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
VENV="${VENV:-.venv}"
"$VENV/bin/ruff" check python sgl-kernel benchmark test || exit 1
"$VENV/bin/python" -m pytest test --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; treating as failure" >&2
  exit 1
fi
exit "$rc"
