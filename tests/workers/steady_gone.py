"""After the steady state, rank 1 shuts down; rank 0 then allreduces a cached tensor.

The hit goes out after the coordinator's "a member is gone" (argv[1] = seconds to wait first;
0 races it with the shutdown; argv[2] = "raise": rank 1 crashes instead of shutting down, and
the error says so). Either way rank 0 must raise the shutdown error at once, never
wait: with the wait, the hit reaches the coordinator in full negotiation; without it, it may
still sit in a steady round (on MPI: a transport round) when the member leaves.
"""
import atexit
import sys
import time

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics

# Registered before init(), so it runs after hvdlite's own exit handler (which sends the
# crash's reason): the crashed rank lingers, so the launcher, which stops every rank once one
# exits with an error, does not stop rank 0 before it has raised (1 run in 4 did).
_linger: list = []
atexit.register(lambda: _linger and time.sleep(_linger[0]))

hvd.init()
r = hvd.rank()
for step in range(6):
    hvd.allreduce(torch.ones(3), name="steady.g0")
assert basics.engine_counters()["steady_entered"] >= 1, basics.engine_counters()
if r == 1:
    if sys.argv[2:] == ["raise"]:          # a crash: the atexit shutdown says why
        _linger.append(3.0)
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
