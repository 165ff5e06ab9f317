"""A job that runs until the test ends one of its ranks (test_slurm.py): each rank says its pid,
then allreduces in a loop, checking each sum against the one computed here. A rank that loses a
peer prints one `FAILED` line and exits 1; none runs longer than `--seconds`."""
import os
import sys
import time

import torch

import hvdlite.torch as hvd
from hvdlite import HorovodInternalError

seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 90.0
hvd.init()
print(f"PID rank={hvd.rank()} pid={os.getpid()}", flush=True)
want = float(sum(range(1, hvd.size() + 1)))
deadline = time.monotonic() + seconds
step = 0
try:
    while time.monotonic() < deadline:
        out = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="steps")
        assert out.item() == want, (out.item(), want)
        step += 1
        if step == 3:
            print(f"RUNNING rank={hvd.rank()}", flush=True)
        time.sleep(0.05)
except HorovodInternalError as exc:   # what every rank gets when a peer is gone
    print(f"FAILED rank={hvd.rank()} {type(exc).__name__}: {str(exc).splitlines()[0]}",
          flush=True)
    sys.exit(1)
print(f"TIMEOUT rank={hvd.rank()}: nobody ended the job", flush=True)
sys.exit(3)
