"""The launcher imports no framework: `hvdlite-run --help` and the drivers start without torch,
TensorFlow or the engine (they would cost seconds at every start, and load CUDA)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HVDLITE_RUN = str(Path(sys.executable).parent / "hvdlite-run")
FORBIDDEN = ("torch", "tensorflow", "numpy", "hvdlite.common.engine", "hvdlite.common.basics")


def _env(extra_path: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT)) if p)
    return env


@pytest.mark.timeout(60)
def test_help_without_torch_importable(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('torch is not importable in this test')\n")
    out = subprocess.run([HVDLITE_RUN, "--help"], capture_output=True, text=True, timeout=50,
                         env=_env(str(tmp_path)))
    assert out.returncode == 0, out.stderr
    assert "--hierarchical-allreduce" in out.stdout and "usage: hvdlite-run" in out.stdout


@pytest.mark.timeout(60)
def test_runner_modules_import_no_framework():
    code = ("import sys, hvdlite.runner.launch, hvdlite.runner.driver, "
            "hvdlite.runner.elastic_driver, hvdlite.runner.api\n"
            f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
            "assert not bad, f'the runner imported {bad}'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50, env=_env())
    assert out.returncode == 0, out.stderr


@pytest.mark.timeout(60)
def test_steady_state_protocol_imports_no_framework():
    """steady.py (the steady state's rounds, which benchmarks/control_plane.py drives with
    hundreds of simulated ranks) and arith.py, whose rank-order sum it uses on numpy payloads,
    load no framework."""
    code = ("import sys, hvdlite.common.steady, hvdlite.common.arith\n"
            "bad = [m for m in ('torch', 'tensorflow') if m in sys.modules]\n"
            "assert not bad, f'the steady-state protocol imported {bad}'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50, env=_env())
    assert out.returncode == 0, out.stderr
