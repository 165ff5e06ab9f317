"""After the steady state, rank 1 shuts down; rank 0 then allreduces a cached tensor.

The hit goes out after the coordinator's "a member is gone" (argv[1] = seconds to wait first;
0 races it with the shutdown; argv[2] = "raise": rank 1 crashes instead of shutting down, and
the error says so). Either way rank 0 must raise the shutdown error at once, never
wait: with the wait, the hit reaches the coordinator in full negotiation; without it, it may
still sit in a steady round (on MPI: a transport round) when the member leaves.
"""
import sys
import time

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics

hvd.init()
r = hvd.rank()
for step in range(6):
    hvd.allreduce(torch.ones(3), name="steady.g0")
assert basics.engine_counters()["steady_entered"] >= 1, basics.engine_counters()
if r == 1:
    if sys.argv[2:] == ["raise"]:          # a crash: the atexit shutdown says why
        raise RuntimeError("rank 1 crashed in its step")
    hvd.shutdown()
    sys.exit(0)
time.sleep(float(sys.argv[1]))
t0 = time.monotonic()
try:
    hvd.allreduce(torch.ones(3), name="steady.g0")
except hvd.HorovodInternalError as exc:
    print("RAISED", f"{time.monotonic() - t0:.1f}", str(exc).replace("\n", " | "), flush=True)
    hvd.shutdown()
    sys.exit(0)
print("NOT RAISED", flush=True)
sys.exit(1)
