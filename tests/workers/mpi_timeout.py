"""An MPI request whose peer never makes the matching call ends in MPITimeout after the
transport timeout, instead of holding the rank forever (MPI's Wait has no timeout).

Rank 0 starts an allreduce that rank 1 joins only 4 s later; with a 2 s timeout rank 0 must
raise, naming itself and the fix. Then rank 1 makes its call, rank 0 finishes the same request,
and both check the sum, so the job ends cleanly. Then a wait under way when its communicator is
abandoned (MPICommunicator.abandon: the job has failed) ends at once in MPIAbandoned.
HVDLITE_MPI_WAIT (spin or yield) picks the waiting mode."""
import threading
import time

import torch
from mpi4py import MPI

from hvdlite.common.backends import mpi
from hvdlite.common.messages import SUM

world = MPI.COMM_WORLD
rank = world.Get_rank()
comm = mpi.MPICommunicator(world.Dup(), rounds=False, timeout_s=2.0)


def unmatched(n: int, late_s: float, expected: type, label: str, finish, before=None) -> None:
    """Rank 0 starts an allreduce of n elements that rank 1 joins only `late_s` later: rank
    0's wait must end in `expected` (printed as `<label> after <s> s: <message>`), then
    `finish(work)` completes the request once rank 1 has called, and both check the sum."""
    x = torch.full((n,), float(rank + 1))
    if rank == 0:
        work = comm.allreduce(x, SUM)
        if before is not None:
            before()
        t0 = time.monotonic()
        try:
            work.wait()
            print(f"NO {label}", flush=True)
        except expected as exc:
            print(f"{label} after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
        finish(work)
    else:
        time.sleep(late_s)
        comm.allreduce(x, SUM).wait()
    assert torch.equal(x, torch.full((n,), 3.0)), x[:4]


def wait_for_rank_1(work) -> None:
    time.sleep(2.5)               # rank 1 makes its call meanwhile (at 4 s)
    work.wait()


# The 2 s timeout, with rank 1 4 s late.
unmatched(1000, 4.0, mpi.MPITimeout, "TIMEOUT", wait_for_rank_1)
# A communicator abandoned while a wait is under way (the job failed: Engine.shutdown) ends the
# wait at once with MPIAbandoned, not at the timeout; MPI's own Wait then completes the request
# once rank 1 calls (1.5 s later), so the job ends cleanly.
unmatched(10, 1.5, mpi.MPIAbandoned, "ABANDONED", lambda work: work.req.Wait(),
          before=lambda: threading.Timer(0.3, comm.abandon).start())
print(f"OK rank {rank} mode {'yield' if comm.yielding else 'spin'}", flush=True)
comm.close()
