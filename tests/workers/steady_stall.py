"""After the steady state, rank 1 stops submitting: the stall inspector still names it."""
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
t0 = time.monotonic()
if r == 1:
    time.sleep(12)   # stops submitting; the job is shut down meanwhile
try:
    hvd.allreduce(torch.ones(3), name="steady.g0")
except hvd.HorovodInternalError as exc:
    print("RAISED", f"{time.monotonic() - t0:.1f}", str(exc).replace("\n", " | "), flush=True)
    sys.exit(0)
sys.exit(1)
