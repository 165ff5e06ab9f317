"""A response cache smaller than a step (HOROVOD_CACHE_CAPACITY below the tensors per step).

Run with HOROVOD_CACHE_CAPACITY=16 on 3 ranks. Checks:
- thrash: steps of 24 named allreduces evict cached tensors that the next step submits again;
  every result equals the local reference and nothing hangs (an evicted bit used to stay
  pending at the coordinator for a tensor it no longer had: the job hung within a few steps);
- fits: steps of 12 tensors fit the cache and reach the steady state.
The test also looks for rank 0's one warning that names the capacity and the fix.

With the argument `deep` (and the default capacity of 1,024) it runs only:
- deep: steps of 1,100 named allreduces, each step's evictions chaining through ~1,000 pending
  tensors at the coordinator (it recursed once per eviction and died of RecursionError).
"""
from __future__ import annotations

import sys

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics
from ops_common import check, fail, finish, gen, no_threads_left, same, steady_delta

hvd.init()
rank, size = hvd.rank(), hvd.size()


def step(k: int, n: int, prefix: str) -> None:
    shapes = [(3 + i % 5,) for i in range(n)]
    handles = [hvd.allreduce_async(gen(rank, s, torch.float32, salt=(prefix, i, k)),
                                   name=f"{prefix}.{i}", op=hvd.Sum)
               for i, s in enumerate(shapes)]
    for i, h in enumerate(handles):
        ref = sum(gen(r, shapes[i], torch.float32, salt=(prefix, i, k)) for r in range(size))
        same(hvd.synchronize(h), ref, f"{prefix} step {k} tensor {i}")


def thrash():
    for k in range(12):
        step(k, 24, "big")


def fits():
    d = steady_delta(lambda k: step(k, 12, "small"), range(4), range(4, 10))
    if d["coordinator_messages"]:
        fail(f"steps that fit the cache still went to the coordinator: {d}")


def deep():
    for k in range(6):
        step(k, 1100, "deep")


if sys.argv[1:] == ["deep"]:
    check("deep", deep)
else:
    check("thrash", thrash)
    check("fits", fits)
print("COUNTERS", basics.engine_counters(), flush=True)
finish()
hvd.shutdown()
no_threads_left()
