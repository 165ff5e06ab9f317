"""Gradients of the differentiable collectives, against Horovod 0.28's definitions
(horovod/torch/mpi_ops.py autograd functions and test/parallel/test_torch.py):

- allreduce:      grad = allreduce(grad_out, same op, same prescale/postscale)
- allgather:      grad = allreduce(grad_out, Average)[this rank's rows]
- broadcast:      grad = allreduce(grad_out, Average) on the root, zeros elsewhere
- alltoall:       grad = alltoall(grad_out, splits=received splits)
- reducescatter:  grad = allgather(grad_out), times the set size for Sum (Horovod's TF
                  _reducescatter_grad; test_torch.py expects ones*size for Sum, ones for Average),
                  times prescale_factor and postscale_factor (HorovodReducescatter.backward)
Grouped variants follow the ungrouped ones tensor by tensor.
"""
from __future__ import annotations

import torch

import hvdlite.torch as hvd
from ops_common import check, finish, gen, reduce_ref, same, split_rows

hvd.init()
rank, size = hvd.rank(), hvd.size()
F64 = torch.float64


def leaf(t):
    return t.clone().requires_grad_()


def allreduce_grad():
    for opname, op in [("Sum", hvd.Sum), ("Average", hvd.Average)]:
        for pre, post in [(1.0, 1.0), (0.5, 3.0)]:
            x = leaf(gen(rank, (3, 4), F64, "x"))
            y = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
            y.backward(gen(rank, (3, 4), F64, ("G", opname)))
            ref = reduce_ref([gen(r, (3, 4), F64, ("G", opname)) for r in range(size)], op, pre,
                             post)
            same(x.grad, ref, f"allreduce grad {opname} pre={pre} post={post}")


def grouped_allreduce_grad():
    shapes = [(3,), (2, 2)]
    for opname, op in [("Sum", hvd.Sum), ("Average", hvd.Average)]:
        xs = [leaf(gen(rank, s, F64, ("gx", i))) for i, s in enumerate(shapes)]
        ys = hvd.grouped_allreduce(xs, op=op, postscale_factor=2.0)
        loss = sum((y * gen(rank, s, F64, ("gG", i, opname))).sum()
                   for i, (y, s) in enumerate(zip(ys, shapes)))
        loss.backward()
        for i, s in enumerate(shapes):
            ref = reduce_ref([gen(r, s, F64, ("gG", i, opname)) for r in range(size)], op, 1.0,
                             2.0)
            same(xs[i].grad, ref, f"grouped_allreduce grad [{i}] {opname}")


def _gather_case(dims, tail, salt):
    total = sum(dims)
    grads = [gen(r, (total,) + tail, F64, salt) for r in range(size)]
    avg = reduce_ref(grads, hvd.Average)
    off = sum(dims[:rank])
    return grads[rank], avg[off:off + dims[rank]]


def allgather_grad():
    for tail in [(), (3, 2)]:
        dims = [r + 2 for r in range(size)]
        x = leaf(gen(rank, (dims[rank],) + tail, F64, "agx"))
        y = hvd.allgather(x)
        g, ref = _gather_case(dims, tail, ("agG", tail))
        y.backward(g)
        same(x.grad, ref, f"allgather grad tail={tail}")


def grouped_allgather_grad():
    dims = [[r + 1 + i for r in range(size)] for i in range(2)]
    xs = [leaf(gen(rank, (dims[i][rank], 2), F64, ("gagx", i))) for i in range(2)]
    ys = hvd.grouped_allgather(xs)
    loss = 0
    refs = []
    for i, y in enumerate(ys):
        g, ref = _gather_case(dims[i], (2,), ("gagG", i))
        loss = loss + (y * g).sum()
        refs.append(ref)
    loss.backward()
    for i in range(2):
        same(xs[i].grad, refs[i], f"grouped_allgather grad [{i}]")


def broadcast_grad():
    for root in sorted({0, size - 1}):
        x = leaf(gen(rank, (2, 3), F64, "bcx"))
        y = hvd.broadcast(x, root)
        y.backward(gen(rank, (2, 3), F64, ("bcG", root)))
        ref = reduce_ref([gen(r, (2, 3), F64, ("bcG", root)) for r in range(size)], hvd.Average)
        if rank != root:
            ref = torch.zeros_like(ref)
        same(x.grad, ref, f"broadcast grad root={root}")


def alltoall_grad():
    tail = (2,)
    # Without splits (even split) and with uneven splits.
    for kind in ("even", "splits"):
        if kind == "even":
            splits = [[2] * size for _ in range(size)]
        else:
            splits = [[(j + 2 * i) % 3 + 1 for i in range(size)] for j in range(size)]
        x = leaf(gen(rank, (sum(splits[rank]),) + tail, F64, ("a2ax", kind)))
        if kind == "even":
            y = hvd.alltoall(x)
        else:
            y, recv = hvd.alltoall(x, splits=splits[rank])
            same(recv, torch.tensor([splits[j][rank] for j in range(size)], dtype=torch.int32),
                 "alltoall received splits")
        recv_rows = [sum(splits[k][j] for k in range(size)) for j in range(size)]
        gs = [gen(j, (recv_rows[j],) + tail, F64, ("a2aG", kind)) for j in range(size)]
        y.backward(gs[rank])
        # Rank j's grad_out rows are ordered by sender; rank `rank` gets its own rows back.
        pieces = []
        for j in range(size):
            off = sum(splits[k][j] for k in range(rank))
            pieces.append(gs[j][off:off + splits[rank][j]])
        same(x.grad, torch.cat(pieces), f"alltoall grad ({kind})")


def _rs_grad_ref(rows, tail, salt, factor):
    """Horovod: allgather(grad_out) (times the set size for Sum)."""
    mine = split_rows(rows, size)
    gs = [gen(r, (mine[r],) + tail, F64, salt) for r in range(size)]
    return gs[rank], torch.cat(gs) * factor


# (op name, op, the gradient's factor from the op, prescale, postscale)
RS_CASES = [("Sum", hvd.Sum, float(size), 1.0, 1.0), ("Average", hvd.Average, 1.0, 1.0, 1.0),
            ("Sum", hvd.Sum, float(size), 2.0, 3.0), ("Average", hvd.Average, 1.0, 0.5, 1.0),
            ("Average", hvd.Average, 1.0, 1.0, 3.0)]


def reducescatter_grad():
    for opname, op, factor, pre, post in RS_CASES:
        for rows in (4 * size, 2 * size + 1):
            x = leaf(gen(rank, (rows, 3), F64, "rsx"))
            y = hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
            g, ref = _rs_grad_ref(rows, (3,), ("rsG", opname, rows), factor * pre * post)
            y.backward(g)
            same(x.grad, ref, f"reducescatter grad {opname} pre={pre} post={post} rows={rows}")


def grouped_reducescatter_grad():
    for opname, op, factor, pre, post in RS_CASES:
        rows = [4 * size, 2 * size + 1]
        xs = [leaf(gen(rank, (rows[i], 2), F64, ("grsx", i))) for i in range(2)]
        ys = hvd.grouped_reducescatter(xs, op=op, prescale_factor=pre, postscale_factor=post)
        cases = [_rs_grad_ref(rows[i], (2,), ("grsG", opname, i), factor * pre * post)
                 for i in range(2)]
        sum((y * g).sum() for y, (g, _) in zip(ys, cases)).backward()
        for i in range(2):
            same(xs[i].grad, cases[i][1],
                 f"grouped_reducescatter grad [{i}] {opname} pre={pre} post={post}")


def untraced():
    """Without a gradient to record (no input needs one, or grad mode is off) the ops skip
    autograd (mpi_ops._traced): same values, no grad_fn; with one they record it."""
    x = gen(rank, (4, 3), F64, "u")
    want = reduce_ref([gen(r, (4, 3), F64, "u") for r in range(size)], hvd.Sum)
    for label, t, mode in [("plain", x, True), ("no_grad", leaf(x), False)]:
        with torch.set_grad_enabled(mode):
            outs = {"allreduce": hvd.allreduce(t, op=hvd.Sum),
                    "grouped_allreduce": hvd.grouped_allreduce([t], op=hvd.Sum)[0],
                    "broadcast": hvd.broadcast(t, 0), "allgather": hvd.allgather(t),
                    "reducescatter": hvd.reducescatter(t, op=hvd.Sum),
                    "alltoall": hvd.alltoall(t)}
        for op, out in outs.items():
            if out.grad_fn is not None or out.requires_grad:
                raise AssertionError(f"{op} ({label}) recorded autograd history")
        same(outs["allreduce"], want, f"allreduce ({label})")
        same(outs["grouped_allreduce"], want, f"grouped_allreduce ({label})")
        same(outs["broadcast"], gen(0, (4, 3), F64, "u"), f"broadcast ({label})")
        same(outs["allgather"], torch.cat([gen(r, (4, 3), F64, "u") for r in range(size)]),
             f"allgather ({label})")
    traced = hvd.allreduce(leaf(x), op=hvd.Sum)
    if traced.grad_fn is None:
        raise AssertionError("allreduce of a tensor that needs a gradient recorded none")


check("untraced", untraced)
check("allreduce_grad", allreduce_grad)
check("grouped_allreduce_grad", grouped_allreduce_grad)
check("allgather_grad", allgather_grad)
check("grouped_allgather_grad", grouped_allgather_grad)
check("broadcast_grad", broadcast_grad)
check("alltoall_grad", alltoall_grad)
check("reducescatter_grad", reducescatter_grad)
check("grouped_reducescatter_grad", grouped_reducescatter_grad)
finish()
hvd.shutdown()
