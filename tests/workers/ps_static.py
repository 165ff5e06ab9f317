"""Static process sets: hvd.init(process_sets=[...]) on 4 ranks.

Ranks belong to different numbers of sets, so every collective that a rank runs once per set
it belongs to is named: unnamed ones are matched by call site and call count, which differ
between ranks here (Horovod matches unnamed ones by a handle counter, which differs too).

Sets: even [0, 2], odd [1, 3], upper [1, 2, 3] (no rank 0), pair [0, 1]. Broadcast roots are
GLOBAL ranks (Horovod semantics); Average divides by the set size.
"""
from __future__ import annotations

import itertools

import torch

import hvdlite.torch as hvd
from ops_common import (ALL_DTYPES, REDUCE_OPS, check, close, expect_raises, finish, gen,
                        my_rows, reduce_ref, same)

even, odd = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 3])
upper, pair = hvd.ProcessSet([3, 1, 2]), hvd.ProcessSet([0, 1])
hvd.init(process_sets=[even, odd, upper, pair])
rank, size = hvd.rank(), hvd.size()
assert size == 4, "ps_static.py needs 4 ranks"
SETS = {"even": even, "odd": odd, "upper": upper, "pair": pair}
MEMBERS = {"even": [0, 2], "odd": [1, 3], "upper": [1, 2, 3], "pair": [0, 1]}
Error = (ValueError, RuntimeError, hvd.HorovodInternalError)


def mine():
    return [n for n, m in MEMBERS.items() if rank in m]


def registration():
    ids = {n: ps.process_set_id for n, ps in SETS.items()}
    assert None not in ids.values() and 0 not in ids.values(), ids
    assert len(set(ids.values())) == 4, ids
    # The same ids on every rank.
    got = hvd.allgather(torch.tensor([ids[n] for n in SETS]).unsqueeze(0), name="ps.ids")
    assert all(torch.equal(got[0], got[r]) for r in range(size)), got
    for n, ps in SETS.items():
        members = MEMBERS[n]
        assert ps.ranks == members, (n, ps.ranks)
        assert ps.size() == len(members), (n, ps.size())
        assert ps.included() == (rank in members)
        if rank in members:
            assert ps.rank() == members.index(rank), (n, ps.rank())
        else:                                  # Horovod: "Process is not part of ..."
            expect_raises(ValueError, ps.rank, f"{n}.rank() on a rank outside it",
                          match="Process is not part of provided process set")
    assert hvd.global_process_set.process_set_id == 0


def set_allreduce(opnames):
    for name in mine():
        ps, members = SETS[name], MEMBERS[name]
        for dtype, opname in itertools.product(ALL_DTYPES, opnames):
            op = REDUCE_OPS[opname]
            lo, hi = (-2, 2) if op == hvd.Product else (-4, 4)
            salt = (name, str(dtype), opname)
            x = gen(rank, (3, 2), dtype, salt, lo, hi)
            post = 3.0
            ref = reduce_ref([gen(r, (3, 2), dtype, salt, lo, hi) for r in members], op,
                             1.0, post)
            y = hvd.allreduce(x, op=op, postscale_factor=post, process_set=ps,
                              name=f"ps.ar.{name}.{dtype}.{opname}")
            same(y, ref, f"allreduce on {name} {dtype} {opname}")


def set_collectives():
    for name in mine():
        ps, members = SETS[name], MEMBERS[name]
        me = members.index(rank)
        n = len(members)
        # grouped allreduce, in place
        xs = [gen(rank, (5,), torch.float32, (name, "g", i)) for i in range(3)]
        hvd.grouped_allreduce_(xs, op=hvd.Average, process_set=ps, name=f"ps.gar.{name}")
        for i, x in enumerate(xs):
            # (a 3-rank Average is not exact in float32: compare closely)
            close(x, reduce_ref([gen(r, (5,), torch.float32, (name, "g", i)) for r in members],
                                hvd.Average), f"grouped_allreduce_ on {name} [{i}]")
        # allgather with per-rank first dims
        x = gen(rank, (rank + 1, 2), torch.int64, (name, "ag"))
        same(hvd.allgather(x, process_set=ps, name=f"ps.ag.{name}"),
             torch.cat([gen(r, (r + 1, 2), torch.int64, (name, "ag")) for r in members]),
             f"allgather on {name}")
        # broadcast from every member, by GLOBAL rank
        for root in members:
            x = gen(rank, (4,), torch.float64, (name, "bc", root))
            same(hvd.broadcast(x, root_rank=root, process_set=ps, name=f"ps.bc.{name}.{root}"),
                 gen(root, (4,), torch.float64, (name, "bc", root)),
                 f"broadcast on {name} from global rank {root}")
            x2 = x.clone()
            hvd.broadcast_(x2, root, process_set=ps, name=f"ps.bc_.{name}.{root}")
            same(x2, gen(root, (4,), torch.float64, (name, "bc", root)),
                 f"broadcast_ on {name} from global rank {root}")
        # alltoall with splits over the set's ranks
        splits = {r: [(members.index(r) + j) % 2 + 1 for j in range(n)] for r in members}
        inputs = {r: gen(r, (sum(splits[r]), 3), torch.float32, (name, "a2a")) for r in members}
        out, recv = hvd.alltoall(inputs[rank], splits=splits[rank], process_set=ps,
                                 name=f"ps.a2a.{name}")
        pieces = []
        for r in members:
            off = sum(splits[r][:me])
            pieces.append(inputs[r][off:off + splits[r][me]])
        same(out, torch.cat(pieces), f"alltoall on {name}")
        same(recv, torch.tensor([splits[r][me] for r in members], dtype=torch.int32),
             f"alltoall received splits on {name}")
        # reducescatter with dim0 not divisible by the set size
        rows = 2 * n + 1
        x = gen(rank, (rows, 2), torch.float32, (name, "rs"))
        full = reduce_ref([gen(r, (rows, 2), torch.float32, (name, "rs")) for r in members],
                          hvd.Average)
        close(hvd.reducescatter(x, op=hvd.Average, process_set=ps, name=f"ps.rs.{name}"),
             my_rows(full, n, me),
             f"reducescatter on {name}")
        hvd.barrier(process_set=ps)


def overlapping_async():
    """Async ops on the global set and on every set this rank is in, submitted in a
    rank-dependent order, all in flight together; repeated so later rounds use the cache."""
    for it in range(6):
        work = []
        for name in ["global"] + mine():
            ps = hvd.global_process_set if name == "global" else SETS[name]
            members = list(range(size)) if name == "global" else MEMBERS[name]
            for k in range(3):
                salt = (name, "ov", it, k)
                x = gen(rank, (6, k + 1), torch.float32, salt)
                ref = reduce_ref([gen(r, (6, k + 1), torch.float32, salt) for r in members],
                                 hvd.Sum)
                work.append((f"ov.{name}.{k}", x, ps, ref))
            root = members[it % len(members)]
            x = gen(rank, (3,), torch.int32, (name, "ovb", it))
            work.append((f"ovb.{name}", x, ps, gen(root, (3,), torch.int32, (name, "ovb", it)),
                         root))
        order = work[::-1] if rank % 2 else work
        handles = {}
        for item in order:
            if len(item) == 5:
                nm, x, ps, _, root = item
                handles[nm] = hvd.broadcast_async(x, root, name=nm, process_set=ps)
            else:
                nm, x, ps, _ = item
                handles[nm] = hvd.allreduce_async(x, name=nm, op=hvd.Sum, process_set=ps)
        for item in work:
            same(hvd.synchronize(handles[item[0]]), item[3], f"iteration {it} {item[0]}")


def set_grads():
    # Gradients within a set: broadcast (root is a global rank) and allreduce. The backward
    # passes run unnamed collectives, so every rank uses exactly one set here (even or odd).
    for name in [n for n in mine() if n in ("even", "odd")]:
        ps, members = SETS[name], MEMBERS[name]
        root = members[-1]
        x = gen(rank, (3,), torch.float64, (name, "gx")).requires_grad_()
        y = hvd.broadcast(x, root, process_set=ps, name=f"ps.gbc.{name}")
        y.backward(gen(rank, (3,), torch.float64, (name, "gG")))
        ref = reduce_ref([gen(r, (3,), torch.float64, (name, "gG")) for r in members],
                         hvd.Average)
        same(x.grad, ref if rank == root else torch.zeros(3, dtype=torch.float64),
             f"broadcast grad on {name} root {root}")
        x = gen(rank, (3,), torch.float64, (name, "gx2")).requires_grad_()
        hvd.allreduce(x, op=hvd.Sum, process_set=ps, name=f"ps.gar2.{name}").backward(
            gen(rank, (3,), torch.float64, (name, "gG2")))
        same(x.grad, reduce_ref([gen(r, (3,), torch.float64, (name, "gG2")) for r in members],
                                hvd.Sum), f"allreduce grad on {name}")


def errors():
    # A set this rank is not in: ValueError, raised locally at once.
    for name, members in MEMBERS.items():
        if rank not in members:
            expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(2), process_set=SETS[name]),
                          f"allreduce on {name} from non-member rank {rank}")
            expect_raises(ValueError, lambda: hvd.allgather(torch.ones(2),
                                                            process_set=SETS[name]),
                          f"allgather on {name} from non-member rank {rank}")
            expect_raises(ValueError, lambda: hvd.barrier(process_set=SETS[name]),
                          f"barrier on {name} from non-member rank {rank}")
    # Broadcast from a global root outside the set: an error on every member.
    if rank in MEMBERS["odd"]:
        expect_raises(Error, lambda: hvd.broadcast(torch.ones(2), root_rank=0, process_set=odd,
                                                   name="ps.bad.root"),
                      "broadcast on odd from global rank 0 (not a member)")
    # Not in dynamic mode: add_process_set is refused.
    expect_raises(ValueError, lambda: hvd.add_process_set([0, 3]),
                  "add_process_set without dynamic process sets")
    expect_raises(ValueError, lambda: hvd.add_process_set(hvd.ProcessSet([1, 2])),
                  "add_process_set(ProcessSet) without dynamic process sets")
    # An unregistered set object.
    expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(2),
                                                    process_set=hvd.ProcessSet([0, 1, 2])),
                  "allreduce on an unregistered process set")
    # The job still works on every set.
    same(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="ps.after"), torch.full((2,), 4.0),
         "global allreduce after errors")
    for name in mine():
        same(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=SETS[name],
                           name=f"ps.after.{name}"),
             torch.full((2,), float(len(MEMBERS[name]))), f"allreduce on {name} after errors")


check("registration", registration)
check("set_allreduce", set_allreduce, ["Average", "Sum", "Min", "Product"])
check("set_allreduce_Max", set_allreduce, ["Max"])
check("set_collectives", set_collectives)
check("overlapping_async", overlapping_async)
check("set_grads", set_grads)
check("errors", errors)
finish()
hvd.shutdown()
