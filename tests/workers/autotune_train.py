"""A short training-like loop under HOROVOD_AUTOTUNE=1: the coordinator changes the fusion
threshold and the ranks' cycle time while the loop runs; every result must stay exact.

Prints MISMATCH lines on any wrong result, `CYCLES v1 v2 ...` (this rank's engine cycle time in ms
each time it changed, from the autotuner's pushes) and DONE.
"""
import torch

import hvdlite.torch as hvd
from hvdlite.common import basics

STEPS = 70
SIZES = [7, 1000, 50_000, 600_000, 600_000, 600_000, 33]

hvd.init()
rank, size = hvd.rank(), hvd.size()


def value(r, step, i, n, dtype=torch.float32):
    # Small integers: sums are exact in float32, whatever the fusion or reduction order.
    return ((torch.arange(n, dtype=torch.float64) % 13) + r * 3 + step + i).to(dtype)


cycles = [basics.engine().cycle_s * 1000]
for step in range(STEPS):
    handles = [hvd.allreduce_async(value(rank, step, i, n), name=f"grad.{i}", op=hvd.Sum)
               for i, n in enumerate(SIZES)]
    h64 = hvd.allreduce_async(value(rank, step, 9, 500, torch.float64), name="grad.f64",
                              op=hvd.Average)
    gathered = hvd.allgather(torch.full((rank + 1, 2), float(step)), name="gather")
    root_val = hvd.broadcast(torch.full((4,), float(rank + step)), root_rank=step % size,
                             name="bcast")
    for i, (h, n) in enumerate(zip(handles, SIZES)):
        got = hvd.synchronize(h)
        want = sum(value(r, step, i, n) for r in range(size))
        if not torch.equal(got, want):
            print(f"MISMATCH step {step} grad.{i}", flush=True)
    got = hvd.synchronize(h64)
    want = sum(value(r, step, 9, 500, torch.float64) for r in range(size)) / size
    if not torch.equal(got, want):
        print(f"MISMATCH step {step} grad.f64", flush=True)
    if gathered.shape[0] != size * (size + 1) // 2 or not torch.all(gathered == step):
        print(f"MISMATCH step {step} gather", flush=True)
    if not torch.all(root_val == float(step % size + step)):
        print(f"MISMATCH step {step} bcast", flush=True)
    ms = basics.engine().cycle_s * 1000
    if ms != cycles[-1]:
        cycles.append(ms)

print("CYCLES " + " ".join(f"{c:g}" for c in cycles), flush=True)
hvd.shutdown()
print("DONE", flush=True)
