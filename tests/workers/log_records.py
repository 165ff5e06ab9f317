"""hvdlite's log records on a real job: the stall inspector warns at init (shutdown time below the
warning time), and with argv[1] == "app-on-rank-1" rank 1's application configured logging first."""
import logging
import os
import sys

import torch

import hvdlite.torch as hvd

if sys.argv[1:] == ["app-on-rank-1"] and os.environ["HOROVOD_RANK"] == "1":
    logging.basicConfig(format="APP %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
hvd.init()
out = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="x")
assert out.item() == hvd.size(), out
logging.getLogger("hvdlite.test").warning("from rank %d", hvd.rank())
print(f"OK rank={hvd.rank()}", flush=True)
hvd.shutdown()
