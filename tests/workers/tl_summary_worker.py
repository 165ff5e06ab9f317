"""Writes a timeline (HOROVOD_TIMELINE) with a few training-like steps, one tensor that rank 1
submits late, and an Adasum allreduce, for the timeline summary test."""
import time

import torch

import hvdlite.torch as hvd

hvd.init()
rank = hvd.rank()
for step in range(4):
    hs = [hvd.allreduce_async(torch.ones(2000 * (i + 1)) * rank, name=f"grad.{i}")
          for i in range(3)]
    for h in hs:
        hvd.synchronize(h)
# The straggler: everyone waits for rank 1 on this tensor, long enough that negotiation
# outweighs the queueing a loaded machine adds to the first steps (a few hundred ms).
if rank == 1:
    time.sleep(1.2)
hvd.allreduce(torch.ones(10), name="late.grad")
hvd.allreduce(torch.randn(64), name="ada.grad", op=hvd.Adasum)
hvd.broadcast(torch.ones(3), root_rank=0, name="bcast.w")
hvd.shutdown()
print("OK", flush=True)
