"""Random steps against the negotiation protocol: args SEED STEPS.

Every rank draws the same steps from SEED: a random subset of a pool of names, as async
allreduces, broadcasts and grouped allreduces (random groups), now and then a changed shape, a
barrier among the async calls or an unnamed blocking allreduce; each rank also sleeps at random
(its own draws), so submissions interleave differently every run. Run with a small
HOROVOD_CACHE_CAPACITY the cache thrashes too. The sets enter the steady state and fall back
hundreds of times; every result is checked against the local reference, and a short stall
shutdown turns any hang into a failure.
"""
from __future__ import annotations

import random
import sys
import time

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics
from ops_common import check, fail, finish, gen, no_threads_left, same

hvd.init()
rank, size = hvd.rank(), hvd.size()
seed, steps = int(sys.argv[1]), int(sys.argv[2])


def reference(kind: str, name: str, shape, k: int) -> torch.Tensor:
    if kind == "b":
        return gen(0, shape, torch.float32, salt=(name, k))
    return sum(gen(r, shape, torch.float32, salt=(name, k)) for r in range(size))


def draw_shape(draw: random.Random) -> tuple:
    """Mostly a few elements; one in five 64-80 KB, which MPI reduces in place when fused
    (collectives.Executor._allreduce_in_place), on the finisher thread, while the background
    thread launches other collectives."""
    if draw.random() < 0.2:
        return (draw.randint(16384, 20000),)
    return (draw.randint(1, 6),)


def fuzz():
    draw = random.Random(seed)                 # the same on every rank
    own = random.Random(seed * 1000 + rank)    # this rank's timing
    pool = [f"n{i}" for i in range(draw.randint(5, 40))]
    shapes = {n: draw_shape(draw) for n in pool}
    for k in range(steps):
        if draw.random() < 0.1:
            n = draw.choice(pool)
            shapes[n] = draw_shape(draw)
        names = draw.sample(pool, draw.randint(1, len(pool)))
        ops, i = [], 0
        while i < len(names):
            kind = draw.random()
            if kind < 0.15 and i + 2 <= len(names):
                members = names[i:i + draw.randint(2, 4)]
                i += len(members)
                xs = [gen(rank, shapes[n], torch.float32, salt=(n, k)) for n in members]
                ops.append(("a", members, hvd.grouped_allreduce_async(
                    xs, name="g." + "_".join(members), op=hvd.Sum)))
            elif kind < 0.2:
                n = names[i]
                i += 1
                x = gen(rank, shapes[n], torch.float32, salt=(n, k))
                ops.append(("b", [n], [hvd.broadcast_async(x, 0, name="b." + n)]))
            else:
                n = names[i]
                i += 1
                x = gen(rank, shapes[n], torch.float32, salt=(n, k))
                ops.append(("a", [n], [hvd.allreduce_async(x, name="a." + n, op=hvd.Sum)]))
            if own.random() < 0.05:
                time.sleep(own.random() * 0.003)
        if draw.random() < 0.1:
            hvd.barrier()
        for kind, members, handle in ops:
            got = hvd.synchronize(handle[0]) if isinstance(handle, list) else \
                hvd.synchronize(handle)
            got = [got] if isinstance(handle, list) else got
            for n, g in zip(members, got):
                same(g, reference(kind, n, shapes[n], k), f"step {k} {kind} {n}")
        if draw.random() < 0.1:
            got = hvd.allreduce(torch.ones(2) * rank, op=hvd.Sum)
            same(got, torch.full((2,), float(sum(range(size)))), f"step {k} unnamed")
    c = basics.engine_counters()
    if c["steady_entered"] < 10:
        fail(f"the fuzz hardly reached the steady state: {c}")
    if hvd.mpi_enabled() and c["in_place_members"] < 10:
        from hvdlite.common.backends.mpi import wait_mode
        if wait_mode() == "spin":         # (ranks that yield the core fuse them all)
            fail(f"the fuzz hardly reduced a big member in place on MPI: {c}")


check("fuzz", fuzz)
print("COUNTERS", basics.engine_counters(), flush=True)
finish()
hvd.shutdown()
no_threads_left()
