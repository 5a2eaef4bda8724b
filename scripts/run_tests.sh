#!/usr/bin/env bash
# The project's test command (`make test`): set up the environment if needed, lint, run pytest.
# pytest's exit code 5 ("no tests collected") is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
VENV="${VENV:-.venv}"
"$VENV/bin/ruff" check python sgl-kernel benchmark test || exit 1
# Two workers, each taking whole work units: a test file, or the group of files sharing a session
# server (test/conftest.py gives each test its xdist_group), so a server is never started twice;
# units go out in collection order, longest first (conftest's HEAVY_FIRST). Each CPU server runs
# torch on one thread, so two workers keep both cores busy.
# TEST_PATHS: the folders to collect, separated by spaces (the Makefile's tier targets name
# theirs, so a tier does not import the others' modules only to deselect them); default `test`
workers="${PYTEST_WORKERS:-2}"
read -r -a paths <<< "${TEST_PATHS:-test}"
[ "${#paths[@]}" -gt 0 ] || paths=(test)
"$VENV/bin/python" -m pytest "${paths[@]}" --durations=15 -n "$workers" --dist loadgroup \
  --no-loadscope-reorder "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; treating as failure" >&2
  exit 1
fi
exit "$rc"
