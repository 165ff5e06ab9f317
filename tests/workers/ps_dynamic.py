"""Dynamic process sets: hvd.init(process_sets="dynamic"), add_process_set/remove_process_set
(collectives: every rank calls them in the same order), on 4 ranks."""
from __future__ import annotations

import torch

import hvdlite.torch as hvd
from ops_common import check, expect_raises, finish, gen, my_rows, reduce_ref, same

hvd.init(process_sets="dynamic")
rank, size = hvd.rank(), hvd.size()
assert size == 4, "ps_dynamic.py needs 4 ranks"
Error = (ValueError, RuntimeError, hvd.HorovodInternalError)
SETS: dict = {}


def exercise(ps, members, tag):
    """A few collectives on `ps` by its members, checked against local references."""
    if rank not in members:
        expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=ps),
                      f"allreduce on {tag} from non-member {rank}")
        return
    me, n = members.index(rank), len(members)
    x = gen(rank, (3, 2), torch.float32, (tag, "ar"))
    same(hvd.allreduce(x, op=hvd.Sum, process_set=ps, name=f"{tag}.ar"),
         reduce_ref([gen(r, (3, 2), torch.float32, (tag, "ar")) for r in members], hvd.Sum),
         f"allreduce on {tag}")
    same(hvd.allreduce(torch.full((2,), float(rank * n)), process_set=ps, name=f"{tag}.avg"),
         torch.full((2,), float(sum(members))), f"Average divides by the set size on {tag}")
    x = gen(rank, (rank + 1,), torch.int16, (tag, "ag"))
    same(hvd.allgather(x, process_set=ps, name=f"{tag}.ag"),
         torch.cat([gen(r, (r + 1,), torch.int16, (tag, "ag")) for r in members]),
         f"allgather on {tag}")
    root = members[-1]
    x = gen(rank, (4,), torch.float64, (tag, "bc"))
    same(hvd.broadcast(x, root_rank=root, process_set=ps, name=f"{tag}.bc"),
         gen(root, (4,), torch.float64, (tag, "bc")), f"broadcast on {tag} from global {root}")
    x = gen(rank, (2 * n + 1, 2), torch.int32, (tag, "rs"))
    full = reduce_ref([gen(r, (2 * n + 1, 2), torch.int32, (tag, "rs")) for r in members],
                      hvd.Sum)
    same(hvd.reducescatter(x, op=hvd.Sum, process_set=ps, name=f"{tag}.rs"),
         my_rows(full, n, me), f"reducescatter on {tag}")
    x = gen(rank, (2 * n,), torch.float32, (tag, "a2a"))
    same(hvd.alltoall(x, process_set=ps, name=f"{tag}.a2a"),
         torch.cat([gen(r, (2 * n,), torch.float32, (tag, "a2a"))[2 * me:2 * me + 2]
                    for r in members]), f"alltoall on {tag}")
    hvd.barrier(process_set=ps)


def add_and_use():
    SETS["even"] = hvd.add_process_set([0, 2])
    SETS["odd"] = hvd.add_process_set(hvd.ProcessSet([1, 3]))
    SETS["upper"] = hvd.add_process_set([1, 2, 3])
    assert isinstance(SETS["even"], hvd.ProcessSet)
    ids = [SETS[n].process_set_id for n in ("even", "odd", "upper")]
    assert None not in ids and 0 not in ids and len(set(ids)) == 3, ids
    got = hvd.allgather(torch.tensor([ids]), name="dyn.ids")
    assert all(torch.equal(got[0], got[r]) for r in range(size)), f"set ids differ: {got}"
    for n, members in [("even", [0, 2]), ("odd", [1, 3]), ("upper", [1, 2, 3])]:
        ps = SETS[n]
        assert ps.size() == len(members) and ps.included() == (rank in members)
        if rank in members:
            assert ps.rank() == members.index(rank)
        else:                                  # Horovod: "Process is not part of ..."
            expect_raises(ValueError, ps.rank, f"{n}.rank() on a rank outside it")
        exercise(ps, members, f"dyn.{n}")


def overlapping_async():
    # even/odd/upper/global in flight at once, in a rank-dependent order.
    work = []
    for n, members in [("global", list(range(size))), ("even", [0, 2]), ("odd", [1, 3]),
                       ("upper", [1, 2, 3])]:
        if rank not in members:
            continue
        ps = hvd.global_process_set if n == "global" else SETS[n]
        for k in range(4):
            salt = ("dyn.ov", n, k)
            x = gen(rank, (k + 2,), torch.float32, salt)
            ref = reduce_ref([gen(r, (k + 2,), torch.float32, salt) for r in members], hvd.Sum)
            work.append((f"dyn.ov.{n}.{k}", x, ps, ref))
    handles = {nm: hvd.allreduce_async(x, op=hvd.Sum, name=nm, process_set=ps)
               for nm, x, ps, _ in (work[::-1] if rank % 2 else work)}
    for nm, _, _, ref in work:
        same(hvd.synchronize(handles[nm]), ref, nm)


def errors():
    # A set with the same ranks as an existing one.
    expect_raises(ValueError, lambda: hvd.add_process_set([0, 2]), "duplicate add_process_set")
    # Ranks outside the job.
    expect_raises(ValueError, lambda: hvd.add_process_set([0, 99]),
                  "add_process_set with a rank outside the job")
    # An already registered ProcessSet object.
    expect_raises(ValueError, lambda: hvd.add_process_set(SETS["even"]),
                  "add_process_set of a registered ProcessSet")
    # Repeated ranks in one set.
    expect_raises(ValueError, lambda: hvd.ProcessSet([1, 1, 2]), "ProcessSet with repeated ranks")
    # The global set is never removed: False, as in Horovod (and no collective runs).
    assert hvd.remove_process_set(hvd.global_process_set) is False
    assert hvd.global_process_set.process_set_id == 0 and hvd.global_process_set.size() == size
    # Everything still works.
    exercise(SETS["even"], [0, 2], "dyn.even.after")


def remove_and_readd():
    old = SETS["even"]
    assert hvd.remove_process_set(old) is True
    assert old.process_set_id is None
    expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(2), process_set=old),
                  "allreduce on a removed process set")
    # Removing it again is a no-op that says so (Horovod returns False).
    assert hvd.remove_process_set(old) is False
    # The other sets are untouched.
    exercise(SETS["odd"], [1, 3], "dyn.odd.after.remove")
    # Re-add the same ranks: a new registration that works.
    SETS["even"] = again = hvd.add_process_set([0, 2])
    assert again.process_set_id is not None
    exercise(again, [0, 2], "dyn.even.readded")
    # Remove and re-add several times, with ops in between (same names each time).
    for i in range(3):
        assert hvd.remove_process_set(SETS["upper"])
        SETS["upper"] = hvd.add_process_set([1, 2, 3])
        exercise(SETS["upper"], [1, 2, 3], "dyn.upper.cycle")


def reinit_dynamic():
    # shutdown() forgets every set; init again in dynamic mode and add sets again.
    hvd.shutdown()
    assert SETS["odd"].process_set_id is None
    hvd.init(process_sets="dynamic")
    ps = hvd.add_process_set([0, 1, 3])
    exercise(ps, [0, 1, 3], "dyn.reinit")
    assert hvd.remove_process_set(ps)


check("add_and_use", add_and_use)
check("overlapping_async", overlapping_async)
check("errors", errors)
check("remove_and_readd", remove_and_readd)
check("reinit_dynamic", reinit_dynamic)
finish()
hvd.shutdown()
