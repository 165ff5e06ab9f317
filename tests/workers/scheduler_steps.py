"""A job that runs until the test ends it (test_slurm.py): each rank says its pid, then
allreduces in a loop, checking each sum against the one computed here. A rank that loses a peer
prints one `FAILED` line and exits 1. SIGUSR1 (what SLURM sends before a time limit) on any rank
stops every rank after the same step: the flag travels in the step's allreduce. None runs longer
than `seconds`."""
import os
import signal
import sys
import time

import torch

import hvdlite.torch as hvd
from hvdlite import HorovodInternalError

seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 90.0
signalled = []
signal.signal(signal.SIGUSR1, lambda signum, frame: signalled.append(signum))
hvd.init()
print(f"PID rank={hvd.rank()} pid={os.getpid()}", flush=True)
want = float(sum(range(1, hvd.size() + 1)))
deadline = time.monotonic() + seconds
step = 0
try:
    while time.monotonic() < deadline:
        out = hvd.allreduce(torch.tensor([float(hvd.rank() + 1), float(len(signalled))]),
                            op=hvd.Sum, name="steps")
        assert out[0].item() == want, (out[0].item(), want)
        step += 1
        if step == 3:
            print(f"RUNNING rank={hvd.rank()}", flush=True)
        if out[1].item() > 0:
            print(f"STOPPED rank={hvd.rank()} step={step} signalled_here={bool(signalled)}",
                  flush=True)
            hvd.shutdown()
            sys.exit(0)
        time.sleep(0.05)
except HorovodInternalError as exc:   # what every rank gets when a peer is gone
    print(f"FAILED rank={hvd.rank()} {type(exc).__name__}: {str(exc).splitlines()[0]}",
          flush=True)
    sys.exit(1)
print(f"TIMEOUT rank={hvd.rank()}: nobody ended the job", flush=True)
sys.exit(3)
