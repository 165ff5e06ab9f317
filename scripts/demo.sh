#!/usr/bin/env bash
# Set up, then train a small model on 2 ranks with hvdlite-run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hvdlite-run -np "${NP:-2}" .venv/bin/python examples/pytorch/pytorch_train.py "$@"
