"""hvd.join() with uneven inputs: joined ranks contribute zeros to allreduce; other collectives
with a joined rank fail on every rank that submitted them; join returns the last joined rank."""
from __future__ import annotations

import torch

import hvdlite.torch as hvd
from ops_common import check, expect_raises, finish, gen, reduce_ref, same

hvd.init()
rank, size = hvd.rank(), hvd.size()


def steps_of(r: int) -> int:
    return 3 + r


def uneven_allreduce():
    """Rank r runs 3 + r steps (named tensors, so later steps take the cache path), then joins."""
    for step in range(steps_of(rank)):
        active = [r for r in range(size) if steps_of(r) > step]
        zeros = {r for r in range(size) if r not in active}

        def inputs(shape, dtype, salt):
            return [gen(r, shape, dtype, salt) * (0 if r in zeros else 1) for r in range(size)]

        a = gen(rank, (4, 3), torch.float32, ("join.a", step))
        b = gen(rank, (5,), torch.int32, ("join.b", step))
        c = gen(rank, (), torch.float64, ("join.c", step))
        ha = hvd.allreduce_async(a, name="join.a", op=hvd.Average)
        hb = hvd.allreduce_async(b, name="join.b", op=hvd.Sum)
        yc = hvd.allreduce(c, op=hvd.Sum, name="join.c", postscale_factor=2.0)
        # A member of 80 KB: on MPI, reduced in place in the fused response (the joined
        # rank's zeros included).
        big = gen(rank, (20000,), torch.float32, ("join.big", step))
        gs = hvd.grouped_allreduce([a, b.to(torch.float32), big], name="join.g", op=hvd.Sum)
        # Average still divides by the full size: joined ranks count as zeros.
        same(hvd.synchronize(ha),
             reduce_ref(inputs((4, 3), torch.float32, ("join.a", step)), hvd.Average),
             f"step {step} Average with joined ranks {sorted(zeros)}")
        same(hvd.synchronize(hb), reduce_ref(inputs((5,), torch.int32, ("join.b", step)),
                                             hvd.Sum), f"step {step} int32 Sum")
        same(yc, reduce_ref(inputs((), torch.float64, ("join.c", step)), hvd.Sum, 1.0, 2.0),
             f"step {step} 0-d postscaled Sum")
        same(gs[0], reduce_ref(inputs((4, 3), torch.float32, ("join.a", step)), hvd.Sum),
             f"step {step} grouped [0]")
        same(gs[1], reduce_ref([t.to(torch.float32) for t in
                                inputs((5,), torch.int32, ("join.b", step))], hvd.Sum),
             f"step {step} grouped [1]")
        same(gs[2], reduce_ref(inputs((20000,), torch.float32, ("join.big", step)), hvd.Sum),
             f"step {step} grouped [2], 80 KB")
    last = hvd.join()
    assert last == size - 1, f"join() returned {last}, expected the last joined rank {size - 1}"
    # After everyone joined, collectives are back to normal.
    x = gen(rank, (6,), torch.float32, "after.join")
    same(hvd.allreduce(x, name="join.a.after", op=hvd.Sum),
         reduce_ref([gen(r, (6,), torch.float32, "after.join") for r in range(size)], hvd.Sum),
         "allreduce after join")


def other_collectives_after_join():
    """Rank 0 joins at once; the others' allgather/broadcast/alltoall/reducescatter fail on
    every rank that submitted them; allreduce still works; then everybody joins."""
    if rank == 0:
        last = hvd.join()
    else:
        x = torch.ones(2, 3) * rank
        for what, fn in [
            ("allgather", lambda: hvd.allgather(x, name="j.ag")),
            ("broadcast", lambda: hvd.broadcast(x, 1, name="j.bc")),
            ("alltoall", lambda: hvd.alltoall(torch.ones(2 * size) * rank, name="j.a2a")),
            ("reducescatter", lambda: hvd.reducescatter(torch.ones(2 * size), name="j.rs")),
            ("grouped_allgather", lambda: hvd.grouped_allgather([x, x], name="j.gag")),
        ]:
            expect_raises((hvd.HorovodInternalError, ValueError), fn,
                          f"{what} while rank 0 has joined")
        y = hvd.allreduce(torch.ones(3) * rank, op=hvd.Sum, name="j.ar")
        same(y, torch.full((3,), float(sum(range(size)))), "allreduce while rank 0 has joined")
        last = hvd.join()
    assert 1 <= last < size if size > 1 else last == 0, f"join returned {last}"
    # Every rank saw the same last joined rank.
    lasts = hvd.allgather(torch.tensor([last]), name="j.last")
    assert len(set(lasts.tolist())) == 1, f"ranks disagree on the last joined rank: {lasts}"


def join_twice():
    """Everybody joins at once (no data at all), twice in a row."""
    for _ in range(2):
        last = hvd.join()
        assert 0 <= last < size
    hvd.barrier()


check("uneven_allreduce_join", uneven_allreduce)
check("other_collectives_after_join", other_collectives_after_join)
check("join_twice", join_twice)
finish()
hvd.shutdown()
