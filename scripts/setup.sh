#!/usr/bin/env bash
# Create .venv (once) with the CPU build of torch and hvdlite installed in editable mode.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch==2.13.0 is the CPU build available from this machine's package cache; the package itself
# accepts any torch >= 2.1.
if ! .venv/bin/python -c "import torch, pytest, pytest_timeout, cloudpickle, psutil" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
fi
if ! .venv/bin/python -c "import hvdlite.runner" 2>/dev/null || [ pyproject.toml -nt .venv/.hvdlite-installed ]; then
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
  touch .venv/.hvdlite-installed
fi
