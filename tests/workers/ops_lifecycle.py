"""Before init, shutdown, and init again: collectives work in every cycle."""
from __future__ import annotations

import torch

import hvdlite.torch as hvd
from ops_common import (all_inputs, check, expect_raises, finish, gen, reduce_ref, same,
                        wait_until)

NOT_INIT = "Horovod has not been initialized; use hvd.init()."


def before_init():
    assert not hvd.is_initialized()
    x = torch.ones(3)
    for what, fn in [("allreduce", lambda: hvd.allreduce(x)),
                     ("allreduce_async", lambda: hvd.allreduce_async(x)),
                     ("allgather", lambda: hvd.allgather(x)),
                     ("broadcast", lambda: hvd.broadcast(x, 0)),
                     ("alltoall", lambda: hvd.alltoall(x)),
                     ("reducescatter", lambda: hvd.reducescatter(x)),
                     ("grouped_allreduce", lambda: hvd.grouped_allreduce([x])),
                     ("barrier", lambda: hvd.barrier()),
                     ("join", lambda: hvd.join()),
                     ("rank", lambda: hvd.rank()),
                     ("size", lambda: hvd.size())]:
        exc = expect_raises(ValueError, fn, f"{what} before init()")
        if exc is not None and str(exc) != NOT_INIT:
            raise AssertionError(f"{what} before init(): message {str(exc)!r}, "
                                 f"expected {NOT_INIT!r}")
        # Horovod: a collective's enqueue fails with HorovodInternalError; rank() and size()
        # raise a plain ValueError.
        internal = isinstance(exc, hvd.HorovodInternalError)
        if internal != (what not in ("rank", "size")):
            raise AssertionError(f"{what} before init(): {type(exc).__mro__}")


def cycles():
    for cycle in range(3):
        hvd.init()
        hvd.init()   # a second init() is harmless
        assert hvd.is_initialized()
        rank, size = hvd.rank(), hvd.size()
        # Named (cached) and unnamed collectives, the same names in every cycle.
        for step in range(3):
            x = gen(rank, (4, 2), torch.float32, ("cycle", cycle, step))
            ref = reduce_ref(all_inputs(size, (4, 2), torch.float32, ("cycle", cycle, step)),
                             hvd.Sum)
            same(hvd.allreduce(x, name="cycle.grad", op=hvd.Sum), ref,
                 f"cycle {cycle} named allreduce")
            same(hvd.allreduce(x, op=hvd.Sum), ref, f"cycle {cycle} unnamed allreduce")
        h = hvd.allreduce_async(torch.ones(3) * rank, name="cycle.async", op=hvd.Sum)
        g = hvd.allgather(torch.tensor([rank, cycle]), name="cycle.ag")
        same(g, torch.tensor([[r, cycle] for r in range(size)]).reshape(-1),
             f"cycle {cycle} allgather")
        b = hvd.broadcast(torch.tensor([rank * 10 + cycle]), root_rank=size - 1)
        same(b, torch.tensor([(size - 1) * 10 + cycle]), f"cycle {cycle} broadcast")
        same(hvd.synchronize(h), torch.full((3,), float(sum(range(size)))),
             f"cycle {cycle} async allreduce")
        hvd.barrier()
        hvd.shutdown()
        assert not hvd.is_initialized()
        expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(1)),
                      f"allreduce after shutdown (cycle {cycle})", match=NOT_INIT)
    hvd.shutdown()   # a second shutdown() is harmless


def public_handle():
    """The op layer's public handle: wait(timeout) raises TimeoutError and stays usable, test()
    does not block, callbacks fire once, a second wait() returns the same result."""
    from hvdlite.common import ops
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    expected = torch.full((3,), float(size))
    if rank == 0:
        fired = []
        h = ops.allreduce([torch.ones(3)], names="handle.late", op=hvd.Sum)
        h.add_done_callback(lambda handle: fired.append(handle.done()))
        expect_raises(TimeoutError, lambda: h.wait(timeout=0.2),
                      "wait(timeout=0.2) while rank 1 has not submitted", match="handle.late")
        done, result = h.test()
        if done or result is not None or h.done():
            raise AssertionError(f"test() before rank 1 submitted: {(done, result)}")
        hvd.broadcast(torch.zeros(1), 0, name="handle.go")   # now rank 1 submits
        (out,) = h.wait(timeout=60)
        same(out, expected, "result after a timed-out wait")
        (again,) = h.wait()
        if again is not out:
            raise AssertionError("a second wait() returned another result")
        done, (res,) = h.test()
        if not done or res is not out:
            raise AssertionError("test() after completion")
        wait_until(lambda: fired, 10, pause=0.01)
        if fired != [True]:
            raise AssertionError(f"done callback: {fired}")
        late = []
        h.add_done_callback(lambda handle: late.append(1))   # already done: runs at once
        if late != [1]:
            raise AssertionError("a callback added after completion did not run")
        # An integer handle of the torch API exposes the same object.
        n = hvd.allreduce_async(torch.ones(2), name="handle.int", op=hvd.Sum)
        hvd.mpi_ops.get_handle(n).wait(timeout=60)
        same(hvd.synchronize(n), torch.full((2,), float(size)), "synchronize after wait")
    else:
        hvd.broadcast(torch.zeros(1), 0, name="handle.go")
        (out,) = ops.allreduce([torch.ones(3)], names="handle.late", op=hvd.Sum).wait(timeout=60)
        same(out, expected, "rank 1 result")
        same(hvd.allreduce(torch.ones(2), name="handle.int", op=hvd.Sum),
             torch.full((2,), float(size)), "integer handle")
    ops.barrier().wait(timeout=60)
    hvd.shutdown()


def results_die_with_the_caller():
    """A finished collective keeps no reference to its result: once the caller drops it (an
    optimizer's zero_grad), the tensor is freed at once, not at the next garbage collection,
    so the next step's gradients reuse its memory instead of fresh pages."""
    import gc
    import weakref
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    gc.disable()
    try:
        for name, run in [
                ("in place, async", lambda t: hvd.synchronize(
                    hvd.allreduce_async_(t, name="life.inplace", op=hvd.Sum))),
                ("out of place", lambda t: hvd.allreduce(t, name="life.out", op=hvd.Sum)),
                ("grouped", lambda t: hvd.grouped_allreduce([t], name="life.group",
                                                            op=hvd.Sum)[0])]:
            for step in range(4):                     # first sight, then the steady state
                t = torch.ones(1000) * (rank + step)
                out = run(t)
                same(out, torch.full((1000,), float(sum(range(size)) + size * step)),
                     f"{name} step {step}")
                alive = [weakref.ref(x) for x in (t, out)]
                del t, out
                # An engine thread may still be returning from the collective (its locals
                # hold the entries for a few us after the caller woke): poll, never collect.
                wait_until(lambda: all(w() is None for w in alive), 5)
                left = [w for w in alive if w() is not None]
                if left:
                    raise AssertionError(f"{name}, step {step}: {len(left)} tensor(s) still "
                                         f"referenced 5 s after the caller dropped them "
                                         f"(garbage collector off): "
                                         f"{[type(r).__name__ for r in gc.get_referrers(left[0]())]}")
    finally:
        gc.enable()
    hvd.shutdown()


check("before_init", before_init)
check("shutdown_init_cycles", cycles)
check("public_handle", public_handle)
check("results_die_with_the_caller", results_die_with_the_caller)
finish()
