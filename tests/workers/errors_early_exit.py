"""Rank 1 finishes early (it calls shutdown and exits), dies (kill), or crashes on an uncaught
exception (raise); rank 0's next collective must fail fast, and say which."""
import sys
import time

import torch

import hvdlite.torch as hvd

hvd.init()
r = hvd.rank()
hvd.allreduce(torch.ones(2), name="warmup")
if r == 1:
    mode = sys.argv[1]
    if mode == "exit":
        sys.exit(0)          # atexit runs hvd.shutdown()
    if mode == "raise":
        raise ValueError("the loader failed on batch 7\n(a second line, not shown)")
    if mode == "kill":
        import os
        import signal
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
t0 = time.monotonic()
try:
    time.sleep(1.0)
    hvd.allreduce(torch.ones(2), name="after")
except hvd.HorovodInternalError as exc:
    print("RAISED", f"{time.monotonic() - t0:.1f}", str(exc).replace("\n", " "), flush=True)
    sys.exit(0)
print("NO ERROR", flush=True)
sys.exit(1)
