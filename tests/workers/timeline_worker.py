"""Writes a timeline from the environment, then a second one through start/stop_timeline."""
import sys

import torch

import hvdlite.torch as hvd

hvd.init()
for step in range(3):
    hs = [hvd.allreduce_async(torch.ones(1000) * i, name=f"grad.{i}") for i in range(4)]
    for h in hs:
        hvd.synchronize(h)
hvd.broadcast(torch.ones(3), root_rank=0, name="bcast.w")
# The coordinator on rank 0 records requests into whichever file is open when they arrive: a
# barrier after each switch keeps the other ranks' next requests back until rank 0 has switched.
hvd.start_timeline(sys.argv[1], mark_cycles=True)
hvd.barrier()
hvd.allgather(torch.ones(2, 2), name="gather.dynamic")
hvd.stop_timeline()
hvd.barrier()
hvd.allreduce(torch.ones(2), name="after.stop")
hvd.shutdown()
print("OK")
