"""Many tensors in flight, fusion and the steady-state response cache.

Run under different HOROVOD_FUSION_THRESHOLD / HOROVOD_CACHE_CAPACITY settings: the results must
be exactly the references every time.
"""
from __future__ import annotations

import sys

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics
from ops_common import all_inputs, check, finish, gen, my_rows, reduce_ref, same

hvd.init()
rank, size = hvd.rank(), hvd.size()

N = 200
ITERS = 20


def spec(i: int, it: int):
    """Tensor i's dtype, shape and op (its shape changes at iteration ITERS for i == 7)."""
    dtype = torch.float16 if i % 3 == 0 else torch.float32
    shape = (i % 13 + 1,) if i % 2 else (i % 5 + 1, 3)
    if i % 50 == 49:
        shape = (3000,)          # bigger than a small fusion threshold
    if i == 7 and it >= ITERS:
        shape = (4, 4, 2)
    op = hvd.Average if i % 4 == 0 else hvd.Sum
    return dtype, shape, op


def many_async_allreduces(iters: int, reverse_on_odd: bool):
    for it in range(iters):
        order = list(range(N))
        if reverse_on_odd and rank % 2:
            order.reverse()       # ranks submit in different orders; names match them up
        handles = {}
        for i in order:
            dtype, shape, op = spec(i, it)
            x = gen(rank, shape, dtype, ("fuse", i, it))
            handles[i] = hvd.allreduce_async(x, name=f"fuse.{i}", op=op)
        for i in range(N):
            dtype, shape, op = spec(i, it)
            ref = reduce_ref(all_inputs(size, shape, dtype, ("fuse", i, it)), op)
            y = hvd.synchronize(handles[i])
            same(y, ref, f"iteration {it} tensor fuse.{i}")


def steady_state():
    """The same named collectives of every kind for ITERS iterations, then parameters change."""
    for it in range(ITERS + 3):
        handles = []
        # allreduce, in place, fp32 and fp16
        a = gen(rank, (8, 3), torch.float32, ("ss.a", it))
        ref_a = reduce_ref(all_inputs(size, (8, 3), torch.float32, ("ss.a", it)), hvd.Average)
        handles.append(("a", hvd.allreduce_async_(a, name="ss.a"), None))
        # allgather with a rank-dependent first dim that changes for rank 0 only at ITERS+1
        d = [r + 1 for r in range(size)]
        if it >= ITERS + 1:
            d[0] = 5
        g = gen(rank, (d[rank], 2), torch.int32, ("ss.g", it))
        ref_g = torch.cat([gen(r, (d[r], 2), torch.int32, ("ss.g", it)) for r in range(size)])
        hg = hvd.allgather_async(g, name="ss.g")
        # broadcast whose root rotates (a changed root is a changed parameter)
        root = (it // 5) % size
        b = gen(rank, (6,), torch.float64, ("ss.b", it))
        ref_b = gen(root, (6,), torch.float64, ("ss.b", it))
        hb = hvd.broadcast_async(b, root, name="ss.b")
        # reducescatter with dim0 not divisible by size; its shape changes at ITERS
        rows = 2 * size + 1 if it < ITERS else 3 * size + 2
        s = gen(rank, (rows, 2), torch.float32, ("ss.s", it))
        ref_s = my_rows(reduce_ref(all_inputs(size, (rows, 2), torch.float32, ("ss.s", it)),
                                   hvd.Sum), size, rank)
        hs = hvd.reducescatter_async(s, name="ss.s", op=hvd.Sum)
        # grouped allreduce (fp16) and a prescaled allreduce whose factor changes at ITERS+2
        gr = [gen(rank, (5,), torch.float16, ("ss.gr", it, k)) for k in range(3)]
        ref_gr = [reduce_ref(all_inputs(size, (5,), torch.float16, ("ss.gr", it, k)), hvd.Sum)
                  for k in range(3)]
        hgr = hvd.grouped_allreduce_async(gr, name="ss.gr", op=hvd.Sum)
        pre = 1.0 if it < ITERS + 2 else 0.5
        p = gen(rank, (4,), torch.float32, ("ss.p", it))
        ref_p = reduce_ref(all_inputs(size, (4,), torch.float32, ("ss.p", it)), hvd.Sum, pre)
        hp = hvd.allreduce_async(p, name="ss.p", op=hvd.Sum, prescale_factor=pre)

        hvd.synchronize(handles[0][1])
        same(a, ref_a, f"steady allreduce_ iteration {it}")
        same(hvd.synchronize(hg), ref_g, f"steady allgather iteration {it}")
        same(hvd.synchronize(hb), ref_b, f"steady broadcast iteration {it}")
        same(hvd.synchronize(hs), ref_s, f"steady reducescatter iteration {it}")
        for k, (y, r) in enumerate(zip(hvd.synchronize(hgr), ref_gr)):
            same(y, r, f"steady grouped allreduce [{k}] iteration {it}")
        same(hvd.synchronize(hp), ref_p, f"steady prescaled allreduce iteration {it}")


def many_async_mixed_ops(iters: int = 3):
    """Allgathers (per-rank first dims), broadcasts (several roots), reducescatters, alltoalls
    and grouped allreduces of several dtypes, all in flight together, submitted in a
    rank-dependent order, repeated with the same names."""
    for it in range(iters):
        jobs = []   # (name, submit, reference)
        for k in range(30):
            dtype = [torch.int32, torch.float16, torch.uint8][k % 3]
            dims = [(r + k) % 4 + 1 for r in range(size)]
            salt = ("mix.ag", k, it)
            x = gen(rank, (dims[rank], 2), dtype, salt)
            ref = torch.cat([gen(r, (dims[r], 2), dtype, salt) for r in range(size)])
            jobs.append((f"mix.ag.{k}", lambda x=x, k=k: hvd.allgather_async(
                x, name=f"mix.ag.{k}"), ref))
        for k in range(30):
            dtype = [torch.bool, torch.float32, torch.int8][k % 3]
            root = k % size
            salt = ("mix.bc", k, it)
            x = gen(rank, (k % 7 + 1,), dtype, salt)
            jobs.append((f"mix.bc.{k}", lambda x=x, k=k, root=root: hvd.broadcast_async(
                x, root, name=f"mix.bc.{k}"), gen(root, (k % 7 + 1,), dtype, salt)))
        for k in range(20):
            dtype = [torch.float32, torch.float64][k % 2]
            rows = k % (2 * size) + 1
            salt = ("mix.rs", k, it)
            x = gen(rank, (rows, 3), dtype, salt)
            ref = my_rows(reduce_ref(all_inputs(size, (rows, 3), dtype, salt), hvd.Sum), size,
                          rank)
            jobs.append((f"mix.rs.{k}", lambda x=x, k=k: hvd.reducescatter_async(
                x, name=f"mix.rs.{k}", op=hvd.Sum), ref))
        for k in range(5):
            salt = ("mix.a2a", k, it)
            x = gen(rank, (2 * size, k + 1), torch.float32, salt)
            ref = torch.cat([gen(r, (2 * size, k + 1), torch.float32, salt)[2 * rank:2 * rank + 2]
                             for r in range(size)])
            jobs.append((f"mix.a2a.{k}", lambda x=x, k=k: hvd.alltoall_async(
                x, name=f"mix.a2a.{k}"), ref))
        for k in range(5):
            salt = ("mix.gar", k, it)
            xs = [gen(rank, (j + 1,), torch.float16, (salt, j)) for j in range(4)]
            refs = [reduce_ref(all_inputs(size, (j + 1,), torch.float16, (salt, j)), hvd.Average)
                    for j in range(4)]
            jobs.append((f"mix.gar.{k}", lambda xs=xs, k=k: hvd.grouped_allreduce_async(
                xs, name=f"mix.gar.{k}"), refs))
        order = jobs[::-1] if rank % 2 else jobs[::2] + jobs[1::2]
        handles = {name: submit() for name, submit, _ in order}
        for name, _, ref in jobs:
            out = hvd.synchronize(handles[name])
            if name.startswith("mix.a2a"):
                out = out[0]
            if isinstance(ref, list):
                for j, (o, r) in enumerate(zip(out, ref)):
                    same(o, r, f"iteration {it} {name}[{j}]")
            else:
                same(out, ref, f"iteration {it} {name}")


def sync_loop_same_names():
    # Synchronous calls in a loop (the common training pattern) with a shape change at the end.
    for it in range(30):
        shape = (10,) if it < 25 else (11,)
        x = gen(rank, shape, torch.float32, ("loop", it))
        y = hvd.allreduce(x, name="loop.grad", op=hvd.Sum)
        same(y, reduce_ref(all_inputs(size, shape, torch.float32, ("loop", it)), hvd.Sum),
             f"loop iteration {it}")


def big_and_small_members(iters: int = 6):
    """Fused allreduces whose members straddle the MPI transport's in-place size (64 KiB): MPI
    reduces the big members in place, one call each, and the small ones through the fusion
    buffer (collectives.Executor._allreduce_in_place); other transports fuse them all. Every
    kind of member a response can hold: in place and out of place, Average and Sum with pre-
    and postscale, float16 (widened by MPI), int32 Average (truncated), float64, and a grouped
    call of big and small members. Exact results every iteration, the steady state's included.
    Several big members of one response are chained inside MPI's transport as one piece of
    work (backends/mpi._Sequence).
    """
    specs = [  # name, shape, dtype, op, prescale, postscale, in place
        ("b32", (20000,), torch.float32, hvd.Sum, 1.0, 1.0, True),
        ("s32", (7, 3), torch.float32, hvd.Average, 1.0, 1.0, True),
        ("b16", (200, 200), torch.float16, hvd.Sum, 1.0, 1.0, False),
        ("bavg", (300, 100), torch.float32, hvd.Average, 0.5, 3.0, False),
        ("s64", (33,), torch.float64, hvd.Sum, 2.0, 1.0, True),
        ("bint", (40000,), torch.int32, hvd.Average, 1.0, 1.0, True),
        ("b64", (9000,), torch.float64, hvd.Max, 1.0, 1.0, False),
    ]
    for it in range(iters):
        handles = []
        for name, shape, dtype, op, pre, post, inplace in specs:
            x = gen(rank, shape, dtype, ("bs", name, it))
            ref = reduce_ref(all_inputs(size, shape, dtype, ("bs", name, it)), op, pre, post)
            submit = hvd.allreduce_async_ if inplace else hvd.allreduce_async
            h = submit(x, name=f"bs.{name}", op=op, prescale_factor=pre,
                       postscale_factor=post)
            handles.append((name, h, x if inplace else None, ref))
        shapes = [(17000,), (5,), (130, 130)]
        xs = [gen(rank, s, torch.float32, ("bs.g", k, it)) for k, s in enumerate(shapes)]
        refs = [reduce_ref(all_inputs(size, s, torch.float32, ("bs.g", k, it)), hvd.Average)
                for k, s in enumerate(shapes)]
        hg = hvd.grouped_allreduce_async(xs, name="bs.group")
        for name, h, x, ref in handles:
            y = hvd.synchronize(h)
            same(x if x is not None else y, ref, f"iteration {it} {name}")
        for k, (y, ref) in enumerate(zip(hvd.synchronize(hg), refs)):
            same(y, ref, f"iteration {it} grouped [{k}]")
    if hvd.mpi_enabled() and basics.engine_counters()["in_place_members"] == 0:
        raise AssertionError("no fused member was reduced in place on MPI")
    # Responses with several big members (bs.group's two, and the async calls' when fused)
    # chain them inside the transport (backends/mpi._Sequence).
    if hvd.mpi_enabled() and basics.engine_counters()["in_place_sequences"] == 0:
        raise AssertionError("no fused response chained its in-place members on MPI")


def fused_through_the_channel(iters: int = 6):
    """On MPI with ranks that spin, a fused allreduce of two tensors or more and of at least
    backends/mpi.FUSED_MIN_BYTES goes through hvdlite's shared-memory channel (a single tensor
    of that size stays with MPI): a grouped call and a step of async calls, Sum and Average
    with pre- and postscale, float16 among them, exact every iteration. Rank 1 passes one
    output that is not contiguous (a transposed view): it is staged, so both ranks still take
    the channel (routed apart, they would wait on two transports), and the result lands in
    the view."""
    from hvdlite.common import ops
    from hvdlite.common.backends import mpi as mpi_backend
    channel_before = basics.engine_counters()["shm_collectives"]
    shapes = [(64, 300), (20000,), (5,), (300, 64), (9000,)]
    for it in range(iters):
        xs = [gen(rank, s, torch.float32, ("ch", k, it)) for k, s in enumerate(shapes)]
        refs = [reduce_ref(all_inputs(size, s, torch.float32, ("ch", k, it)), hvd.Average)
                for k, s in enumerate(shapes)]
        # (Through the op layer: the torch frontend's in-place calls refuse a tensor that is
        # not contiguous, but an optimizer's channels_last gradient reaches here as one.)
        outs = [torch.empty(s) for s in shapes]
        if rank == 1:
            outs[3] = torch.empty(tuple(reversed(shapes[3]))).t()
        ops.allreduce(xs, names="ch.group", group=True, outputs=outs).wait()
        for k, (x, ref) in enumerate(zip(outs, refs)):
            same(x, ref, f"iteration {it} grouped [{k}]")
        specs = [((40000,), torch.float32, hvd.Sum, 0.5, 4.0), ((30000,), torch.float16,
                                                                  hvd.Sum, 1.0, 1.0),
                 ((7, 3), torch.float32, hvd.Average, 1.0, 1.0)]
        handles = []
        for k, (shape, dtype, op, pre, post) in enumerate(specs):
            x = gen(rank, shape, dtype, ("cha", k, it))
            ref = reduce_ref(all_inputs(size, shape, dtype, ("cha", k, it)), op, pre, post)
            handles.append((k, hvd.allreduce_async_(x, name=f"cha.{k}", op=op,
                                                    prescale_factor=pre,
                                                    postscale_factor=post), x, ref))
        for k, h, x, ref in handles:
            hvd.synchronize(h)
            same(x, ref, f"iteration {it} async [{k}]")
    used = basics.engine_counters()["shm_collectives"] - channel_before
    comm = basics.engine().comms[(0, "cpu")]
    if getattr(comm, "shm_fused_min_bytes", 0) != mpi_backend.FUSED_MIN_BYTES:
        raise AssertionError(f"the fused route's threshold is {comm.shm_fused_min_bytes}")
    if used < iters:
        raise AssertionError(f"only {used} collectives of {iters} grouped calls took the channel")


def lone_output_not_contiguous(iters: int = 6):
    """A lone allreduce through the op layer into an output that is not contiguous (a
    transposed view, as an optimizer's channels_last gradient arrives) on rank 1 only, and on
    both ranks: small (a steady round may carry it), 75 KiB and 2 MiB, Sum and Average, named
    and not, asynchronous and blocking (ops.allreduce_now: the express lane), exact every
    iteration, into the view. Before, rank 1's view went another way than rank 0's output:
    through shared memory both ranks waited until the transport's timeout, and over gloo's TCP
    and MPI both got a wrong sum."""
    from hvdlite.common import ops
    shapes = [(3, 4), (64, 300), (512, 1024)]
    for it in range(iters):
        for k, shape in enumerate(shapes):
            for who in ("rank 1", "both"):
                for how, op in (("async", hvd.Sum), ("blocking", hvd.Average),
                                ("unnamed", hvd.Sum)):
                    salt = ("lo", k, who, how, it)
                    x = gen(rank, shape, torch.float32, salt)
                    ref = reduce_ref(all_inputs(size, shape, torch.float32, salt), op)
                    view = rank == 1 or who == "both"
                    out = torch.empty(tuple(reversed(shape))).t() if view else torch.empty(shape)
                    name = f"lo.{k}.{who}.{how}"
                    if how == "blocking":
                        ops.allreduce_now(x, out, name=name, op=op)
                    else:
                        ops.allreduce([x], names=None if how == "unnamed" else name, op=op,
                                      outputs=[out]).wait()
                    same(out, ref, f"iteration {it} {shape} {who} {how}")


# Run only when named: MPI's route (test_mpi.py), meaningless on other transports.
ON_REQUEST = {"fused_through_the_channel": fused_through_the_channel}
CHECKS = {
    "big_and_small_members": big_and_small_members,
    "many_async_allreduces": lambda: many_async_allreduces(ITERS + 2, False),
    "many_async_allreduces_mixed_order": lambda: many_async_allreduces(3, True),
    "steady_state_all_ops": steady_state,
    "many_async_mixed_ops": many_async_mixed_ops,
    "sync_loop_shape_change": sync_loop_same_names,
    "lone_output_not_contiguous": lone_output_not_contiguous,
}
for name in (sys.argv[1:] or CHECKS):
    check(name, {**CHECKS, **ON_REQUEST}[name])
finish()
hvd.shutdown()
