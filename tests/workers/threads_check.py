"""torch's CPU threads after hvd.init() (hvdlite/common/threads.py): each rank's share of the
cores when nothing chose them, untouched when OMP_NUM_THREADS or the script chose them.
Arguments: --set N calls torch.set_num_threads(N) before init."""
from __future__ import annotations

import argparse
import os

import torch

import hvdlite.torch as hvd
from harness import check, fail, finish, log
from hvdlite.common.threads import fair_share, usable_cores

p = argparse.ArgumentParser()
p.add_argument("--set", type=int, default=0)
args = p.parse_args()
if args.set:
    torch.set_num_threads(args.set)
before = torch.get_num_threads()
hvd.init()


def threads():
    now = torch.get_num_threads()
    log(f"THREADS {now} (before init {before}, cores {usable_cores()}, local ranks "
        f"{hvd.local_size()})")
    if os.environ.get("OMP_NUM_THREADS") or args.set or before < usable_cores():
        if now != before:
            fail(f"torch threads changed from {before} to {now} although the script or "
                 f"OMP_NUM_THREADS chose them")
    elif now != fair_share(hvd.local_size()):
        fail(f"torch uses {now} threads; expected {fair_share(hvd.local_size())} "
             f"({usable_cores()} cores shared by {hvd.local_size()} ranks)")
    # Collectives still agree with the reference after the change.
    got = hvd.allreduce(torch.full((1000,), float(hvd.rank())), op=hvd.Sum, name="threads.sum")
    want = float(sum(range(hvd.size())))
    if not torch.equal(got, torch.full((1000,), want)):
        fail(f"allreduce after setting threads: {got[:3].tolist()}, want {want}")


check("threads", threads)
finish()
hvd.shutdown()
