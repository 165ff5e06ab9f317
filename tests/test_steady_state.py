"""The decentralised steady state (hvdlite/common/steady.py) on 3 real ranks, gloo and MPI.

Worker: tests/workers/steady_state.py, one `CHECK <name> OK|FAIL` line per check and rank.
- steady_hits: after a few steps, cached tensors are released by rounds between the ranks, with
  no message to the coordinator (engine counters), results equal to the local reference;
- changed_shape: a changed shape after the steady state falls back to full negotiation and
  raises today's mismatch error on every rank; the job returns to the steady state;
- join: uneven inputs with hvd.join() across the steady state;
- process_set: a static set [0, 1] reaches its own steady state beside the global one.
The stall case (a rank that stops submitting) is in test_errors.py.
"""
from __future__ import annotations

import pytest

from test_process_sets import _assert_check, _assert_finished
from util import hvdlite_run, rank_lines

CHECKS = ["steady_hits", "changed_shape", "join", "process_set"]


def _launch(launcher_args=None) -> dict:
    proc = hvdlite_run("steady_state.py", np=3, timeout=150, launcher_args=launcher_args)
    return {"script": "steady_state.py", "np": 3,
            "output": proc.stdout + "\n--- stderr\n" + proc.stderr,
            "lines": {r: rank_lines(proc.stdout, r) for r in range(3)}}


@pytest.fixture(scope="module")
def gloo_run():
    return _launch()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", CHECKS)
def test_steady_state_gloo(gloo_run, name):
    _assert_check(gloo_run, name)


def test_steady_state_gloo_finished(gloo_run):
    _assert_finished(gloo_run)


@pytest.fixture(scope="module")
def mpi_run():
    from test_mpi import HAVE_MPI
    if not HAVE_MPI:
        pytest.skip("mpi4py/mpiexec not installed (pip install mpi4py mpich)")
    return _launch(["--mpi"])


@pytest.mark.timeout(180)
def test_steady_state_mpi(mpi_run):
    for name in CHECKS:
        _assert_check(mpi_run, name)
    _assert_finished(mpi_run)
