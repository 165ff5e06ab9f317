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
# TensorFlow for hvdlite.tensorflow (the CPU build of 2.21, with Keras 3), and tf_keras for the
# Keras 2 path (TF_USE_LEGACY_KERAS=1). tf_keras goes in with --no-deps: it asks for the full
# `tensorflow` wheel, whose module tensorflow-cpu already provides. Checked without importing
# TensorFlow, so a second run stays fast. HVDLITE_SKIP_TENSORFLOW=1 leaves TensorFlow out (its
# tests then skip).
if [ "${HVDLITE_SKIP_TENSORFLOW:-0}" != "1" ] && ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('tensorflow') and u.find_spec('keras') and u.find_spec('tf_keras') else 1)" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check tensorflow-cpu==2.21.0
  .venv/bin/pip install -q --disable-pip-version-check --no-deps tf_keras==2.21.0
fi
# JAX for hvdlite.jax and Keras on JAX (CPU build), and optax for its training-loop tests.
# HVDLITE_SKIP_JAX=1 leaves them out (tests/test_jax.py then skips, unless HVDLITE_REQUIRE_JAX=1).
if [ "${HVDLITE_SKIP_JAX:-0}" != "1" ] && ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('jax') and u.find_spec('optax') else 1)" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check "jax[cpu]==0.10.2" optax==0.2.8
fi
# Ray for hvdlite.ray (the `ray` extra: Ray 2.60 with Ray Train), checked without importing it.
# HVDLITE_SKIP_RAY=1 leaves it out (tests/test_ray.py then skips, unless HVDLITE_REQUIRE_RAY=1).
if [ "${HVDLITE_SKIP_RAY:-0}" != "1" ] && ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('ray') and u.find_spec('pyarrow') and u.find_spec('tensorboardX') else 1)" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check "ray[train]>=2.60,<2.61"
fi
# Bytecode for hvdlite and the tests, written now: where PYTHONDONTWRITEBYTECODE=1 is set (as on
# this project's machines), Python never writes it, and every rank of every job compiled
# hvdlite's ~75 modules from source again (~0.25 s a process; the editable install leaves no
# .pyc behind as a wheel install would). Only files changed since the last run are compiled.
.venv/bin/python -m compileall -q -j 0 hvdlite tests benchmarks examples >/dev/null
