#!/usr/bin/env bash
# Lint and type checks, as CI runs them (.ci/run, before the tests):
#   bash scripts/lint.sh          # check: ruff check, ruff format --check, mypy; non-zero on a finding
#   bash scripts/lint.sh --fix    # apply ruff's safe fixes and its formatter, then check
# ruff's rules and mypy's strictness are in pyproject.toml ([tool.ruff], [tool.mypy]); the
# versions are pinned in the `lint` extra (part of `test`), which this installs into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PATHS=(hvdlite tests benchmarks examples scripts/docs_hooks.py)
if [ ! -x .venv/bin/python ]; then
  bash scripts/setup.sh
fi
bash scripts/install_extra.sh lint
if [ "${1:-}" = --fix ]; then
  .venv/bin/ruff check --fix "${PATHS[@]}" || true
  .venv/bin/ruff format "${PATHS[@]}"
fi
status=0
echo "== ruff check"; .venv/bin/ruff check --output-format concise "${PATHS[@]}" || status=1
echo "== ruff format --check"; .venv/bin/ruff format --check --output-format concise "${PATHS[@]}" || status=1
echo "== mypy"; .venv/bin/mypy || status=1
exit $status
