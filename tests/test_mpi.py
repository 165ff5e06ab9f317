"""The MPI transport (mpi4py over the mpich wheel): a job started by mpiexec directly."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from util import ROOT, WORKERS, clean_env

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
try:
    import mpi4py  # noqa: F401
    HAVE_MPI = MPIEXEC is not None
except ImportError:
    HAVE_MPI = False

pytestmark = pytest.mark.skipif(not HAVE_MPI, reason="mpi4py/mpiexec not installed "
                                                     "(pip install mpi4py mpich)")


def mpiexec(script: str | Path, np: int, timeout: float = 120, env: dict | None = None,
            args: tuple = ()):
    """Run a worker (a name under tests/workers, or a path) under mpiexec, as users do."""
    path = script if isinstance(script, Path) else WORKERS / script
    e = clean_env()
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([MPIEXEC, "-n", str(np), sys.executable, str(path), *args],
                          capture_output=True, text=True, timeout=timeout, env=e)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np", [2, 4])
def test_job_started_by_mpiexec_uses_mpi(np):
    proc = mpiexec("mpi_direct.py", np)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(np):
        assert f"OK rank {r}" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.timeout(150)
def test_distributed_optimizer_flat_gradients_on_mpi():
    """The optimizer checks (tests/test_torch_optimizer.py) under mpiexec, one core per rank
    and MPI's own data path (its waits spin): the gradients go as one flat buffer
    (torch/flat_grads.py), reduced on MPI, and every check matches its single-process
    reference."""
    proc = mpiexec("torch_optimizer_checks.py", 2, env={"HVDLITE_MPI_WAIT": "spin"},
                   args=("--path", "flat"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # (The ranks' lines may interleave: count, do not parse.) The worker asserts that the flat
    # path was taken where it should be.
    assert proc.stdout.count("checks, 0 failed") == 2, out[-4000:]
    assert proc.stdout.count("CHECK flat_gradients OK") == 2, out[-4000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("env,small,large", [
    ({"HVDLITE_MPI_WAIT": "yield"}, True, True),
    ({"HVDLITE_MPI_WAIT": "spin", "HVDLITE_MPI_SHM_MIN_MB": "1"}, False, True),
    ({"HVDLITE_MPI_WAIT": "spin", "HVDLITE_MPI_SHM_MIN_MB": "0"}, False, False),
    ({"HVDLITE_MPI_WAIT": "yield", "HVDLITE_SHM": "0"}, False, False)],
    ids=["yield", "spin", "spin-min-0", "yield-shm-off"])
def test_shared_memory_carries_what_it_does_best(env, small, large):
    """Where MPI waits yield the core (ranks outnumber cores; forced here), allreduce,
    reducescatter, allgather and broadcast data goes through hvdlite's shared-memory channel,
    which sleeps where MPICH would spin. Where they spin, only collectives of
    HVDLITE_MPI_SHM_MIN_MB and more do (MPICH is faster below, the channel above:
    backends/mpi.LARGE_MB, 32 MiB; 1 MiB here, which the worker's large tensors pass), some of
    them submitted between small ones that take MPI; HVDLITE_MPI_SHM_MIN_MB=0 and
    HVDLITE_SHM=0 keep MPI for all. Results are exact either way (the whole worker: every dtype and op,
    process sets, join, large tensors)."""
    proc = mpiexec("mpi_direct.py", 2, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        found = re.search(rf"OK rank {r} shm_collectives (\d+) (\d+)", proc.stdout)
        assert found, proc.stdout + proc.stderr
        before, after = int(found.group(1)), int(found.group(2))
        line = found.group(0)
        assert (before > 0) == small, (env, line)
        # (The large section's async allreduces may fuse: count none or some, not each.)
        assert (after > before) == large, (env, line)


@pytest.mark.timeout(150)
def test_by_default_the_channel_starts_at_32_mib():
    """With HVDLITE_MPI_SHM_MIN_MB unset and waits that spin, the shared-memory channel takes
    the collectives of 32 MiB and more on both ranks (backends/mpi.LARGE_MB says why), and the
    whole worker's results are exact."""
    proc = mpiexec("mpi_direct.py", 2, env={"HVDLITE_MPI_WAIT": "spin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = re.findall(r"OK rank \d shm_collectives \d+ \d+ from (\d+)", proc.stdout)
    assert starts == [str(32 << 20)] * 2, proc.stdout + proc.stderr


@pytest.mark.timeout(150)
def test_ranks_agree_on_where_the_channel_starts():
    """HVDLITE_MPI_SHM_MIN_MB set differently on the two ranks (1 on rank 0, 0 on rank 1): the
    ranks agree (0 on any rank keeps MPI for all), so every collective takes the same path on
    both; routed apart, a large one would wait on two transports until the timeout."""
    path = WORKERS / "mpi_direct.py"
    e = clean_env()
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    e["HVDLITE_MPI_WAIT"] = "spin"
    proc = subprocess.run([MPIEXEC, "-n", "1", "-env", "HVDLITE_MPI_SHM_MIN_MB", "1",
                           sys.executable, str(path), ":",
                           "-n", "1", "-env", "HVDLITE_MPI_SHM_MIN_MB", "0",
                           sys.executable, str(path)],
                          capture_output=True, text=True, timeout=120, env=e)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        assert f"OK rank {r} shm_collectives 0 0" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["spin", "yield"])
def test_a_call_nobody_matches_times_out(mode):
    """MPI's own Wait has no timeout: a rank whose peer never makes the matching call waited
    forever, silently. hvdlite's waits end in MPITimeout after the transport timeout (2 s here),
    naming the rank and the fix, in both waiting modes; the request still completes once the
    peer arrives. A wait whose communicator is abandoned (the job has failed) ends at once."""
    proc = mpiexec("mpi_timeout.py", 2, env={"HVDLITE_MPI_WAIT": mode}, timeout=45)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    found = re.search(r"TIMEOUT after ([\d.]+) s: MPI allreduce did not complete within 2 s on "
                      r"rank 0: .* HOROVOD_GLOO_TIMEOUT_SECONDS", proc.stdout)
    assert found, out
    assert 1.9 <= float(found.group(1)) < 3.5, found.group(0)
    # Abandoned (the job failed): the wait ends at once, not at the timeout; shutdown no
    # longer waits for it (every rank of a failed job took 10 s longer to exit).
    found = re.search(r"ABANDONED after ([\d.]+) s: MPI allreduce given up on rank 0: the job "
                      r"had failed", proc.stdout)
    assert found, out
    assert float(found.group(1)) < 1.5, found.group(0)
    for r in range(2):
        assert f"OK rank {r} mode {mode}" in proc.stdout, out


@pytest.mark.timeout(150)
def test_run_api_with_use_mpi(monkeypatch):
    """horovod.run(use_mpi=True): the ranks start under mpiexec and run their collectives on
    MPI; the values come back in rank order, and a rank's exception with its traceback."""
    from hvdlite.runner import run

    def work(x):            # (local functions travel by value)
        import torch

        import hvdlite.torch as hvd
        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + x)]), op=hvd.Sum).item()
        out = (hvd.rank(), hvd.size(), bool(hvd.mpi_enabled()), total)
        hvd.shutdown()
        return out

    def boom():
        import os
        if os.environ.get("PMI_RANK") == "1":
            raise ValueError("boom from MPI rank 1")
        return "fine"

    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    got = run(work, args=(10,), num_proc=2, use_mpi=True)
    assert got == [(0, 2, True, 21.0), (1, 2, True, 21.0)], got
    with pytest.raises(RuntimeError) as info:
        run(boom, num_proc=2, use_mpi=True)
    text = str(info.value)
    assert text.startswith("rank 1 raised an exception"), text
    assert "ValueError: boom from MPI rank 1" in text, text


@pytest.mark.timeout(150)
def test_mpirun_job_with_gloo_transport():
    """HOROVOD_CPU_OPERATIONS=gloo under mpiexec: ranks meet over MPI, data goes over gloo."""
    proc = mpiexec("env_start.py", 2, env={"HOROVOD_CPU_OPERATIONS": "gloo"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK rank=0 size=2" in proc.stdout and "OK rank=1 size=2" in proc.stdout
    assert proc.stdout.count("mpi_loaded=True") == 2, proc.stdout  # the ranks met over MPI


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np", [2, 4])
def test_hvdlite_run_mpi_runs_the_collective_matrix_on_mpi(np, tmp_path):
    """`hvdlite-run --mpi` starts the ranks under mpiexec; the whole basic collective matrix
    (every op, dtype and reduce op, errors included) passes on the MPI transport."""
    from util import hvdlite_run, rank_lines
    proc = hvdlite_run("ops_basic.py", np=np, args=[str(tmp_path)], launcher_args=["--mpi"],
                       timeout=180)
    for r in range(np):
        lines = rank_lines(proc.stdout, r)
        checks = [line for line in lines if line.startswith("CHECK ")]
        assert len(checks) > 20, proc.stdout[-3000:]
        failed = [line for line in checks if not line.split()[2] == "OK"]
        assert not failed, "\n".join(failed)
        assert any(line.startswith("FINISHED ") for line in lines)


@pytest.mark.timeout(150)
def test_fused_allreduce_in_place_members():
    """A fused allreduce on MPI reduces its members of 64 KiB or more in place, one call each,
    and the rest through the fusion buffer: exact results for every kind of member (in and out
    of place, Average/Sum/Max, pre/postscale, float16, int32, grouped), also in the steady
    state, with the async fusion checks beside them; a lone allreduce into an output that is
    not contiguous on one rank only reduces right (it used to give a wrong sum)."""
    from util import Run
    # (HVDLITE_MPI_SHM_MIN_MB=0: MPI for all. Otherwise fused allreduces of 256 KiB and more
    # take the shared-memory channel, test_fused_allreduces_take_the_channel.)
    run = Run("ops_fusion.py", 2, args=["big_and_small_members", "many_async_allreduces",
                                        "steady_state_all_ops", "lone_output_not_contiguous"],
              env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "10",
                   "HVDLITE_MPI_SHM_MIN_MB": "0"},
              timeout=120, launcher_args=["--mpi"])
    for name in ("big_and_small_members", "many_async_allreduces", "steady_state_all_ops",
                 "lone_output_not_contiguous"):
        run.check(name)
    run.finished()


@pytest.mark.timeout(150)
def test_fused_allreduces_take_the_channel():
    """With waits that spin, a fused allreduce of 256 KiB or more (backends/mpi.FUSED_MIN_BYTES)
    goes through the shared-memory channel, on both ranks alike even where one rank's output
    is not contiguous; the in-place members' path and the async fusion checks still hold
    beside it, exact (workers/ops_fusion.py)."""
    from util import Run
    run = Run("ops_fusion.py", 2, args=["fused_through_the_channel", "many_async_allreduces"],
              env={"HVDLITE_MPI_WAIT": "spin", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "10"},
              timeout=120, launcher_args=["--mpi"])
    for name in ("fused_through_the_channel", "many_async_allreduces"):
        run.check(name)
    run.finished()


@pytest.mark.timeout(150)
def test_join_on_mpi():
    """Uneven steps then hvd.join() on MPI: the joined rank's zeros go into fused responses
    whose big members are reduced in place (2 ranks: with more ranks than cores, waits yield
    the core and fused responses keep one call)."""
    from util import Run
    run = Run("ops_join.py", 2, timeout=120, launcher_args=["--mpi"])
    for name in ("uneven_allreduce_join", "other_collectives_after_join", "join_twice"):
        run.check(name)
    run.finished()


@pytest.mark.timeout(150)
def test_cold_cache_benchmark_runs(tmp_path):
    """benchmarks/cold_cache.py (docs/benchmarks.md's reason why 16 MiB on MPI stays short of raw)
    runs on MPI, times all four cases and writes its JSON; its timings are not judged here."""
    import json
    out = tmp_path / "cold.json"
    proc = mpiexec(ROOT / "benchmarks" / "cold_cache.py", 2,
                   args=("--calls", "3", "--rounds", "1", "--stream-mib", "4", "--json",
                         str(out)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "after streaming 4 MiB" in proc.stdout, proc.stdout
    r = json.loads(out.read_text())
    assert r["transport"] == "mpi" and r["ranks"] == 2, r
    assert set(r["median_us"]) == {"hvdlite_warm", "hvdlite_cold", "raw_warm", "raw_cold"}, r
    assert all(v > 0 for v in r["median_us"].values()), r


@pytest.mark.timeout(60)
def test_agreement_round_encoding():
    """backends/mpi.Agreement on MPI's COMM_SELF: bits, the fallback flag, the payload's tag,
    its width limit and the error for overlapping rounds; and backends/mpi._Sequence, started
    lazily, run to the end by test() or wait(), complete for good
    (workers/mpi_agreement_units.py)."""
    e = clean_env()
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(WORKERS / "mpi_agreement_units.py")],
                          capture_output=True, text=True, timeout=50, env=e)
    assert proc.returncode == 0 and "AGREEMENT UNITS OK" in proc.stdout, \
        proc.stdout + proc.stderr
