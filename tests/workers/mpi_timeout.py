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
x = torch.full((1000,), float(rank + 1))
if rank == 0:
    work = comm.allreduce(x, SUM)
    t0 = time.monotonic()
    try:
        work.wait()
        print("NO TIMEOUT", flush=True)
    except mpi.MPITimeout as exc:
        print(f"TIMEOUT after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
    time.sleep(2.5)               # rank 1 makes its call meanwhile (at 4 s)
    work.wait()
else:
    time.sleep(4.0)
    comm.allreduce(x, SUM).wait()
assert torch.equal(x, torch.full((1000,), 3.0)), x[:4]

# A communicator abandoned while a wait is under way (the job failed: Engine.shutdown) ends the
# wait at once with MPIAbandoned, not at the timeout; MPI's own Wait then completes the request
# once rank 1 calls (1.5 s later), so the job ends cleanly.
y = torch.full((10,), float(rank + 1))
if rank == 0:
    work = comm.allreduce(y, SUM)
    threading.Timer(0.3, comm.abandon).start()
    t0 = time.monotonic()
    try:
        work.wait()
        print("NOT ABANDONED", flush=True)
    except mpi.MPIAbandoned as exc:
        print(f"ABANDONED after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
    work.req.Wait()
else:
    time.sleep(1.5)
    comm.allreduce(y, SUM).wait()
assert torch.equal(y, torch.full((10,), 3.0)), y[:4]
print(f"OK rank {rank} mode {'yield' if comm.yielding else 'spin'}", flush=True)
comm.close()
