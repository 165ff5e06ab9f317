#!/usr/bin/env bash
# The conformance suite's long mode (docs/conformance.md): random programs of collectives on
# 2-4 ranks under every lane configuration, each result against a single-process reference.
#   bash scripts/conformance.sh --seeds 0-499
#   bash scripts/conformance.sh --config tcp --np 3 --seeds 17      # replay one seed
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" tests/conformance/long.py "$@"
