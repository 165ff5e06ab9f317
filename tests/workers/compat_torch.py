"""Horovod 0.28's exception classes and accepted arguments in hvdlite.torch, on every rank
(issue 10): alltoall argument errors are ValueError before anything is sent (not
HorovodInternalError), reducescatter with Adasum is HorovodInternalError (as Horovod re-raises
its enqueue's error), cross-rank mismatches are
HorovodInternalError; process sets take any iterable of ranks."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from ops_common import check, expect_raises, fail, finish, same  # noqa: E402
import hvdlite.torch as hvd  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def _not_internal(err, what):
    if isinstance(err, hvd.HorovodInternalError):
        fail(f"{what}: raised HorovodInternalError, Horovod raises ValueError/RuntimeError here")


def check_alltoall_errors():
    err = expect_raises((ValueError, RuntimeError), lambda: hvd.alltoall(torch.zeros(SIZE + 1, 2)),
                        "alltoall uneven first dimension", "divide evenly")
    _not_internal(err, "uneven")
    err = expect_raises((ValueError, RuntimeError),
                        lambda: hvd.alltoall(torch.zeros(SIZE + 2, 2),
                                             splits=torch.ones(SIZE, dtype=torch.int32)),
                        "alltoall splits sum", "sum to")
    _not_internal(err, "splits sum")
    err = expect_raises((ValueError, RuntimeError),
                        lambda: hvd.alltoall(torch.zeros(SIZE, 2),
                                             splits=torch.ones(SIZE, dtype=torch.float32)),
                        "alltoall float splits", "int32")
    _not_internal(err, "float splits")
    if err is not None and "-1399583812878336" in str(err):
        fail("float splits read as garbage")
    err = expect_raises((ValueError, RuntimeError),
                        lambda: hvd.alltoall(torch.zeros(SIZE, 2),
                                             splits=torch.ones(SIZE, dtype=torch.int64)),
                        "alltoall int64 splits", "int32")
    _not_internal(err, "int64 splits")
    err = expect_raises((ValueError, RuntimeError),
                        lambda: hvd.alltoall(torch.zeros(SIZE + 1, 2), splits=[1] * (SIZE + 1)),
                        "alltoall too many splits", "one count per rank")
    _not_internal(err, "splits length")
    # The job is still in step: nothing was sent by the refused calls.
    out, recv = hvd.alltoall(torch.arange(SIZE, dtype=torch.float32) + 10 * RANK,
                             splits=[1] * SIZE)
    same(out, torch.tensor([10.0 * r + RANK for r in range(SIZE)]), "alltoall after the errors")
    same(recv, torch.ones(SIZE, dtype=torch.int32), "received splits")
    out, recv = hvd.alltoall(torch.ones(SIZE, 1), splits=np.ones(SIZE, np.int64))
    same(recv, torch.ones(SIZE, dtype=torch.int32), "numpy splits accepted")


def check_reducescatter_adasum():
    # Horovod: its enqueue's Aborted, re-raised as HorovodInternalError (a RuntimeError).
    expect_raises(hvd.HorovodInternalError, lambda: hvd.reducescatter(torch.ones(SIZE, 2),
                                                                      op=hvd.Adasum),
                  "reducescatter Adasum", "Adasum")
    expect_raises(hvd.HorovodInternalError, lambda: hvd.grouped_reducescatter(
        [torch.ones(SIZE, 2)], op=hvd.Adasum), "grouped_reducescatter Adasum", "Adasum")
    # Nothing was sent: the job is still in step.
    same(hvd.reducescatter(torch.ones(SIZE, 2), op=hvd.Sum),
         torch.full((1, 2), float(SIZE)), "reducescatter after the refusals")


def check_mismatch():
    n = 2 + RANK % 2
    expect_raises(hvd.HorovodInternalError, lambda: hvd.allreduce(torch.zeros(n), name="cmp.t"),
                  "allreduce shape mismatch", "cmp.t")
    same(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="cmp.t.after"),
         torch.full((2,), float(SIZE)), "allreduce after the mismatch")


def check_process_sets():
    ps = hvd.ProcessSet(reversed(range(1, SIZE)))
    if ps.ranks != list(range(1, SIZE)):
        fail(f"ProcessSet(reversed(range(1, size))).ranks = {ps.ranks}")
    if hvd.ProcessSet(torch.tensor([1, 0])).ranks != [0, 1]:
        fail("ProcessSet(tensor) not accepted/sorted")
    hvd.shutdown()
    perm = hvd.ProcessSet(reversed(range(SIZE)))
    expect_raises(ValueError, lambda: hvd.init(process_sets=[hvd.ProcessSet(range(SIZE)), perm]),
                  "duplicate process sets (permuted == sorted)", "pass each process set once")
    sub = hvd.ProcessSet(reversed(range(1, SIZE)))
    hvd.init(process_sets=[sub])
    if sub.included():
        out = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=sub, name="cmp.ps")
        same(out, torch.full((1,), float(SIZE - 1)), "allreduce on a permuted set")


def check_grouped_result_types():
    """Horovod's handle map holds a group's outputs as a tuple: synchronize() of a grouped
    handle, grouped_allreduce_ and grouped_allgather return tuples; grouped_allreduce and
    grouped_reducescatter return lists."""
    xs = [torch.ones(SIZE, 2), torch.ones(SIZE)]
    want = {
        "grouped_allreduce_": (tuple, lambda: hvd.grouped_allreduce_([x.clone() for x in xs])),
        "grouped_allreduce_async": (tuple, lambda: hvd.synchronize(
            hvd.grouped_allreduce_async(xs))),
        "grouped_allreduce_async_": (tuple, lambda: hvd.synchronize(
            hvd.grouped_allreduce_async_([x.clone() for x in xs]))),
        "grouped_allgather": (tuple, lambda: hvd.grouped_allgather(xs)),
        "grouped_allgather (autograd)": (tuple, lambda: hvd.grouped_allgather(
            [x.clone().requires_grad_() for x in xs])),
        "grouped_allgather_async": (tuple, lambda: hvd.synchronize(
            hvd.grouped_allgather_async(xs))),
        "grouped_reducescatter_async": (tuple, lambda: hvd.synchronize(
            hvd.grouped_reducescatter_async(xs))),
        "grouped_allreduce": (list, lambda: hvd.grouped_allreduce(xs)),
        "grouped_reducescatter": (list, lambda: hvd.grouped_reducescatter(xs)),
    }
    for what, (kind, fn) in want.items():
        out = fn()
        if type(out) is not kind or len(out) != 2:
            fail(f"{what} returned {type(out).__name__} of {len(out)}, Horovod a {kind.__name__}")
    same(hvd.grouped_allreduce_([x.clone() for x in xs], op=hvd.Sum)[1],
         torch.full((SIZE,), float(SIZE)), "grouped_allreduce_ values")


def check_init_arguments():
    """Horovod's init(comm=[]) is its default (every rank), and process_sets="DYNAMIC" is
    read case-insensitively, as Horovod's init reads it."""
    hvd.shutdown()
    if hvd.gloo_enabled() or hvd.mpi_enabled():
        fail("gloo_enabled() or mpi_enabled() is True while hvdlite is not initialized")
    hvd.init(comm=[], process_sets="DYNAMIC")
    # Build facts with Horovod's types: nccl_built() an int (NCCL_VERSION_CODE or 0), and
    # mpi_threads_supported() a ValueError on a job whose collectives do not run on MPI.
    if type(hvd.nccl_built()) is not int:
        fail(f"nccl_built() returned {type(hvd.nccl_built()).__name__}, Horovod an int")
    if hvd.gloo_enabled():
        expect_raises(ValueError, hvd.mpi_threads_supported, "mpi_threads_supported on gloo",
                      "MPI is not enabled")
    if hvd.size() != SIZE:
        fail(f"init(comm=[], process_sets='DYNAMIC'): size {hvd.size()}")
    ps = hvd.add_process_set(range(SIZE - 1, 0, -1))
    if ps.included():
        same(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps, name="cmp.dyn"),
             torch.full((1,), float(SIZE - 1)), "allreduce on a dynamic set")
    if hvd.remove_process_set(ps) is not True:
        fail("remove_process_set of a dynamic set did not return True")


def main():
    check("grouped_result_types", check_grouped_result_types)
    check("alltoall_errors", check_alltoall_errors)
    check("reducescatter_adasum", check_reducescatter_adasum)
    check("mismatch", check_mismatch)
    check("process_sets", check_process_sets)
    check("init_arguments", check_init_arguments)
    finish()
    hvd.shutdown()


if __name__ == "__main__":
    main()
