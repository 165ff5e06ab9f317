"""Horovod 0.28 compatibility of the whole public surface (issue 10), on 2 and 4 real ranks:
exception classes on every rank (eager PyTorch; TensorFlow eagerly and in tf.function, where
Horovod's kernels raise tf.errors.FailedPreconditionError / InvalidArgumentError), accepted
argument types, result dtypes, process-set arguments, and hvdlite.keras (horovod.keras's API)
training on Keras 3's TensorFlow, PyTorch and JAX backends to the single-process result.

One launch per worker and rank count (TensorFlow imports slowly); each test judges one check.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from tf_launch import SKIP_NO_TF, Run  # noqa: E402

HAVE_KERAS = importlib.util.find_spec("keras") is not None

TORCH_CHECKS = ["grouped_result_types", "alltoall_errors", "reducescatter_adasum", "mismatch",
                "process_sets", "init_arguments"]
TF_CHECKS = [f"{c}_{m}" for m in ("eager", "function")
             for c in ("mismatch", "invalid", "sparse_dtype", "partial_tape")] + [
    "scalars_and_arrays", "sync_batch_norm", "process_set_args", "duplicate_sets"]
KERAS_CHECKS = ["api", "collectives", "fit", "lr_callbacks", "accumulation_and_groups",
                "partial_optimizer", "elastic_state", "load_model"]

_runs: dict = {}


def _run(script: str, np: int, env=None, timeout=300) -> Run:
    key = (script, np, tuple(sorted((env or {}).items())))
    if key not in _runs:
        _runs[key] = Run(script, np=np, env=env, timeout=timeout)
    return _runs[key]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np_", [2, 4])
@pytest.mark.parametrize("name", TORCH_CHECKS)
def test_torch_compat(np_, name):
    run = _run("compat_torch.py", np_, timeout=150)
    run.finished()
    run.check(name)


@SKIP_NO_TF
@pytest.mark.timeout(420)
@pytest.mark.parametrize("np_", [2, 4])
@pytest.mark.parametrize("name", TF_CHECKS)
def test_tf_compat(np_, name):
    run = _run("compat_tf.py", np_, timeout=360)
    run.finished()
    run.check(name)


@pytest.mark.skipif(not HAVE_KERAS, reason="Keras 3 is not installed")
@pytest.mark.timeout(480)
@pytest.mark.parametrize("backend", ["tensorflow", "torch", "jax"])
@pytest.mark.parametrize("name", KERAS_CHECKS)
def test_keras_compat(backend, name):
    if backend == "tensorflow" and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed")
    env = {"KERAS_BACKEND": backend}
    if backend == "jax":
        # On JAX the compiled step is the path that matters (gradients reduced by host
        # callbacks inside jax.jit); compat_keras.py calls the optimizer eagerly too.
        from test_jax import JAX_ENV, require_jax
        require_jax()
        env.update(JAX_ENV, KERAS_JIT_COMPILE="1")
    # (On JAX every fit compiles its step: 75 s for the fit check alone on 2 busy cores.)
    run = _run("compat_keras.py", 2, env=env, timeout=420 if backend == "jax" else 240)
    run.finished()
    run.check(name)


@pytest.mark.skipif(not HAVE_KERAS, reason="Keras 3 is not installed")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_horovod_keras_example_runs_unchanged(backend, tmp_path):
    """examples/keras/keras_mnist_like.py: a horovod.keras script with only the import changed."""
    if backend == "tensorflow" and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed")
    from util import ROOT
    run = Run(str(ROOT / "examples" / "keras" / "keras_mnist_like.py"), np=2, timeout=240,
              env={"KERAS_BACKEND": backend, "EPOCHS": "1", "CHECKPOINT_DIR": str(tmp_path)})
    assert run.returncode == 0, run.output[-4000:]
    assert any(f"backend {backend}: final loss" in line for line in run.lines[0]), \
        run.output[-4000:]
