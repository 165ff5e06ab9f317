"""Every torch collective x every supported dtype x every reduce op, against local references.

Usage: hvdlite-run -np N python ops_basic.py TMPDIR
"""
from __future__ import annotations

import itertools
import os
import sys
import time

import torch

import hvdlite.torch as hvd
from ops_common import (ALL_DTYPES, REDUCE_OPS, SHAPES, all_inputs, check, expect_raises,
                        fail, finish, gen, log, my_rows, no_threads_left, reduce_ref, same,
                        wait_until)

TMP = sys.argv[1]
hvd.init()
rank, size = hvd.rank(), hvd.size()
Error = (ValueError, RuntimeError, hvd.HorovodInternalError)


def scales(dtype, op):
    """(prescale, postscale) pairs whose results stay exact and within the dtype's range."""
    if op == hvd.Product:
        return [(1.0, 1.0), (1.0, 3.0)]
    if dtype.is_floating_point:
        return [(1.0, 1.0), (0.5, 0.25), (2.0, 3.0)]
    return [(1.0, 1.0), (2.0, 3.0)]


def value_range(op):
    return (-2, 2) if op == hvd.Product else (-4, 4)


def not_aliased(out, inp, what):
    if out.numel() and inp.numel():
        assert out.data_ptr() != inp.data_ptr(), f"{what}: output aliases the input"


# ------------------------------------------------------------------ allreduce
def allreduce_matrix(opname):
    n = 0
    op = REDUCE_OPS[opname]
    for dtype, shape in itertools.product(ALL_DTYPES, SHAPES):
        lo, hi = value_range(op)
        for pre, post in scales(dtype, op):
            salt = f"ar.{dtype}.{opname}.{shape}.{pre}.{post}"
            x = gen(rank, shape, dtype, salt, lo, hi)
            keep = x.clone()
            ref = reduce_ref(all_inputs(size, shape, dtype, salt, lo, hi), op, pre, post)
            # Alternate named and unnamed (call-site named) requests.
            name = salt if n % 2 else None
            y = hvd.allreduce(x, name=name, op=op, prescale_factor=pre, postscale_factor=post)
            what = f"allreduce {dtype} {opname} shape={shape} pre={pre} post={post}"
            same(y, ref, what)
            same(x, keep, what + " (input modified)")
            not_aliased(y, x, what)
            n += 1
    log(f"allreduce {opname}: {n} cases")


def _min_max_ref(xs: list, op) -> torch.Tensor:
    """Min or Max over `xs`, NaN where any is NaN (torch.minimum / maximum)."""
    pick = torch.maximum if op == hvd.Max else torch.minimum
    out = xs[0]
    for x in xs[1:]:
        out = pick(out, x)
    return out


def min_max_nan_and_signed_zeros():
    """Min and Max where a rank has a NaN, or +0 against -0: a NaN anywhere gives NaN, and
    every rank gets the same values (MPI's own MIN/MAX depend on the order the operands meet
    in, which differs between ranks: the ranks got different results), for float32 and
    float64, lone and fused. (+0 and -0 compare equal, and may come out either way.)"""
    nan = float("nan")
    rows = [[nan, 0.0, 1.0, -0.0, 2.0], [1.0, -0.0, nan, -0.0, 3.0]]
    for dtype in (torch.float32, torch.float64):
        xs = [torch.tensor(rows[r % 2], dtype=dtype) * (1 if r < 2 else 0.5)
              for r in range(size)]
        for opname, op in (("Max", hvd.Max), ("Min", hvd.Min)):
            got = {"lone": (hvd.allreduce(xs[rank], op=op, name=f"nanmm.{opname}.{dtype}"),
                            _min_max_ref(xs, op))}
            handles = [hvd.allreduce_async(xs[rank] * (k + 1), op=op,
                                           name=f"nanmm.f{k}.{opname}.{dtype}")
                       for k in range(3)]
            for k, h in enumerate(handles):
                got[f"fused {k}"] = (hvd.synchronize(h),
                                     _min_max_ref([x * (k + 1) for x in xs], op))
            for what, (out, want) in got.items():
                every = hvd.allgather(out.unsqueeze(0), name=f"nanmm.all.{what}")
                if not all(torch.equal(every[0].isnan(), every[r].isnan())
                           and torch.equal(every[0].nan_to_num(), every[r].nan_to_num())
                           for r in range(size)):
                    raise AssertionError(f"{opname} {dtype} {what}: the ranks got different "
                                         f"results: {every.tolist()}")
                same_nan = torch.equal(torch.isnan(out), torch.isnan(want))
                real = ~torch.isnan(want)
                if not (same_nan and torch.equal(out[real], want[real])):   # (0.0 == -0.0)
                    raise AssertionError(f"{opname} {dtype} {what}: {out.tolist()} against "
                                         f"{want.tolist()}")


def allreduce_variants():
    for dtype in ALL_DTYPES:
        for opname in ("Sum", "Average", "Min"):
            op = REDUCE_OPS[opname]
            shape = (3, 4, 5)
            pre, post = (0.5, 3.0) if dtype.is_floating_point else (2.0, 3.0)
            salt = f"arv.{dtype}.{opname}"
            ref = reduce_ref(all_inputs(size, shape, dtype, salt), op, pre, post)
            what = f"{dtype} {opname}"

            x = gen(rank, shape, dtype, salt)
            keep = x.clone()
            h = hvd.allreduce_async(x, name=f"{salt}.async", op=op, prescale_factor=pre,
                                    postscale_factor=post)
            y = hvd.synchronize(h)
            same(y, ref, "allreduce_async " + what)
            same(x, keep, "allreduce_async input modified " + what)
            not_aliased(y, x, "allreduce_async " + what)

            x = gen(rank, shape, dtype, salt)
            y = hvd.allreduce_(x, name=f"{salt}.inplace", op=op, prescale_factor=pre,
                               postscale_factor=post)
            assert y is x, "allreduce_ must return its argument"
            same(x, ref, "allreduce_ " + what)

            x = gen(rank, shape, dtype, salt)
            h = hvd.allreduce_async_(x, op=op, prescale_factor=pre, postscale_factor=post)
            y = hvd.synchronize(h)
            same(x, ref, "allreduce_async_ " + what)
            assert y.data_ptr() == x.data_ptr(), "allreduce_async_ result must be the input"

            # A non-contiguous input is reduced by value.
            xt = gen(rank, (5, 4, 3), dtype, salt + ".t").permute(2, 1, 0)
            assert not xt.is_contiguous()
            reft = reduce_ref([t.permute(2, 1, 0) for t in
                               all_inputs(size, (5, 4, 3), dtype, salt + ".t")], op, pre, post)
            y = hvd.allreduce(xt, op=op, prescale_factor=pre, postscale_factor=post)
            same(y.contiguous(), reft, "allreduce non-contiguous " + what)

    # Deprecated average= argument and default op (Average).
    x = gen(rank, (6,), torch.float32, "avg")
    xs = all_inputs(size, (6,), torch.float32, "avg")
    same(hvd.allreduce(x, average=False), reduce_ref(xs, hvd.Sum), "average=False")
    same(hvd.allreduce(x, average=True), reduce_ref(xs, hvd.Average), "average=True")
    same(hvd.allreduce(x), reduce_ref(xs, hvd.Average), "default op")
    expect_raises(ValueError, lambda: hvd.allreduce(x, average=True, op=hvd.Sum),
                  "average and op together")
    # In-place variants need contiguous tensors (Horovod: 'Tensor is required to be contiguous.').
    xt = torch.zeros(4, 3).t()
    expect_raises(ValueError, lambda: hvd.allreduce_(xt), "allreduce_ non-contiguous")
    expect_raises(ValueError, lambda: hvd.allreduce_async_(xt), "allreduce_async_ non-contiguous")
    # fp16 compression: a float32 tensor comes back float32 with the (exact) reduced values.
    y = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    same(y, reduce_ref(xs, hvd.Sum), "allreduce Compression.fp16")


def grouped_allreduce(opname):
    shapes = [(), (7,), (3, 4, 5), (2, 2)]
    op = REDUCE_OPS[opname]
    for dtype in ALL_DTYPES:
        if True:
            lo, hi = value_range(op)
            pre, post = (1.0, 3.0)
            salt = f"gar.{dtype}.{opname}"
            xs = [gen(rank, s, dtype, (salt, i), lo, hi) for i, s in enumerate(shapes)]
            keep = [x.clone() for x in xs]
            refs = [reduce_ref(all_inputs(size, s, dtype, (salt, i), lo, hi), op, pre, post)
                    for i, s in enumerate(shapes)]
            what = f"{dtype} {opname}"
            ungrouped = [hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
                         for x in xs]
            ys = hvd.grouped_allreduce(xs, name=salt, op=op, prescale_factor=pre,
                                       postscale_factor=post)
            assert isinstance(ys, list) and len(ys) == len(xs)
            for i, (y, u, r) in enumerate(zip(ys, ungrouped, refs)):
                same(y, r, f"grouped_allreduce[{i}] " + what)
                same(y, u, f"grouped_allreduce[{i}] vs allreduce " + what)
                not_aliased(y, xs[i], f"grouped_allreduce[{i}] " + what)
                same(xs[i], keep[i], f"grouped_allreduce input modified [{i}] " + what)
            h = hvd.grouped_allreduce_async(xs, op=op, prescale_factor=pre, postscale_factor=post)
            ys = hvd.synchronize(h)
            for i, (y, r) in enumerate(zip(ys, refs)):
                same(y, r, f"grouped_allreduce_async[{i}] " + what)
            xs2 = [x.clone() for x in xs]
            out = hvd.grouped_allreduce_(xs2, op=op, prescale_factor=pre, postscale_factor=post)
            for i, (x, r) in enumerate(zip(xs2, refs)):
                same(x, r, f"grouped_allreduce_[{i}] " + what)
                assert out[i] is x
            xs3 = [x.clone() for x in xs]
            hvd.synchronize(hvd.grouped_allreduce_async_(xs3, name=salt + ".ai", op=op,
                                                         prescale_factor=pre,
                                                         postscale_factor=post))
            for i, (x, r) in enumerate(zip(xs3, refs)):
                same(x, r, f"grouped_allreduce_async_[{i}] " + what)


# ------------------------------------------------------------------ allgather
def gather_dims(base: int) -> list[int]:
    return [base + r for r in range(size)]


def allgather_all():
    for dtype in ALL_DTYPES + [torch.bool]:
        for tail in [(), (3, 2)]:
            dims = gather_dims(1)
            salt = f"ag.{dtype}.{tail}"
            x = gen(rank, (dims[rank],) + tail, dtype, salt)
            keep = x.clone()
            ref = torch.cat([gen(r, (dims[r],) + tail, dtype, salt) for r in range(size)])
            what = f"allgather {dtype} tail={tail}"
            y = hvd.allgather(x, name=salt if tail else None)
            same(y, ref, what)
            same(x, keep, what + " input modified")
            not_aliased(y, x, what)
            y = hvd.synchronize(hvd.allgather_async(x))
            same(y, ref, "allgather_async " + what)
            # grouped: three tensors with different first dims per rank and per tensor
            xs = [gen(rank, (dims[rank] + i,) + tail, dtype, (salt, i)) for i in range(3)]
            refs = [torch.cat([gen(r, (dims[r] + i,) + tail, dtype, (salt, i))
                               for r in range(size)]) for i in range(3)]
            ys = hvd.grouped_allgather(xs, name=salt + ".g")
            ungrouped = [hvd.allgather(t) for t in xs]
            for i in range(3):
                same(ys[i], refs[i], f"grouped_allgather[{i}] " + what)
                same(ys[i], ungrouped[i], f"grouped_allgather[{i}] vs allgather " + what)
            ys = hvd.synchronize(hvd.grouped_allgather_async(xs))
            for i in range(3):
                same(ys[i], refs[i], f"grouped_allgather_async[{i}] " + what)
    # A rank that contributes no rows.
    dims = [(r * 2) % 3 for r in range(size)]   # rank 0 contributes 0 rows
    x = gen(rank, (dims[rank], 4), torch.float32, "ag.empty")
    ref = torch.cat([gen(r, (dims[r], 4), torch.float32, "ag.empty") for r in range(size)])
    same(hvd.allgather(x, name="ag.empty"), ref, "allgather with an empty contribution")


def scalar_errors():
    # 0-d tensors cannot be gathered, scattered or exchanged: a clear error on every rank.
    s = torch.tensor(1.0)
    expect_raises(Error, lambda: hvd.allgather_async(s), "allgather_async of a 0-d tensor")
    expect_raises(Error, lambda: hvd.alltoall(s), "alltoall of a 0-d tensor")
    expect_raises(Error, lambda: hvd.reducescatter(s), "reducescatter of a 0-d tensor")
    expect_raises(Error, lambda: hvd.grouped_allgather([s]), "grouped_allgather of a 0-d tensor")
    expect_raises(Error, lambda: hvd.allgather(s), "allgather of a 0-d tensor")


# ------------------------------------------------------------------ broadcast
def broadcast_all():
    for dtype in ALL_DTYPES + [torch.bool]:
        for shape in SHAPES:
            for root in range(size):
                salt = f"bc.{dtype}.{shape}.{root}"
                x = gen(rank, shape, dtype, salt)
                keep = x.clone()
                ref = gen(root, shape, dtype, salt)
                what = f"broadcast {dtype} shape={shape} root={root}"
                y = hvd.broadcast(x, root, name=salt if root % 2 else None)
                same(y, ref, what)
                same(x, keep, what + " input modified")
                not_aliased(y, x, what)
                y = hvd.synchronize(hvd.broadcast_async(x, root_rank=root))
                same(y, ref, "broadcast_async " + what)
                same(x, keep, "broadcast_async input modified " + what)
                x2 = x.clone()
                y = hvd.broadcast_(x2, root)
                assert y is x2
                same(x2, ref, "broadcast_ " + what)
                x3 = x.clone()
                y = hvd.synchronize(hvd.broadcast_async_(x3, root, name=salt + ".ai"))
                same(x3, ref, "broadcast_async_ " + what)
    expect_raises(ValueError, lambda: hvd.broadcast_(torch.zeros(3, 2).t(), 0),
                  "broadcast_ non-contiguous")


# ------------------------------------------------------------------ alltoall
def alltoall_all():
    for dtype in ALL_DTYPES + [torch.bool]:
        for tail in [(), (3, 2)]:
            salt = f"a2a.{dtype}.{tail}"
            what = f"alltoall {dtype} tail={tail}"
            # Without splits: the first dim is split evenly.
            x = gen(rank, (2 * size,) + tail, dtype, salt)
            keep = x.clone()
            ref = torch.cat([gen(j, (2 * size,) + tail, dtype, salt)[2 * rank:2 * rank + 2]
                             for j in range(size)])
            y = hvd.alltoall(x, name=salt)
            same(y, ref, what)
            same(x, keep, what + " input modified")
            not_aliased(y, x, what)
            out, rsplits = hvd.synchronize(hvd.alltoall_async(x))
            same(out, ref, "alltoall_async " + what)
            same(rsplits, torch.full((size,), 2, dtype=torch.int32), "alltoall_async splits")

            # With uneven splits (including zeros): rank j sends splits[j][i] rows to rank i.
            splits = [[(j + 2 * i) % 3 for i in range(size)] for j in range(size)]
            inputs = [gen(j, (sum(splits[j]),) + tail, dtype, salt + ".s") for j in range(size)]
            pieces = []
            for j in range(size):
                start = sum(splits[j][:rank])
                pieces.append(inputs[j][start:start + splits[j][rank]])
            ref = torch.cat(pieces)
            ref_recv = [splits[j][rank] for j in range(size)]
            # Horovod requires int32 splits; int64 is refused before anything is sent.
            expect_raises(ValueError, lambda: hvd.alltoall(
                inputs[rank], splits=torch.tensor(splits[rank], dtype=torch.int64)),
                "alltoall int64 splits " + what, match="int32")
            for kind in ("list", "int32"):
                sp = splits[rank]
                if kind != "list":
                    sp = torch.tensor(sp, dtype=getattr(torch, kind))
                y, recv = hvd.alltoall(inputs[rank], splits=sp)
                same(y, ref, f"alltoall splits as {kind} " + what)
                want_dtype = torch.int32 if kind == "list" else getattr(torch, kind)
                same(recv, torch.tensor(ref_recv, dtype=want_dtype),
                     f"alltoall received splits ({kind}) " + what)
            y, recv = hvd.synchronize(hvd.alltoall_async(inputs[rank], splits=splits[rank],
                                                         name=salt + ".async"))
            same(y, ref, "alltoall_async splits " + what)
            same(recv, torch.tensor(ref_recv, dtype=torch.int32), "alltoall_async recv splits")


def alltoall_bad_splits():
    # Rank 0 passes splits that do not add up; every rank must get an error (no hang).
    x = torch.arange(2 * size, dtype=torch.float32)
    sp = [2] * size
    if rank == 0:
        sp = [3] * size
    expect_raises(Error, lambda: hvd.alltoall(x, splits=sp, name="a2a.bad"),
                  "alltoall with splits that do not sum to dim 0")
    # The job keeps working afterwards.
    y = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after.bad.splits")
    same(y, torch.full((2,), float(size)), "allreduce after a failed alltoall")


# ------------------------------------------------------------------ reducescatter
def reducescatter_all():
    shapes = [(2 * size + 1,), (size + 3, 2, 3), (1, 5)]   # never divisible; dim0 < size
    for dtype, (opname, op) in itertools.product(ALL_DTYPES, REDUCE_OPS.items()):
        lo, hi = value_range(op)
        for shape in shapes:
            for pre, post in scales(dtype, op)[-1:]:
                salt = f"rs.{dtype}.{opname}.{shape}.{pre}.{post}"
                x = gen(rank, shape, dtype, salt, lo, hi)
                keep = x.clone()
                full = reduce_ref(all_inputs(size, shape, dtype, salt, lo, hi), op, pre, post)
                ref = my_rows(full, size, rank)
                what = f"reducescatter {dtype} {opname} shape={shape} pre={pre} post={post}"
                y = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post,
                                      name=salt if shape[0] == 1 else None)
                same(y, ref, what)
                same(x, keep, what + " input modified")
                not_aliased(y, x, what)
                if shape[0] == 1:
                    continue
                y = hvd.synchronize(hvd.reducescatter_async(x, op=op, prescale_factor=pre,
                                                            postscale_factor=post))
                same(y, ref, "reducescatter_async " + what)
        # grouped: different first dims (one divisible, two not)
        gshapes = [(2 * size, 3), (2 * size + 1,), (size + 1, 2, 2)]
        salt = f"grs.{dtype}.{opname}"
        xs = [gen(rank, s, dtype, (salt, i), lo, hi) for i, s in enumerate(gshapes)]
        refs = [my_rows(reduce_ref(all_inputs(size, s, dtype, (salt, i), lo, hi), op), size,
                        rank) for i, s in enumerate(gshapes)]
        ys = hvd.grouped_reducescatter(xs, name=salt, op=op)
        ungrouped = [hvd.reducescatter(x, op=op) for x in xs]
        for i in range(len(xs)):
            same(ys[i], refs[i], f"grouped_reducescatter[{i}] {dtype} {opname}")
            same(ys[i], ungrouped[i], f"grouped_reducescatter[{i}] vs reducescatter {dtype}")
        ys = hvd.synchronize(hvd.grouped_reducescatter_async(xs, op=op))
        for i in range(len(xs)):
            same(ys[i], refs[i], f"grouped_reducescatter_async[{i}] {dtype} {opname}")
    # Default op is Average.
    x = gen(rank, (2 * size + 1, 2), torch.float64, "rs.default")
    full = reduce_ref(all_inputs(size, (2 * size + 1, 2), torch.float64, "rs.default"),
                      hvd.Average)
    same(hvd.reducescatter(x), my_rows(full, size, rank), "reducescatter default op")


def many_fused_reducescatters():
    # Several async reducescatters of one dtype fuse into one transport call.
    handles, refs = [], []
    for i in range(12):
        shape = (i % (size + 2) + 1, i % 3 + 1)
        x = gen(rank, shape, torch.float32, ("frs", i))
        refs.append(my_rows(reduce_ref(all_inputs(size, shape, torch.float32, ("frs", i)),
                                       hvd.Sum), size, rank))
        handles.append(hvd.reducescatter_async(x, name=f"frs.{i}", op=hvd.Sum))
    for i, (h, r) in enumerate(zip(handles, refs)):
        same(hvd.synchronize(h), r, f"fused reducescatter {i}")


# ------------------------------------------------------------------ sparse
def sparse_allreduce():
    dense_inputs = []
    for r in range(size):
        d = torch.zeros(6, 3)
        d[r % 6] = float(r + 1)
        d[(r + 2) % 6, 1] = 2.0
        dense_inputs.append(d)
    ref = torch.stack(dense_inputs).sum(0)
    sp = dense_inputs[rank].to_sparse()
    result = hvd.sparse_allreduce_async(sp, name="sparse.sum", op=hvd.Sum)()
    assert result.is_sparse
    same(result.to_dense(), ref, "sparse_allreduce_async Sum")
    result = hvd.sparse_allreduce_async(sp, name="sparse.avg", op=hvd.Average)()
    same(result.to_dense(), ref / size, "sparse_allreduce_async Average")


# ------------------------------------------------------------------ errors
def errors():
    c = torch.zeros(3, dtype=torch.complex64)
    expect_raises(ValueError, lambda: hvd.allreduce(c), "allreduce complex64")
    expect_raises(ValueError, lambda: hvd.allreduce_async(c), "allreduce_async complex64")
    expect_raises(ValueError, lambda: hvd.allgather(c), "allgather complex64")
    expect_raises(ValueError, lambda: hvd.broadcast(c, 0), "broadcast complex64")
    expect_raises(ValueError, lambda: hvd.alltoall(c), "alltoall complex64")
    expect_raises(ValueError, lambda: hvd.reducescatter(c), "reducescatter complex64")
    b = torch.ones(4, dtype=torch.bool)
    expect_raises(ValueError, lambda: hvd.allreduce(b), "allreduce bool")
    expect_raises(ValueError, lambda: hvd.grouped_allreduce([b]), "grouped_allreduce bool")
    expect_raises(ValueError, lambda: hvd.reducescatter(b, op=hvd.Sum), "reducescatter bool")
    expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(2), op=42), "unknown reduce op")

    # An argument error on one rank only (an unsupported dtype there): that rank raises its
    # ValueError, as Horovod's enqueue does, and every other rank gets an error that names the
    # tensor, the rank and the reason at once (they waited for the stall shutdown, 600 s);
    # named and unnamed, blocking, asynchronous and grouped; then the names work again.
    odd = rank == size - 1

    def refused(shape=(3,)):
        return torch.zeros(shape, dtype=torch.complex64 if odd else torch.float32)
    calls = {
        "named allreduce": lambda: hvd.allreduce(refused(), name="onerank.ar", op=hvd.Sum),
        "unnamed allreduce": lambda: hvd.allreduce(refused(), op=hvd.Sum),
        "allreduce_async": lambda: hvd.synchronize(hvd.allreduce_async(
            refused(), name="onerank.async", op=hvd.Sum)),
        "grouped_allreduce": lambda: hvd.grouped_allreduce(
            [torch.ones(2), refused()], name="onerank.group", op=hvd.Sum),
        "allgather": lambda: hvd.allgather(refused(), name="onerank.ag"),
        "broadcast": lambda: hvd.broadcast(refused(), 0, name="onerank.bc"),
    }
    for what, fn in calls.items():
        if odd:
            expect_raises(ValueError, fn, f"{what} of complex64 on rank {rank}",
                          match="ComplexFloatTensor is not supported")
        else:
            expect_raises(hvd.HorovodInternalError, fn, f"{what} when rank {size - 1} refused it",
                          match=[f"invalid arguments on rank {size - 1}",
                                 "ComplexFloatTensor is not supported"])
    # Errors found before any request exists (a scalar to gather or scatter, an unknown op)
    # reach the other ranks the same way.
    def scalar():
        return torch.zeros(() if odd else (size,))
    early = {
        "allgather of a scalar": (lambda: hvd.allgather(scalar(), name="onerank.ag0"),
                                  "at least one dimension"),
        "unnamed grouped_allgather": (lambda: hvd.grouped_allgather([torch.ones(2), scalar()]),
                                      "at least one dimension"),
        "reducescatter of a scalar": (lambda: hvd.reducescatter(scalar(), name="onerank.rs0"),
                                      "at least one dimension"),
        "alltoall of a scalar": (lambda: hvd.alltoall(scalar(), name="onerank.a2a0"),
                                 "at least one dimension"),
        "allreduce of a sparse tensor": (lambda: hvd.allreduce(
            torch.ones(2).to_sparse() if odd else torch.ones(2), name="onerank.sparse"),
            "layout sparse_coo is not supported"),
        "unnamed broadcast of a sparse tensor": (lambda: hvd.broadcast(
            torch.ones(2).to_sparse() if odd else torch.ones(2), 0),
            "layout sparse_coo is not supported"),
        "allgather of a sparse tensor": (lambda: hvd.allgather(
            torch.ones(2).to_sparse() if odd else torch.ones(2), name="onerank.sparse_ag"),
            "layout sparse_coo is not supported"),
        "allreduce with an unknown op": (lambda: hvd.allreduce(
            torch.ones(2), name="onerank.op", op=42 if odd else hvd.Sum),
            "unknown reduction op"),
    }
    for what, (fn, reason) in early.items():
        if odd:
            expect_raises(ValueError, fn, f"{what} on rank {rank}", match=reason)
        else:
            expect_raises(hvd.HorovodInternalError, fn, f"{what} when rank {size - 1} refused it",
                          match=[f"invalid arguments on rank {size - 1}", reason])
    # An object that cannot be pickled (a lock) on the root of broadcast_object, or on one rank
    # of allgather_object: the others learn why at once.
    import threading
    objects = {
        "broadcast_object": lambda: hvd.broadcast_object(
            threading.Lock() if odd else None, root_rank=size - 1, name="onerank.obj"),
        "allgather_object": lambda: hvd.allgather_object(
            threading.Lock() if odd else rank, name="onerank.objs"),
    }
    for what, fn in objects.items():
        if odd:
            expect_raises(TypeError, fn, f"{what} of a lock on rank {rank}", match="pickle")
        else:
            expect_raises(hvd.HorovodInternalError, fn, f"{what} when rank {size - 1} could "
                          f"not pickle", match=[f"invalid arguments on rank {size - 1}",
                                                "pickle"])
    same(hvd.allreduce(torch.ones(3), name="onerank.ar", op=hvd.Sum),
         torch.full((3,), float(size)), "'onerank.ar' used alike afterwards")
    same(hvd.allgather(torch.ones(1), name="onerank.ag0"), torch.ones(size),
         "'onerank.ag0' used alike afterwards")
    if hvd.allgather_object(rank, name="onerank.objs") != list(range(size)):
        fail("allgather_object after the refusal")

    # Duplicate name while the first one is in flight.
    x = torch.ones(5) * (rank + 1)
    h = hvd.allreduce_async(x, name="dup", op=hvd.Sum)
    exc = expect_raises(ValueError, lambda: hvd.allreduce_async(x, name="dup", op=hvd.Sum),
                        "duplicate name in flight")
    assert "dup" in str(exc), exc
    expect_raises(ValueError, lambda: hvd.allgather_async(x, name="dup"),
                  "duplicate name in flight (allgather)")
    expect_raises(ValueError, lambda: hvd.allreduce_(x.clone(), name="dup", op=hvd.Sum),
                  "duplicate name in flight (blocking allreduce_)")
    same(hvd.synchronize(h), torch.full((5,), float(size * (size + 1) // 2)),
         "first 'dup' allreduce")
    # The name is free again once the first one finished.
    same(hvd.allreduce(x, name="dup", op=hvd.Sum),
         torch.full((5,), float(size * (size + 1) // 2)), "'dup' reused after completion")

    # Mismatched shapes: every rank gets the same clear error, and the job goes on.
    bad = torch.zeros(3 + rank)
    exc = expect_raises(hvd.HorovodInternalError, lambda: hvd.allreduce(bad, name="mismatch"),
                        "mismatched allreduce shapes")
    assert "mismatch" in str(exc) and "shape" in str(exc).lower(), exc
    bad = torch.zeros(4, dtype=torch.float32 if rank % 2 == 0 else torch.float64)
    exc = expect_raises(hvd.HorovodInternalError,
                        lambda: hvd.allreduce(bad, name="mismatch.dtype"),
                        "mismatched allreduce dtypes")
    bad = torch.zeros(2, 3 + rank)
    expect_raises(hvd.HorovodInternalError, lambda: hvd.allgather(bad, name="mismatch.ag"),
                  "mismatched allgather trailing dims")
    expect_raises(hvd.HorovodInternalError,
                  lambda: hvd.broadcast(torch.zeros(2), root_rank=rank, name="mismatch.root"),
                  "mismatched broadcast roots")
    # A grouped call with a different number of tensors on each rank, or alone on one rank
    # and grouped on another: the mismatch on every rank at once (a rank's extra members
    # waited for the stall shutdown, and the report named a healthy rank as hung), twice in a
    # row, and then the same group name, used alike, works.
    for attempt in range(2):
        exc = expect_raises(hvd.HorovodInternalError, lambda: hvd.grouped_allreduce(
            [torch.ones(2)] * (2 + rank), op=hvd.Sum, name="mismatch.group"),
            f"grouped_allreduce of {2 + rank} tensors (attempt {attempt})",
            match=["Mismatched grouped ALLREDUCE in group 'mismatch.group'",
                   "rank 0 submitted it with 2 tensors (one of them: 'mismatch.group.0')",
                   "but rank 1 with 3 tensors"])
    exc = expect_raises(hvd.HorovodInternalError, lambda: (
        hvd.allreduce(torch.ones(2), op=hvd.Sum, name="mismatch.mix.0") if rank == 0 else
        hvd.grouped_allreduce([torch.ones(2)] * 2, op=hvd.Sum, name="mismatch.mix")),
        "alone on rank 0, grouped elsewhere", match="rank 0 submitted it alone")
    # Models that differ (a layer more on the last rank): broadcast_parameters fails on every
    # rank at once with both tensor counts, instead of waiting for the extra layer's names.
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(2 + odd)])
    expect_raises(hvd.HorovodInternalError,
                  lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0),
                  "broadcast_parameters of different models",
                  match=["Mismatched grouped BROADCAST in group 'broadcast_parameters'",
                         "with 4 tensors", "with 6 tensors"])
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(2)])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for k, v in model.state_dict().items():
        same(v, hvd.broadcast(v, 0, name=f"check.{k}"), f"{k} broadcast from rank 0")
    # A rank with no parameters at all (an empty list: a model not built there) takes part
    # too: every rank fails at once with both counts, where the others waited for it until
    # the stall shutdown; and where every rank passes none, the call completes. The last rank
    # comes late, so the error waits for every rank's part, and the next call of the same
    # group, used alike, is not failed by the late rank's members.
    if rank == size - 1:
        time.sleep(0.5)
    expect_raises(hvd.HorovodInternalError,
                  lambda: hvd.broadcast_parameters(model.state_dict() if rank else {}, 0),
                  "broadcast_parameters of no tensors on rank 0",
                  match=["Mismatched grouped BROADCAST in group 'broadcast_parameters'",
                         "rank 0 submitted it with no tensors (an empty list) but rank 1 "
                         "with 4 tensors"])
    hvd.broadcast_parameters([], root_rank=0)
    # As many tensors, named differently: the last rank's model wrapped ('module.' names).
    # Rank 0's are cache hits (the model was broadcast above); they reach the coordinator
    # after the others' requests (rank 0 late), then before them (the last rank late).
    state = {("module." if odd else "") + k: v for k, v in model.state_dict().items()}
    for late in (0, size - 1):
        if rank == late:
            time.sleep(0.3)
        expect_raises(hvd.HorovodInternalError,
                      lambda: hvd.broadcast_parameters(state, root_rank=0),
                      f"broadcast_parameters with names prefixed on the last rank, rank {late} "
                      "late", match=["Mismatched grouped BROADCAST in group "
                                     "'broadcast_parameters'",
                                     f"rank 0 submitted '0.bias', which rank {size - 1} did not, "
                                     f"and rank {size - 1} submitted 'module.0.bias', which "
                                     "rank 0 did not"])
    for attempt in range(3):               # cache hits: the steady state from the second on
        got = hvd.grouped_allreduce([torch.ones(2), torch.ones(3)], op=hvd.Sum,
                                    name="mismatch.cached")
        same(got[1], torch.full((3,), float(size)), f"cached group, attempt {attempt}")
    expect_raises(hvd.HorovodInternalError, lambda: hvd.grouped_allreduce(
        [] if odd else [torch.ones(2), torch.ones(3)], op=hvd.Sum,
        name="mismatch.cached"), "an empty grouped_allreduce against cached members",
        match=["Mismatched grouped ALLREDUCE in group 'mismatch.cached'",
               "with no tensors (an empty list)", "with 2 tensors"])
    same(hvd.grouped_allreduce([torch.ones(2), torch.ones(3)], op=hvd.Sum,
                               name="mismatch.cached")[0], torch.full((2,), float(size)),
         "the cached group used alike after the mismatch")
    assert hvd.grouped_allreduce([], name="mismatch.none") == []
    assert list(hvd.grouped_reducescatter([])) == [] and list(hvd.grouped_allgather([])) == []
    for y in hvd.grouped_allreduce([torch.ones(2)] * 3, op=hvd.Sum, name="mismatch.group"):
        same(y, torch.full((2,), float(size)), "the group used alike after the mismatches")
    same(hvd.allreduce(torch.ones(3), op=hvd.Sum, name="after.mismatch"),
         torch.full((3,), float(size)), "allreduce after errors")


# ------------------------------------------------------------------ poll / synchronize / barrier
def poll_synchronize():
    handles, refs = [], []
    polled_false = False
    for i in range(20):
        shape = (100 + i,)
        x = gen(rank, shape, torch.float32, ("poll", i))
        refs.append(reduce_ref(all_inputs(size, shape, torch.float32, ("poll", i)), hvd.Sum))
        h = hvd.allreduce_async(x, name=f"poll.{i}", op=hvd.Sum)
        if not hvd.poll(h):
            polled_false = True
        handles.append(h)
    assert polled_false, "hvd.poll() was never False right after submission: not async?"
    for i, (h, r) in enumerate(zip(handles, refs)):
        assert wait_until(lambda: hvd.poll(h), 30), f"poll never became True for handle {i}"
        assert isinstance(hvd.poll(h), bool)
        t0 = time.monotonic()
        y = hvd.synchronize(h)
        assert time.monotonic() - t0 < 1.0, "synchronize blocked after poll() was True"
        same(y, r, f"poll/synchronize {i}")
        # Horovod: synchronize of a handle that is no longer known returns None.
        assert hvd.synchronize(h) is None


def barrier():
    for it in range(3):
        if rank == size - 1:
            time.sleep(0.3)
        with open(os.path.join(TMP, f"barrier.{it}.{rank}"), "w") as f:
            f.write("x")
        hvd.barrier()
        missing = [r for r in range(size)
                   if not os.path.exists(os.path.join(TMP, f"barrier.{it}.{r}"))]
        assert not missing, f"barrier {it} returned before ranks {missing} reached it"
    hvd.barrier(process_set=hvd.global_process_set)


def topology():
    assert hvd.is_initialized()
    assert size == int(os.environ.get("HOROVOD_SIZE", size))
    assert 0 <= rank < size
    assert hvd.local_size() == size and hvd.local_rank() == rank
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
    assert hvd.global_process_set.size() == size and hvd.global_process_set.rank() == rank


check("topology", topology)
for opname in REDUCE_OPS:
    check(f"allreduce_{opname}", allreduce_matrix, opname)
check("allreduce_variants", allreduce_variants)
check("min_max_nan", min_max_nan_and_signed_zeros)
for opname in REDUCE_OPS:
    check(f"grouped_allreduce_{opname}", grouped_allreduce, opname)
check("allgather", allgather_all)
check("scalar_errors", scalar_errors)
check("broadcast", broadcast_all)
check("alltoall", alltoall_all)
check("alltoall_bad_splits", alltoall_bad_splits)
check("reducescatter", reducescatter_all)
check("fused_reducescatter", many_fused_reducescatters)
check("sparse_allreduce", sparse_allreduce)
check("errors", errors)
check("poll_synchronize", poll_synchronize)
check("barrier", barrier)
finish()
hvd.shutdown()
no_threads_left()
