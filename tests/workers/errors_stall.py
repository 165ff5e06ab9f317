"""Ranks submit different names: the stall inspector names them and shuts the job down."""
import sys
import time

import torch

import hvdlite.torch as hvd

hvd.init()
r = hvd.rank()
t0 = time.monotonic()
try:
    hvd.allreduce(torch.ones(2), name=f"grad.layer{r}")
except hvd.HorovodInternalError as exc:
    print("RAISED", f"{time.monotonic() - t0:.1f}", str(exc).replace("\n", " | "), flush=True)
    sys.exit(0)
sys.exit(1)
