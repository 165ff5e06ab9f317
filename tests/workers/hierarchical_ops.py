"""Hierarchical allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE=1) on 4 ranks on two hosts, against
local references: every dtype and reduce op, fused groups, and the flat paths beside it.

Usage: hvdlite-run -np 4 -H localhost:2,127.0.0.1:2 python hierarchical_ops.py
"""
from __future__ import annotations

import itertools

import torch

import hvdlite.torch as hvd
from ops_common import (ALL_DTYPES, REDUCE_OPS, SHAPES, all_inputs, check, finish, gen,
                        reduce_ref, same)

leaders = hvd.ProcessSet([0, 2])
hvd.init(process_sets=[leaders])
rank, size = hvd.rank(), hvd.size()


def topology():
    assert (size, hvd.local_size(), hvd.cross_size()) == (4, 2, 2), \
        (size, hvd.local_size(), hvd.cross_size())
    assert hvd.local_rank() == rank % 2 and hvd.cross_rank() == rank // 2


def matrix():
    for (opname, op), dtype, shape in itertools.product(REDUCE_OPS.items(), ALL_DTYPES, SHAPES):
        lo, hi = (-2, 2) if op == hvd.Product else (-4, 4)
        for pre, post in ((1.0, 1.0), (2.0, 3.0)):
            if op == hvd.Product and pre != 1.0:
                continue
            salt = f"h.{dtype}.{opname}.{shape}.{pre}.{post}"
            ref = reduce_ref(all_inputs(size, shape, dtype, salt, lo, hi), op, pre, post)
            y = hvd.allreduce(gen(rank, shape, dtype, salt, lo, hi), name=salt, op=op,
                              prescale_factor=pre, postscale_factor=post)
            same(y, ref, f"allreduce {dtype} {opname} {shape} pre={pre} post={post}")


def fused_group():
    shapes = [(5,), (2, 3), (), (1000,)]
    xs = [gen(rank, s, torch.float32, f"g{i}") for i, s in enumerate(shapes)]
    ys = hvd.grouped_allreduce(xs, op=hvd.Sum, name="group")
    for i, (s, y) in enumerate(zip(shapes, ys)):
        same(y, reduce_ref(all_inputs(size, s, torch.float32, f"g{i}"), hvd.Sum), f"group {i}")
    # Many tensors submitted at once: the engine fuses them into one hierarchical allreduce.
    handles = [hvd.allreduce_async(gen(rank, (64,), torch.float64, f"a{i}"), name=f"a{i}")
               for i in range(20)]
    for i, h in enumerate(handles):
        same(hvd.synchronize(h), reduce_ref(all_inputs(size, (64,), torch.float64, f"a{i}"),
                                            hvd.Average), f"async {i}")


def flat_paths():
    if rank in (0, 2):  # a process set's allreduce stays flat
        y = hvd.allreduce(gen(rank, (9,), torch.float32, "ps"), op=hvd.Sum, name="ps",
                          process_set=leaders)
        same(y, gen(0, (9,), torch.float32, "ps") + gen(2, (9,), torch.float32, "ps"), "set")
    got = hvd.allgather(torch.full((2,), float(rank)), name="ag")
    same(got, torch.tensor([0., 0., 1., 1., 2., 2., 3., 3.]), "allgather")
    b = hvd.broadcast(torch.full((3,), float(rank)), root_rank=3, name="bc")
    same(b, torch.full((3,), 3.0), "broadcast")


check("topology", topology)
check("matrix", matrix)
check("fused_group", fused_group)
check("flat_paths", flat_paths)
finish()
hvd.shutdown()
