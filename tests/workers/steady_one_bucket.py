"""Gradient buckets and the host's cores (hvdlite/common/buckets.py): with no core to spare per
rank (whole_pass_on_host) a step's allreduces, submitted one by one with compute between them,
go out as one bucket; with two cores or more per rank and the data in shared memory
(cpu_cap_on_host) they go in 4 MB buckets.

Argument `auto`: each rank pins itself to one core before hvd.init(), so 2 ranks share 1 core
as hvdlite sees it; no bucket variable set, one bucket per step expected. `explicit`: pinned
too, but the test sets HVDLITE_FIRST_BUCKET_MB=1 and the user's choice stands (two buckets per
step: DDP's first bucket and the rest). `spare`: not pinned, and hvdlite is told the host has
8 cores (threads.usable_cores, read at init to choose the buckets), as on a host with cores to
spare: three buckets per step (the first, then 4 MB ones). Results are compared with a local
reference.
"""
from __future__ import annotations

import os
import sys
import time

import torch

mode = sys.argv[1]
if mode != "spare":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import hvdlite.torch as hvd  # noqa: E402
from hvdlite.common import threads  # noqa: E402
from ops_common import check, fail, finish, gen, same, steady_delta  # noqa: E402

if mode == "spare":
    threads.usable_cores = lambda: 8     # a host with 4 cores per rank, as init sees it
hvd.init()
rank, size = hvd.rank(), hvd.size()
# 1.2 MB each. DDP-style: bucket 0 = g0, 1 = g1..g7; with 4 MB buckets: g0, g1..g4, g5..g7.
SIZES = [300_000] * 8


def step(k: int) -> None:
    handles = []
    for i, n in enumerate(SIZES):
        handles.append(hvd.allreduce_async(gen(rank, (n,), torch.float32, salt=("ob", i, k)),
                                           name=f"ob.g{i}", op=hvd.Sum))
        time.sleep(0.003)               # backpropagation between two gradients
    for i, h in enumerate(handles):
        ref = sum(gen(r, (SIZES[i],), torch.float32, salt=("ob", i, k)) for r in range(size))
        same(hvd.synchronize(h), ref, f"step {k} g{i}")


def buckets() -> None:
    if threads.usable_cores() != (8 if mode == "spare" else 1) or hvd.local_size() != size:
        fail(f"set-up: {threads.usable_cores()} usable cores, local size {hvd.local_size()}")
    delta = steady_delta(step, range(4), range(4, 10))
    if delta["steady_released"] != 6 * len(SIZES):
        fail(f"not every allreduce went through the steady state: {delta}")
    groups = delta["steady_groups"] / 6
    if mode == "auto" and groups > 1.5:
        fail(f"{groups:.1f} transport calls per step with {size} ranks on 1 core, expected one "
             f"bucket: {delta}")
    if mode == "explicit" and not 1.5 <= groups < 2.5:
        fail(f"{groups:.1f} transport calls per step with HVDLITE_FIRST_BUCKET_MB=1 set, "
             f"expected the user's two buckets: {delta}")
    if mode == "spare" and groups < 2.5:
        fail(f"{groups:.1f} transport calls per step with 4 cores per rank, expected three "
             f"buckets (the first, then 4 MB ones): {delta}")


check(f"buckets_{mode}", buckets)
finish()
hvd.shutdown()
