"""The steady state's rounds on the MPI transport (steady.TransportRound) on 2 ranks.

2 ranks on this 2-core machine: MPI waits spin, so a synchronous call with nothing else in flight
runs its round and its collective on the caller's thread (engine.Engine._drive_inline). Checks:
- inline: synchronous allreduces, averages and broadcasts after the steady state are driven by
  the caller, rounds run on the transport (no control message between the ranks), results equal
  the reference;
- waiter: one rank submits 0.2 s late, so the other's round outlives the spin window and goes
  to the round waiter thread; the result is still right and nothing else waited;
- async: a step of async allreduces submitted together, synchronized at the end (rounds
  started by the background thread);
- changed_shape: a changed shape raises today's mismatch error on both ranks; the job returns
  to the steady state.
"""
from __future__ import annotations

import time

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics
from ops_common import (check, fail, finish, gen, no_threads_left, same, shape_mismatch,
                        steady_delta)

hvd.init()
rank, size = hvd.rank(), hvd.size()
assert size == 2 and hvd.mpi_enabled(), "steady_mpi_rounds.py needs 2 ranks on MPI"


def counters():
    return basics.engine_counters()


def sync_step(k: int) -> None:
    x = gen(rank, (33,), torch.float32, salt=("x", k))
    same(hvd.allreduce(x, name="r.sum", op=hvd.Sum),
         sum(gen(r, (33,), torch.float32, salt=("x", k)) for r in range(size)), f"sum {k}")
    y = gen(rank, (4, 4), torch.float32, salt=("y", k))
    same(hvd.allreduce(y, name="r.avg"),
         sum(gen(r, (4, 4), torch.float32, salt=("y", k)) for r in range(size)) / size,
         f"average {k}")
    b = gen(rank, (5,), torch.float32, salt=("b", k))
    same(hvd.broadcast(b, 1, name="r.b"), gen(1, (5,), torch.float32, salt=("b", k)),
         f"broadcast {k}")


def inline():
    d = steady_delta(sync_step, range(4), range(4, 14))
    if d["coordinator_messages"] or d["peer_messages"]:
        fail(f"steady steps sent messages: {d}")
    if d["steady_released"] != 30 or d["transport_rounds"] != d["steady_rounds"]:
        fail(f"expected 30 tensors released by rounds on the transport: {d}")
    if d["inline_driven"] != 30:
        fail(f"synchronous calls not driven by the caller: {d}")


def waiter():
    before = counters()
    for k in range(20, 23):
        if rank == 1:
            time.sleep(0.2)            # rank 0's round waits longer than any spin window
        t0 = time.monotonic()
        x = gen(rank, (33,), torch.float32, salt=("w", k))
        same(hvd.allreduce(x, name="r.sum", op=hvd.Sum),
             sum(gen(r, (33,), torch.float32, salt=("w", k)) for r in range(size)), f"waiter {k}")
        took = time.monotonic() - t0
        if rank == 0 and k > 20 and not 0.1 < took < 1.5:
            fail(f"rank 0 waited {took:.3f} s for a peer 0.2 s late")
    if counters()["steady_fallbacks"] != before["steady_fallbacks"]:
        fail(f"a late rank made the set fall back: {before} -> {counters()}")


def async_step():
    for k in range(30, 36):
        xs = [gen(rank, (100 + i,), torch.float32, salt=("a", i, k)) for i in range(6)]
        hs = [hvd.allreduce_async(x, name=f"r.a{i}", op=hvd.Sum) for i, x in enumerate(xs)]
        for i, h in enumerate(hs):
            same(hvd.synchronize(h),
                 sum(gen(r, (100 + i,), torch.float32, salt=("a", i, k)) for r in range(size)),
                 f"async {k} {i}")


def changed_shape():
    shape_mismatch("r.sum")
    entered = counters()["steady_entered"]
    for k in range(40, 46):
        sync_step(k)
    if counters()["steady_entered"] <= entered:
        fail(f"did not return to the steady state: {counters()}")


check("inline", inline)
check("waiter", waiter)
check("async", async_step)
check("changed_shape", changed_shape)
print("COUNTERS", counters(), flush=True)
finish()
hvd.shutdown()
no_threads_left()
