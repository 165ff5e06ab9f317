"""hvdlite.jax on 2 real ranks: every collective eagerly and inside jax.jit against
single-process references, gradients, the cross-rank errors, zero-copy DLPack, the pytree
broadcast and custom training loops (optax and optax-free) equal to one process on the global
batch. One launch; each test judges one check.

Without JAX these tests skip; HVDLITE_REQUIRE_JAX=1 (set by .ci/run) makes that a failure.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from util import Run

HAVE_JAX = importlib.util.find_spec("jax") is not None
HAVE_OPTAX = importlib.util.find_spec("optax") is not None
# Quiet, single-threaded XLA and TensorFlow in every rank (2-core machine).
JAX_ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
           "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_PLATFORMS": "cpu",
           "HVDLITE_START_TIMEOUT": "120"}


def require_jax() -> None:
    if HAVE_JAX:
        return
    reason = "JAX is not installed; pip install 'hvdlite[jax]'"
    if os.environ.get("HVDLITE_REQUIRE_JAX") == "1":
        pytest.fail(f"{reason} (HVDLITE_REQUIRE_JAX=1)", pytrace=False)
    pytest.skip(f"{reason}, or set HVDLITE_REQUIRE_JAX=1 to make this a failure")


CHECKS = [f"{c}_{m}" for m in ("eager", "jit") for c in ("allreduce", "grouped", "move",
                                                         "errors")] + [
    "gradient", "objects_and_control", "zero_copy", "elastic_state", "loop_plain"] + \
    (["loop_optax"] if HAVE_OPTAX else [])

_runs: dict = {}


def _run() -> Run:
    if "ops" not in _runs:
        _runs["ops"] = Run("jax_ops.py", np=2, env=JAX_ENV, timeout=240, check_exit=False,
                           detail_lines=40)
    return _runs["ops"]


@pytest.mark.timeout(300)
def test_jax_ops_finished():
    require_jax()
    _run().finished()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CHECKS)
def test_jax_ops(name):
    require_jax()
    _run().check(name)
