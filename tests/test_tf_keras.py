"""hvdlite.tensorflow.keras on 2 real ranks: `model.fit` with DistributedOptimizer and the
callbacks gives weights identical on every rank and equal to a single-process run on the global
batch; save/load with plain Keras; custom loops; XLA; Keras 2 scripts under
TF_USE_LEGACY_KERAS=1; a clear error for another Keras backend; and elastic Keras training that
survives a killed worker.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from tf_launch import HAVE_TF_KERAS, SKIP_NO_TF, TF_ENV, Run, worker_path  # noqa: E402
from util import clean_env  # noqa: E402

pytestmark = SKIP_NO_TF

ROOT = Path(__file__).resolve().parent.parent
HVDLITE_RUN = str(Path(sys.executable).parent / "hvdlite-run")

KERAS3_CHECKS = ["fit_SGD", "fit_Adam", "fit_AdamW", "fit_RMSprop", "fit_options",
                 "process_set", "backward_passes_per_step", "lr_callbacks", "sync_batch_norm_fit", "save_load",
                 "best_checkpoint", "custom_loop", "sparse_and_modes", "xla",
                 "bad_optimizer"]
LEGACY_CHECKS = ["fit_SGD", "fit_Adam", "process_set", "backward_passes_per_step", "lr_callbacks",
                 "sync_batch_norm_fit", "save_load", "best_checkpoint", "custom_loop",
                 "bad_optimizer"]


@pytest.fixture(scope="module")
def keras3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keras3")
    return Run("tf_keras_train.py", np=2, args=[str(tmp)], timeout=360)


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    if not HAVE_TF_KERAS:
        pytest.skip("tf_keras is not installed (needed for TF_USE_LEGACY_KERAS=1)")
    tmp = tmp_path_factory.mktemp("legacy")
    return Run("tf_keras_train.py", np=2, args=[str(tmp), "quick"],
               env={"TF_USE_LEGACY_KERAS": "1"}, timeout=360)


@pytest.mark.timeout(420)
def test_keras3_finished(keras3):
    keras3.finished()


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", KERAS3_CHECKS)
def test_keras3(keras3, name):
    keras3.check(name)


@pytest.mark.timeout(420)
def test_legacy_keras_finished(legacy):
    legacy.finished()


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", LEGACY_CHECKS)
def test_legacy_keras(legacy, name):
    legacy.check(name)


@pytest.mark.timeout(120)
def test_other_keras_backend_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env.update(TF_ENV)
    env.update({"KERAS_BACKEND": "jax",
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    out = subprocess.run([sys.executable, "-c", "import hvdlite.tensorflow.keras"],
                         capture_output=True, text=True, timeout=110, env=env)
    assert out.returncode != 0
    assert "hvdlite.tensorflow.keras needs Keras on the TensorFlow backend" in out.stderr, \
        out.stderr[-3000:]
    assert "'jax' backend" in out.stderr and "KERAS_BACKEND=tensorflow" in out.stderr


# --------------------------------------------------------------------------- elastic

def _progress(marks: Path, worker: str) -> int:
    try:
        return int((marks / f"step.{worker}").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_elastic_keras_state_survives_killed_worker(tmp_path, backend):
    """Rank 1 is SIGKILLed in the middle of an epoch of model.fit: rank 0's allreduce (inside
    the compiled train step) fails, KerasState rolls back to the last commit, the job re-forms
    with rank 0 alone and finishes; the weights equal a single-process run exactly and every
    epoch was committed once. `jax`: hvdlite.keras on Keras 3's JAX backend (the allreduce is a
    host callback inside the jitted step)."""
    if backend == "jax":
        from test_jax import JAX_ENV, require_jax
        require_jax()
    marks = tmp_path / "marks"
    marks.mkdir()
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    env = clean_env()
    env.update(TF_ENV)
    env.update({"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "ELASTIC_MARK_DIR": str(marks), "TF_ELASTIC_STALL_AT": "6",
                "TF_ELASTIC_EPOCHS": "5"})
    if backend == "jax":
        env.update(JAX_ENV)
        env["KERAS_BACKEND"] = "jax"
    cmd = [HVDLITE_RUN, "--host-discovery-script", str(script), "-np", "2", "--min-np", "1",
           "--max-np", "2", sys.executable, worker_path("tf_keras_elastic.py")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    victim = "127.0.0.1_0"
    try:
        deadline = time.monotonic() + 200
        while _progress(marks, victim) < 6:
            if proc.poll() is not None or time.monotonic() > deadline:
                out, err = proc.communicate(timeout=30)
                pytest.fail(f"rank 1 never reached step 6 (exit {proc.returncode}):\n"
                            f"{out[-3000:]}\n{err[-6000:]}")
            time.sleep(0.1)
        os.kill(int((marks / f"pid.{victim}").read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 0, err[-6000:]
    assert "rolling back to the last commit" in err, err[-6000:]
    lines = [line.split("RESULT ", 1)[1] for line in out.splitlines() if "RESULT " in line]
    assert lines, out[-3000:] + err[-3000:]
    result = json.loads(lines[0])
    assert result["epoch"] == 5
    assert result["trace"] == [0, 1, 2, 3, 4], "an epoch was lost or committed twice"
    assert result["size"] == 1 and result["reset_sizes"] == [1]
    assert result["max_diff"] <= 1e-6, result
    assert result["iterations"] == result["ref_iterations"]
