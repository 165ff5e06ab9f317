"""A job started without hvdlite-run (torchrun's or Horovod's variables) works the same."""
import sys

import torch

import hvdlite.torch as hvd

hvd.init()
out = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="x")
assert out.item() == sum(range(1, hvd.size() + 1)), out
assert 0 <= hvd.local_rank() < hvd.local_size()
# A gloo job started without MPI never loads (and so never initializes) MPI.
mpi = "mpi4py.MPI" in sys.modules
print(f"OK rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
      f"mpi_loaded={mpi}", flush=True)
hvd.shutdown()
