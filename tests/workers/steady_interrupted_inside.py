"""A KeyboardInterrupt (Ctrl-C) lands inside a collective's own steps on rank 0's thread (its
results being scaled after the transfer), where the collective cannot be resumed: the job must
fail on every rank with one clear error naming the tensor and the cause, never hang
(engine.Engine._left_transfer). argv[1]: "express" (a blocking average on the express lane) or
"async" (an asynchronous one whose caller drives its round and collective in enqueue).
"""
import sys
import threading
import time

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics, collectives

hvd.init()
rank = hvd.rank()
x = torch.ones(100_000)                       # too large for a round's payload: the data path
for _ in range(8):
    hvd.allreduce_(x, name="inside.avg")          # the steady state, the express lane
assert hvd.rank() in (0, 1)

armed = [True] if rank == 0 else []
scale = collectives.scale_
# A spin window of 2 s, so that an asynchronous call's caller still drives its own round and
# collective on a loaded machine (a signal reaches the main thread only; on an engine thread
# the same exception is a transport error, which fails the job as it should, but not the case
# under test).
basics.engine().comms[(0, "cpu")].inline_poll_s = 2.0


def interrupting(t, factor):
    if armed and threading.current_thread() is threading.main_thread():
        armed.pop()
        raise KeyboardInterrupt("injected: Ctrl-C while the results were being scaled")
    return scale(t, factor)


collectives.scale_ = interrupting
t0 = time.monotonic()
try:
    for k in range(20):
        if sys.argv[1] == "express":
            hvd.allreduce_(x, name="inside.avg")
        else:
            hvd.synchronize(hvd.allreduce_async_(x, name="inside.avg"))
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
    try:
        hvd.allreduce_(x, name="inside.avg")
    except hvd.HorovodInternalError as exc:
        print("RAISED", f"{time.monotonic() - t0:.1f}", str(exc).replace("\n", " "), flush=True)
        sys.exit(0)
    print("NOT RAISED after the interrupt", flush=True)
    sys.exit(1)
except hvd.HorovodInternalError as exc:
    print("RAISED", f"{time.monotonic() - t0:.1f}", str(exc).replace("\n", " "), flush=True)
    sys.exit(0)
print("NOT RAISED", flush=True)
sys.exit(1)
