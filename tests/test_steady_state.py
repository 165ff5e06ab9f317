"""The decentralised steady state (hvdlite/common/steady.py) on 3 real ranks, gloo and MPI.

Worker: tests/workers/steady_state.py, one `CHECK <name> OK|FAIL` line per check and rank.
- steady_hits: after a few steps, cached tensors are released by rounds between the ranks, with
  no message to the coordinator (engine counters), results equal to the local reference;
- buckets: a step's gradients, submitted one by one, go out as ~2 buckets (engine counters);
  synchronous calls are not held back for their bucket;
- grouped: grouped allreduces reach the steady state too, released whole; one member's changed
  shape on one rank raises the mismatch error naming it on every rank, and the job comes back;
- barrier: a step with hvd.barrier() stays in the steady state, and the barrier still waits for
  the last rank;
- unnamed: a step with a blocking allreduce without a name stays in the steady state; a shape
  mismatch from that line still raises the error naming it;
- changed_shape: a changed shape after the steady state falls back to full negotiation and
  raises today's mismatch error on every rank; the job returns to the steady state;
- join: uneven inputs with hvd.join() across the steady state;
- process_set: a static set [0, 1] reaches its own steady state beside the global one;
- interrupted_reading (rounds over the control connections): a real SIGINT while rank 0's
  caller applies a peer's round message (engine.Engine._read_peers) raises KeyboardInterrupt
  once the message is applied (interrupts.py); the job goes on, with exact results;
- one-member sets (workers/steady_solo.py): a one-rank job, and a set of one rank beside the
  global set, release cached tensors on the caller's thread.
On MPI, and on gloo's shared-memory path (the default on one host) while every rank has a
core, the rounds run on the transport; the gloo run (3 ranks, over the control connections on
a 2-core machine) repeats with HVDLITE_SHM=0, which keeps them there on any machine.
workers/steady_transport_rounds.py checks the transport's path on 2 ranks of each (callers
driving their own round on the express lane, the round waiter, async steps, crossed submission
orders, a large synchronous allreduce, a changed shape).
workers/cache_capacity.py runs steps larger than the response cache; workers/steady_fuzz.py
runs random steps (allreduces, broadcasts, groups, barriers, unnamed calls, changed shapes,
random timing per rank) on gloo with a thrashing cache and on MPI.
The stall case (a rank that stops submitting) is in test_errors.py.
"""
from __future__ import annotations

import pytest

from util import Run

CHECKS = ["steady_hits", "payloads", "buckets", "grouped", "barrier", "unnamed", "changed_shape",
          "join", "process_set"]


@pytest.fixture(scope="module")
def gloo_run():
    return Run("steady_state.py", 3, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", CHECKS)
def test_steady_state_gloo(gloo_run, name):
    gloo_run.check(name)


@pytest.mark.timeout(180)
def test_steady_state_gloo_finished(gloo_run):
    gloo_run.finished()


@pytest.mark.timeout(180)
def test_steady_state_gloo_control_connections():
    """Without shared memory, rounds go over the control connections between the ranks; a
    Ctrl-C while a caller applies a peer's round message comes out once it is applied
    (interrupted_reading)."""
    _all_checks(Run("steady_state.py", 3, env={"HVDLITE_SHM": "0"}, timeout=150),
                CHECKS + ["interrupted_reading"])


def _mpi(script: str, np: int, args=None, env=None) -> Run:
    from test_mpi import HAVE_MPI
    if not HAVE_MPI:
        pytest.skip("mpi4py/mpiexec not installed (pip install mpi4py mpich)")
    return Run(script, np, args, env, timeout=150, launcher_args=["--mpi"])


@pytest.fixture(scope="module")
def mpi_run():
    return _mpi("steady_state.py", 3)


def _all_checks(run, names) -> None:
    for name in names:
        run.check(name)
    run.finished()


@pytest.mark.timeout(180)
def test_steady_state_mpi(mpi_run):
    _all_checks(mpi_run, CHECKS)


ROUNDS_CHECKS = ["inline", "express", "waiter", "async", "crossed", "large", "late_peer",
                 "busy_engine", "batch", "mid", "changed_shape", "compacted", "reuse",
                 "interrupted"]


@pytest.mark.timeout(180)
def test_steady_rounds_on_mpi():
    """Rounds as one MPI allreduce (steady.TransportRound): caller-driven synchronous calls, a
    late rank (the round waiter), async steps, a changed shape, small float32 tensors carried
    in their rounds, alone and several at once (workers/steady_transport_rounds.py)."""
    _all_checks(_mpi("steady_transport_rounds.py", 2),
                ROUNDS_CHECKS + ["payload", "grouped_payload"])


@pytest.mark.timeout(180)
def test_steady_rounds_on_shared_memory():
    """The same checks with rounds through the shared-memory segment (shm.ShmAgreement) and
    small collectives run on the caller's thread (gloo's default path on one host)."""
    _all_checks(Run("steady_transport_rounds.py", 2, env={"HVDLITE_SHM": "1"}, timeout=150),
                ROUNDS_CHECKS + ["payload", "grouped_payload"])


SOLO_CHECKS = ["solo_hits", "solo_finished_handle", "solo_changed_shape", "solo_many_async",
               "solo_join", "global_still_works"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [1, 2])
def test_steady_state_one_member_set(np):
    """A one-member set (a one-rank job; a process set of one rank beside the global set)
    releases cached tensors on the caller's thread, with no coordinator message
    (workers/steady_solo.py)."""
    _all_checks(Run("steady_solo.py", np, timeout=150), SOLO_CHECKS)


@pytest.mark.timeout(180)
def test_steady_state_one_member_set_mpi():
    _all_checks(_mpi("steady_solo.py", 2), SOLO_CHECKS)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["auto", "explicit", "spare"])
def test_bucket_sizes_follow_the_cores(mode):
    """Ranks pinned to one core between them send a step's CPU gradients as one bucket; sizes
    the user set are kept; ranks with cores to spare and shared memory send 4 MB buckets
    (workers/steady_one_bucket.py; the rules of buckets.whole_pass_on_host and cpu_cap_on_host,
    GPU passes included, are in test_units.py)."""
    env = {"HVDLITE_FIRST_BUCKET_MB": "1"} if mode == "explicit" else None
    Run("steady_one_bucket.py", 2, args=[mode], env=env, timeout=120).check(f"buckets_{mode}")


@pytest.mark.timeout(120)
def test_one_rank_benchmark_runs():
    """benchmarks/one_rank.py (the docs' one-rank table) runs and reports the steady state on;
    its timings are not judged here."""
    import subprocess
    import sys

    from util import ROOT
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "one_rank.py"), "--rounds",
                           "1"], capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "steady state on" in proc.stdout, proc.stdout
    rows = [line for line in proc.stdout.splitlines() if "allreduce_" in line]
    assert len(rows) == 3, proc.stdout


@pytest.mark.timeout(120)
def test_steady_paths_benchmark_runs(tmp_path):
    """benchmarks/steady_paths.py (the docs' steady-state paths table) runs on 2 gloo ranks and
    writes its five rows; its timings are not judged here."""
    import json

    from util import ROOT, hvdlite_run
    out = tmp_path / "paths.json"
    proc = hvdlite_run(ROOT / "benchmarks" / "steady_paths.py", np=2,
                       args=["--rounds", "1", "--calls", "3", "--json", str(out)], timeout=100)
    assert "hvd.barrier()" in proc.stdout, proc.stdout
    assert set(json.loads(out.read_text())["rows"]) == {"grouped", "metrics", "barrier",
                                                           "unnamed", "unnamed_metrics"}


@pytest.mark.timeout(180)
def test_cache_smaller_than_a_step():
    """HOROVOD_CACHE_CAPACITY below the tensors of a step: results stay right and nothing
    hangs (workers/cache_capacity.py); rank 0 warns once, naming the variable and the fix."""
    run = Run("cache_capacity.py", 3, env={"HOROVOD_CACHE_CAPACITY": "16"}, timeout=150)
    _all_checks(run, ["thrash", "fits"])
    warning = "the response cache (HOROVOD_CACHE_CAPACITY=16 tensors) is smaller than"
    assert run.output.count(warning) == 1, run.output[-3000:]
    assert "Set HOROVOD_CACHE_CAPACITY (or HVDLITE_CACHE_CAPACITY) above" in run.output


@pytest.mark.timeout(180)
def test_a_step_beyond_the_default_cache_capacity():
    """Steps of 1,100 named tensors against the default capacity of 1,024: the coordinator's
    evictions chain through every pending tensor, and it used to recurse once per eviction
    until it died of RecursionError (workers/cache_capacity.py deep)."""
    run = Run("cache_capacity.py", 2, args=["deep"], timeout=150)
    _all_checks(run, ["deep"])
    assert "RecursionError" not in run.output, run.output[-3000:]


FUZZ_ENV = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20"}


@pytest.mark.timeout(180)
def test_random_steps_with_a_thrashing_cache():
    """workers/steady_fuzz.py on 3 gloo ranks with a 16-entry cache: random steps of allreduces,
    broadcasts, groups, barriers and unnamed calls give the reference results, with no hang."""
    _all_checks(Run("steady_fuzz.py", 3, args=["7", "600"], timeout=150,
                    env=dict(FUZZ_ENV, HOROVOD_CACHE_CAPACITY="16")), ["fuzz"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np", [2, 3])
def test_random_steps_on_mpi(np):
    """The same random steps on MPI (rounds on the transport), with the default cache. On 2
    ranks every rank has a core and fused big members are reduced in place; on 3 (more ranks
    than this machine's cores) waits yield the core and fused responses keep one call."""
    _all_checks(_mpi("steady_fuzz.py", np, args=[str(6 + np), "600"], env=FUZZ_ENV), ["fuzz"])
