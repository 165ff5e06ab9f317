"""`hvdlite-run --dry-run` prints the plan and starts nothing (SLURM's and the MPI hostfile's plans
are checked in test_slurm.py and test_kubernetes.py)."""
import subprocess
import sys

import pytest
from util import HVDLITE_RUN, clean_env


@pytest.mark.timeout(60)
def test_dry_run_prints_each_ranks_command_and_starts_nothing(tmp_path):
    marker = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    proc = subprocess.run([HVDLITE_RUN, "-np", "3", "-H", "localhost:2,127.0.0.2:2", "-p", "2222",
                           "--dry-run", *command], capture_output=True, text=True,
                          env=clean_env(), timeout=50, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "environment: -H/--hosts"
    assert lines[1] == "hosts: localhost:2, 127.0.0.2:2"
    assert lines[2] == "ranks per host: localhost: 2 (rank 0-1), 127.0.0.2: 1 (rank 2)"
    assert lines[3] == "commands:"
    assert lines[4].startswith("  rank 0 on localhost: HVDLITE_RANK=0 HVDLITE_SIZE=3 "
                               "HVDLITE_LOCAL_RANK=0 HVDLITE_LOCAL_SIZE=2")
    assert lines[6].startswith("  rank 2 on 127.0.0.2: ssh ") and " -p 2222 " in lines[6]
    assert "HVDLITE_SECRET" not in proc.stdout     # the secret is never printed
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_dry_run_in_a_plain_shell_says_no_scheduler():
    proc = subprocess.run([HVDLITE_RUN, "-np", "2", "--dry-run", "python", "train.py"],
                          capture_output=True, text=True, env=clean_env(), timeout=50,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("environment: none (no scheduler or launcher variables")
    assert "ranks per host: localhost: 2 (rank 0-1)" in proc.stdout
