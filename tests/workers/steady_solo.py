"""The steady state of a one-member set: a job of one rank, or a process set of one rank.

A one-member set has nobody to agree with: once its tensors come back as cache hits, a cached
tensor is released on the caller's thread (no message to rank 0's coordinator, no thread
hand-off, no fusion copies), and a first sight or a changed signature still goes through full
negotiation. Run with 1 rank (the global set) or 2 ranks (each rank also owns the set of its
own rank, beside the global set). Results are compared with a local reference.
"""
from __future__ import annotations

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics
from ops_common import check, fail, finish, gen, reduce_ref, same, steady_delta

hvd.init(process_sets="dynamic")
rank, size = hvd.rank(), hvd.size()
assert size in (1, 2), "steady_solo.py runs on 1 or 2 ranks"
# Every rank registers both one-member sets; each uses its own.
own = hvd.global_process_set if size == 1 else \
    [hvd.add_process_set([0]), hvd.add_process_set([1])][rank]
SHAPES = [(5,), (3, 4), (64,), (2, 2, 2)]


def counters() -> dict:
    return basics.engine_counters()


def step(k: int) -> None:
    """Async allreduces (Sum, Average with scale factors), an integer one, a broadcast and an
    allgather on the one-member set, then synchronous calls; every result checked."""
    handles = []
    for i, shape in enumerate(SHAPES):
        x = gen(rank, shape, torch.float32, salt=("solo", i, k))
        handles.append((x, hvd.allreduce_async(x, name=f"solo.g{i}", op=hvd.Sum,
                                               process_set=own), 1.0, 1.0))
    y = gen(rank, (7,), torch.float32, salt=("solo", "avg", k))
    handles.append((y, hvd.allreduce_async(y, name="solo.avg", op=hvd.Average,
                                           prescale_factor=0.5, postscale_factor=3.0,
                                           process_set=own), 0.5, 3.0))
    for x, h, pre, post in handles:
        op = hvd.Sum if pre == 1.0 else hvd.Average
        same(hvd.synchronize(h), reduce_ref([x], op, pre, post), f"solo step {k} async")
    n = gen(rank, (9,), torch.int32, salt=("solo", "int", k))
    inplace = n.clone()
    hvd.allreduce_(inplace, name="solo.int", op=hvd.Sum, postscale_factor=0.5,
                   process_set=own)
    same(inplace, reduce_ref([n], hvd.Sum, 1.0, 0.5), f"solo step {k} int32 in place")
    b = gen(rank, (6,), torch.float32, salt=("solo", "b", k))
    same(hvd.broadcast(b, rank, name="solo.b", process_set=own), b, f"solo step {k} broadcast")
    same(hvd.allgather(b, name="solo.ag", process_set=own), b, f"solo step {k} allgather")


def solo_hits():
    d = steady_delta(step, range(3), range(3, 10))
    if d["coordinator_messages"]:
        fail(f"steady steps of a one-member set sent {d['coordinator_messages']} messages to "
             f"the coordinator: {d}")
    if d["peer_messages"] or d["transport_rounds"]:
        fail(f"a one-member set's rounds need no peer: {d}")
    per_step = len(SHAPES) + 4
    if d["steady_released"] != 7 * per_step:
        fail(f"released {d['steady_released']} tensors in 7 steps, expected {7 * per_step}")
    # Nothing else in flight when each one is submitted (the previous one already finished on
    # its caller's thread): every tensor runs on the caller's thread.
    if d["inline_driven"] != 7 * per_step:
        fail(f"{d['inline_driven']} of {7 * per_step} tensors ran on the caller's thread: {d}")
    # The allreduces, async or blocking, take the express lane (engine.Engine.express); the
    # broadcast and the allgather the general one.
    if d["express"] != 7 * len(SHAPES) + 7 * 2:
        fail(f"{d['express']} of {7 * (len(SHAPES) + 2)} allreduces took the express lane: {d}")


def solo_finished_handle():
    """An async allreduce that finished before its call returned keeps its name until it is
    synchronized, as any handle does; poll() says it is done; callbacks run at once."""
    x = gen(rank, (5,), torch.float32, salt="fin")
    for k in range(4):                  # first sight, then the steady state
        same(hvd.synchronize(hvd.allreduce_async(x, name="solo.fin", op=hvd.Sum,
                                                 process_set=own)), x, f"finished {k}")
    h = hvd.allreduce_async(x, name="solo.fin", op=hvd.Sum, process_set=own)
    if not hvd.poll(h):
        fail("a one-member set's steady async allreduce was not done when its call returned")
    try:
        hvd.allreduce_async(x, name="solo.fin", op=hvd.Sum, process_set=own)
        fail("a name still unsynchronized was accepted again")
    except ValueError as exc:
        if "solo.fin" not in str(exc):
            fail(f"duplicate-name error does not name the tensor: {exc}")
    seen = []
    hvd.mpi_ops.get_handle(h).add_done_callback(lambda handle: seen.append(handle.done()))
    if seen != [True]:
        fail(f"a finished handle's callback did not run at once: {seen}")
    same(hvd.synchronize(h), x, "finished handle result")
    same(hvd.synchronize(hvd.allreduce_async(x, name="solo.fin", op=hvd.Sum, process_set=own)),
         x, "name free after synchronize")


def solo_changed_shape():
    """A new shape under a cached name: full negotiation again (one rank: no error), then
    back to the steady state."""
    before = counters()
    x = gen(rank, (11,), torch.float32, salt="changed")
    same(hvd.allreduce(x, name="solo.g0", op=hvd.Sum, process_set=own), x, "changed shape")
    for k in range(20, 26):
        step(k)
    after = counters()
    if after["steady_fallbacks"] <= before["steady_fallbacks"]:
        fail(f"a changed shape did not fall back to full negotiation: {before} -> {after}")
    if after["steady_entered"] <= before["steady_entered"]:
        fail(f"did not return to the steady state: {before} -> {after}")


def solo_many_async():
    """A step's worth of gradients submitted before any wait: none is held for a bucket (a
    one-member set sends nothing), and the in-place results are right."""
    xs = [gen(rank, (1000 + 37 * i,), torch.float32, salt=("many", i)) for i in range(20)]
    for k in range(4):
        ts = [x.clone() for x in xs]
        handles = [hvd.allreduce_async_(t, name=f"solo.many{i}", op=hvd.Average,
                                        process_set=own) for i, t in enumerate(ts)]
        for h in handles:
            hvd.synchronize(h)
        for i, t in enumerate(ts):
            same(t, xs[i], f"many step {k} tensor {i}")


def solo_join():
    if size == 1:
        last = hvd.join()
        if last != 0:
            fail(f"join on one rank returned {last}, expected 0")
        step(30)


def global_still_works():
    """Beside the one-member sets, the global set's collectives are unchanged."""
    for k in range(4):
        x = gen(rank, (8,), torch.float32, salt=("global", k))
        ref = sum(gen(r, (8,), torch.float32, salt=("global", k)) for r in range(size))
        same(hvd.allreduce(x, name="global.x", op=hvd.Sum), ref, f"global step {k}")


check("solo_hits", solo_hits)
check("solo_finished_handle", solo_finished_handle)
check("solo_changed_shape", solo_changed_shape)
check("solo_many_async", solo_many_async)
check("solo_join", solo_join)
check("global_still_works", global_still_works)
print("COUNTERS", counters(), flush=True)
finish()
hvd.shutdown()
