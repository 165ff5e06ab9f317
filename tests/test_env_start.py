"""Ranks started by torchrun, or by hand with Horovod's variables, join a job without hvdlite-run."""
import subprocess
import sys

import pytest

from util import WORKERS, free_port, spawn_ranks


@pytest.mark.timeout(120)
def test_started_by_torchrun():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), str(WORKERS / "env_start.py")],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK rank=0 size=2 local=0/2" in proc.stdout
    assert "OK rank=1 size=2 local=1/2" in proc.stdout
    assert proc.stdout.count("mpi_loaded=False") == 2, proc.stdout


@pytest.mark.timeout(120)
def test_started_with_horovod_variables():
    res = spawn_ranks("env_start.py", np=3)
    for r, p in enumerate(res):
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"OK rank={r} size=3 local={r}/3 mpi_loaded=False" in p.stdout
    # No secret given: rank 0 says once that the control plane runs unauthenticated.
    assert res[0].stderr.count("the control plane runs UNAUTHENTICATED") == 1, res[0].stderr
    assert "UNAUTHENTICATED" not in res[1].stderr + res[2].stderr


@pytest.mark.timeout(120)
def test_horovod_variables_with_a_secret_file(tmp_path):
    """HVDLITE_SECRET_FILE authenticates the control plane: no warning, the job runs."""
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef" * 4 + "\n")
    res = spawn_ranks("env_start.py", np=2, env={"HVDLITE_SECRET_FILE": str(secret)})
    for r, p in enumerate(res):
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"OK rank={r} size=2" in p.stdout
        assert "UNAUTHENTICATED" not in p.stderr


@pytest.mark.timeout(60)
def test_single_process_without_any_launcher():
    proc = subprocess.run([sys.executable, str(WORKERS / "env_start.py")], capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "OK rank=0 size=1 local=0/1" in proc.stdout
