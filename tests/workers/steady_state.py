"""The decentralised steady state (hvdlite/common/steady.py) on 3 ranks (not a power of two).

Steps of named collectives reach the steady state; from then on, cached tensors are released
without messages to the coordinator (engine counters). A changed shape falls back to full
negotiation with today's error; join and a process set keep working. Results are compared with
a reference computed locally from every rank's input. Where the rounds go over the control
connections, a real SIGINT while rank 0's caller applies a peer's round message must not lose
the message (interrupted_reading).
"""
from __future__ import annotations

import statistics
import threading
import time

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics
from hvdlite.common.backends import shm
from hvdlite.common.protocol import PEER_INLINE_FLOATS
from hvdlite.common.threads import usable_cores
from ops_common import (all_inputs, check, fail, finish, gen, my_rows, no_threads_left, same,
                        shape_mismatch, steady_delta)

pair = hvd.ProcessSet([0, 1])
hvd.init(process_sets=[pair])
rank, size = hvd.rank(), hvd.size()
assert size == 3, "steady_state.py needs 3 ranks"
SHAPES = [(5,), (3, 4), (64,), (2, 2, 2)]


def step(k: int, process_set=hvd.global_process_set, members=(0, 1, 2), prefix="s") -> None:
    """One training-like step: grouped into async handles, then synchronized."""
    handles = []
    for i, shape in enumerate(SHAPES):
        x = gen(rank, shape, torch.float32, salt=(prefix, i, k))
        handles.append(("sum", i, hvd.allreduce_async(x, name=f"{prefix}.g{i}", op=hvd.Sum,
                                                       process_set=process_set)))
    root = members[-1]
    b = gen(rank, (6,), torch.float32, salt=(prefix, "b", k))
    handles.append(("bcast", 0, hvd.broadcast_async(b, root, name=f"{prefix}.b",
                                                    process_set=process_set)))
    for kind, i, h in handles:
        got = hvd.synchronize(h)
        if kind == "sum":
            ref = sum(gen(r, SHAPES[i], torch.float32, salt=(prefix, i, k)) for r in members)
        else:
            ref = gen(root, (6,), torch.float32, salt=(prefix, "b", k))
        same(got, ref, f"{prefix} step {k} {kind} {i}")


def counters():
    return basics.engine_counters()


def steady_hits():
    d = steady_delta(step, range(3), range(3, 12))
    if d["coordinator_messages"]:
        fail(f"steady steps sent {d['coordinator_messages']} messages to the coordinator: {d}")
    if d["steady_released"] != 9 * (len(SHAPES) + 1):
        fail(f"steady rounds released {d['steady_released']} tensors, expected "
             f"{9 * (len(SHAPES) + 1)}")
    # Where the rounds ran: on the transport (MPI: one allreduce each; gloo's shared memory
    # while every rank has a core: its agreement area), with no control message between the
    # ranks; else (gloo with more ranks than cores, or HVDLITE_SHM=0) over the control
    # connections.
    rounds, on_transport, peer = d["steady_rounds"], d["transport_rounds"], d["peer_messages"]
    comm = basics._state.engine.comms[(0, "cpu")]
    agreement = comm.agreement is not None
    fits = hvd.local_size() <= usable_cores()
    # MPI whose waits yield the core moves its data through the shared-memory channel, and its
    # rounds over the control connections (an MPI allreduce per round would spin).
    mpi_on_shm = hvd.mpi_enabled() and getattr(comm, "shm", None) is not None
    expected = (hvd.mpi_enabled() and not mpi_on_shm) or (
        not hvd.mpi_enabled() and shm.mode() == "on" and fits)
    if agreement != expected:
        fail(f"rounds on the transport: {agreement}, with MPI {hvd.mpi_enabled()} (on shared "
             f"memory: {mpi_on_shm}), the shared-memory path {shm.mode()}, "
             f"{hvd.local_size()} ranks on {usable_cores()} cores")
    if agreement and (on_transport != rounds or peer != 0):
        fail(f"{on_transport} of {rounds} rounds on the transport, {peer} peer messages")
    if not agreement and (on_transport != 0 or peer == 0):
        fail(f"{on_transport} rounds on the transport, {peer} peer messages")


def changed_shape():
    shape_mismatch("s.g0")
    fallbacks = counters()["steady_fallbacks"]
    if fallbacks < 1:
        fail(f"no fallback to full negotiation: {counters()}")
    # The job goes on, and returns to the steady state.
    for k in range(20, 26):
        step(k)
    if counters()["steady_entered"] < 2:
        fail(f"did not return to the steady state: {counters()}")


def join_uneven():
    # Rank r runs 3 + r more steps on one tensor, then joins: joined ranks add zeros.
    mine = 3 + rank
    for k in range(5):
        if k < mine:
            x = gen(rank, (8,), torch.float32, salt=("j", k))
            got = hvd.allreduce(x, name="j.g", op=hvd.Sum)
            ref = sum(gen(r, (8,), torch.float32, salt=("j", k)) for r in range(size)
                      if k < 3 + r)
            same(got, ref, f"join step {k}")
    last = hvd.join()
    if last != size - 1:
        fail(f"join returned {last}, expected {size - 1}")
    for k in range(30, 34):
        step(k)


def process_set():
    if rank in (0, 1):
        before = counters()
        for k in range(8):
            step(k, process_set=pair, members=(0, 1), prefix="p")
        after = counters()
        if after["steady_entered"] <= before["steady_entered"]:
            fail(f"process set [0, 1] never entered the steady state: {after}")
    for k in range(40, 43):
        step(k)


def grouped():
    """Grouped ops are cached member by member and released by the rounds, whole: a step of
    grouped allreduces sends nothing to the coordinator once steady. One rank changing one
    member's shape falls the set back, and every rank raises the mismatch error naming that
    member (a group offered in part would have left the rest waiting for it); then the job
    returns to the steady state."""
    def gstep(k, shapes=SHAPES):
        xs = [gen(rank, s, torch.float32, salt=("gr", i, k)) for i, s in enumerate(shapes)]
        h = hvd.grouped_allreduce_async(xs, name="gr", op=hvd.Sum)
        one = hvd.allreduce_async(gen(rank, (7,), torch.float32, salt=("gr1", k)), name="gr.one",
                                  op=hvd.Sum)
        for i, got in enumerate(hvd.synchronize(h)):
            ref = sum(gen(r, shapes[i], torch.float32, salt=("gr", i, k)) for r in range(size))
            same(got, ref, f"grouped step {k} member {i}")
        ref = sum(gen(r, (7,), torch.float32, salt=("gr1", k)) for r in range(size))
        same(hvd.synchronize(one), ref, f"grouped step {k} single")

    d = steady_delta(gstep, range(3), range(3, 11))
    if d["coordinator_messages"]:
        fail(f"steady grouped steps sent {d['coordinator_messages']} messages to the "
             f"coordinator: {d}")
    if d["steady_released"] != 8 * (len(SHAPES) + 1):
        fail(f"steady rounds released {d['steady_released']} tensors, expected "
             f"{8 * (len(SHAPES) + 1)}")
    entered = counters()["steady_entered"]
    shapes = list(SHAPES)
    if rank == 1:
        shapes[2] = (65,)
    xs = [torch.ones(s) for s in shapes]
    try:
        hvd.grouped_allreduce(xs, name="gr", op=hvd.Sum)
    except hvd.HorovodInternalError as exc:
        expected = ("Mismatched ALLREDUCE tensor shapes on tensor 'gr.2': rank 0 sent shape "
                    "[64] but rank 1 sent shape [65].")
        if expected not in str(exc):
            fail(f"unexpected error: {exc}")
    else:
        fail("a grouped shape mismatch after the steady state did not raise")
    for k in range(11, 17):
        gstep(k)
    if counters()["steady_entered"] <= entered:
        fail(f"grouped steps did not return to the steady state: {counters()}")


def barrier():
    """A barrier is cached like a collective: a step with a barrier stays in the steady state
    (it used to fall back to the coordinator every step), and it still holds every rank until
    the last one arrives."""
    def bstep(k):
        step(k, prefix="bar")
        hvd.barrier()

    d = steady_delta(bstep, range(3), range(3, 9))
    if d["coordinator_messages"] or d["steady_fallbacks"]:
        fail(f"steady steps with a barrier sent {d['coordinator_messages']} messages to the "
             f"coordinator and fell back {d['steady_fallbacks']} times: {d}")
    if d["steady_released"] != 6 * (len(SHAPES) + 2):
        fail(f"steady rounds released {d['steady_released']} tensors, expected "
             f"{6 * (len(SHAPES) + 2)}")
    for late in range(size):
        if rank == late:
            time.sleep(0.3)
        t0 = time.monotonic()
        hvd.barrier()
        waited = time.monotonic() - t0
        if rank != late and waited < 0.2:
            fail(f"a steady barrier returned after {waited:.3f} s, before rank {late} reached it")


def unnamed():
    """A blocking collective without a name is named by its line alone (naming.blocking_name),
    so a step with unnamed blocking calls (a logged loss, averaged metrics, gathered
    predictions, a broadcast flag, a reduce-scatter) stays in the steady state, each call with
    the reference result; a changed shape from such a line still raises the mismatch error,
    naming the line."""
    def ref(k, shape, tag):
        return all_inputs(size, shape, torch.float32, salt=("un", tag, k))

    def ustep(k):
        step(k, prefix="un")
        x = ref(k, (3,), "ar")
        same(hvd.allreduce(x[rank], op=hvd.Sum), sum(x), f"unnamed allreduce, step {k}")
        a, b = ref(k, (2,), "ga"), ref(k, (4, 2), "gb")
        got = hvd.grouped_allreduce([a[rank], b[rank]], op=hvd.Sum)
        same(got[0], sum(a), f"unnamed grouped_allreduce [0], step {k}")
        same(got[1], sum(b), f"unnamed grouped_allreduce [1], step {k}")
        g = ref(k, (2, 3), "ag")
        same(hvd.allgather(g[rank]), torch.cat(g), f"unnamed allgather, step {k}")
        c = ref(k, (5,), "bc")
        same(hvd.broadcast(c[rank], root_rank=1), c[1], f"unnamed broadcast, step {k}")
        y = c[rank].clone()
        hvd.broadcast_(y, root_rank=0)
        same(y, c[0], f"unnamed broadcast_, step {k}")
        rs = ref(k, (2 * size, 2), "rs")
        same(hvd.reducescatter(rs[rank], op=hvd.Sum), my_rows(sum(rs), size, rank),
             f"unnamed reducescatter, step {k}")

    d = steady_delta(ustep, range(3), range(3, 9))
    if d["coordinator_messages"] or d["steady_fallbacks"]:
        fail(f"steady steps with unnamed blocking calls sent {d['coordinator_messages']} "
             f"messages to the coordinator and fell back {d['steady_fallbacks']} times: {d}")
    try:
        hvd.allreduce(torch.ones(4 if rank == 1 else 3), op=hvd.Sum)
    except hvd.HorovodInternalError as exc:
        if "Mismatched ALLREDUCE tensor shapes on tensor 'allreduce.noname.steady_state.py:" \
                not in str(exc) or "rank 1 sent shape [4]" not in str(exc):
            fail(f"unexpected error: {exc}")
    else:
        fail("an unnamed shape mismatch did not raise")
    try:
        hvd.allgather(torch.ones(2, 4 if rank == 1 else 3))
    except hvd.HorovodInternalError as exc:
        if "allgather.noname.steady_state.py:" not in str(exc):
            fail(f"unexpected error from a mismatched unnamed allgather: {exc}")
    else:
        fail("an unnamed allgather of mismatched shapes did not raise")


def buckets():
    """Gradient buckets (hvdlite/common/buckets.py): a step's allreduces, submitted one by one
    with compute between them, go out as a first small bucket and one bucket for the rest; a
    synchronous call is never held back waiting for the rest of its bucket."""
    sizes = [300_000] * 8                    # 1.2 MB each: bucket 0 = g0, bucket 1 = g1..g7

    def bstep(k):
        handles = []
        for i, n in enumerate(sizes):
            handles.append(hvd.allreduce_async(gen(rank, (n,), torch.float32, salt=("k", i, k)),
                                               name=f"bk.g{i}", op=hvd.Sum))
            time.sleep(0.003)               # backpropagation between two gradients
        for i, h in enumerate(handles):
            ref = sum(gen(r, (sizes[i],), torch.float32, salt=("k", i, k)) for r in range(size))
            same(hvd.synchronize(h), ref, f"bucket step {k} g{i}")

    for k in range(4):                       # the steady state, then one pass to plan from
        bstep(k)
    before = counters()
    for k in range(4, 10):
        bstep(k)
    after = counters()
    groups = (after["steady_groups"] - before["steady_groups"]) / 6
    if after["steady_released"] - before["steady_released"] != 6 * len(sizes):
        fail(f"not every bucketed allreduce went through the steady state: {before} -> {after}")
    if groups > 3.5:                         # each submission on its own would be ~8
        fail(f"{groups:.1f} transport calls per step of {len(sizes)} gradients, expected ~2 "
             f"buckets: {before} -> {after}")
    a, b = torch.ones(3), torch.ones(5)
    took = []
    for k in range(12):                      # both in one planned bucket, called synchronously
        t0 = time.monotonic()
        same(hvd.allreduce(a, name="bk.a", op=hvd.Sum), a * size, "sync a")
        same(hvd.allreduce(b, name="bk.b", op=hvd.Sum), b * size, "sync b")
        took.append(time.monotonic() - t0)
    if statistics.median(took[4:]) > 0.09:   # held until the deadline would be >= 2 x 50 ms
        fail(f"synchronous calls waited for their bucket: {took}")
    if basics._state.engine.comms[(0, "cpu")].agreement is not None:
        # Rounds on the transport (MPI): a synchronous call with nothing else in flight runs its round (and collective) on
        # the caller's thread (engine.Engine._drive_inline).
        before_sync = counters()["inline_driven"]
        for k in range(6):
            same(hvd.allreduce(a, name="bk.a", op=hvd.Sum), a * size, "inline a")
        if counters()["inline_driven"] - before_sync < 6:
            fail(f"synchronous calls on MPI were not driven by the caller: {counters()}")


def payloads():
    """Over the control connections, a round whose only tensor is a small float32 allreduce
    carries it (steady.py, point 2): every rank gathers every rank's copy in the round, adds
    them in rank order, and no gloo call is made. Larger, float64 and integer tensors take the
    transport as before; results are exact either way (integer-valued inputs), on 3 ranks (a
    pre/post step in each round)."""
    most = 2 * PEER_INLINE_FLOATS // size      # the largest tensor a round carries on N ranks
    cases = [  # name, shape, dtype, keyword arguments, carried in the round
        ("pl.sum", (5,), torch.float32, {"op": hvd.Sum}, True),
        ("pl.avg", (3, 4), torch.float32,
         {"op": hvd.Average, "prescale_factor": 0.5, "postscale_factor": 3.0}, True),
        ("pl.mpi", (1025,), torch.float32, {"op": hvd.Sum}, True),     # > INLINE_FLOATS
        ("pl.full", (most,), torch.float32, {"op": hvd.Sum}, True),
        ("pl.over", (most + 1,), torch.float32, {"op": hvd.Sum}, False),
        ("pl.f64", (5,), torch.float64, {"op": hvd.Sum}, False),
        ("pl.int", (5,), torch.int32, {"op": hvd.Sum}, False),
        ("pl.max", (5,), torch.float32, {"op": hvd.Max}, False),
    ]

    def run(k: int) -> None:
        for name, shape, dtype, kw, _ in cases:
            xs = [gen(r, shape, dtype, salt=(name, k)) for r in range(size)]
            ref = torch.stack(xs).max(0).values if kw["op"] == hvd.Max else sum(xs)
            if kw["op"] == hvd.Average:
                ref = ref * 0.5             # prescale 0.5, postscale 3 / 3 ranks: exact
            same(hvd.allreduce(xs[rank], name=name, **kw), ref, f"{name} step {k}")
            y = xs[rank].clone()
            hvd.allreduce_(y, name=name + "_", **kw)
            same(y, ref, f"{name} in place, step {k}")

    d = steady_delta(run, range(3), range(3, 9))
    if d["coordinator_messages"]:
        fail(f"steady steps sent {d['coordinator_messages']} messages to the coordinator: {d}")
    if basics._state.engine.comms[(0, "cpu")].agreement is None:
        want = 6 * 2 * sum(1 for c in cases if c[-1])
        if d["round_payloads"] != want or d["transport_rounds"]:
            fail(f"{d['round_payloads']} allreduces carried by rounds over the control "
                 f"connections, expected {want}: {d}")
        # A synchronous caller reads its round's answer itself (engine.Engine._read_peers),
        # within a window, when the background thread does not hold the drive lock: most of
        # these 96 calls' rounds, never none of them. On a loaded machine (the whole suite on
        # 2 cores) one rank once read none, so up to two more batches run, on every rank
        # alike (decided by a collective), before that fails.
        reads = d["caller_reads"]
        for extra in range(2):
            if not hvd.allreduce(torch.tensor([0 if reads else 1]), name="pl.retry",
                                 op=hvd.Max).item():
                break
            reads += steady_delta(run, range(0), range(9 + 6 * extra, 15 + 6 * extra))[
                "caller_reads"]
        if not reads:
            fail(f"no waiting caller read its round over the control connections: {d}")

    # Several tensors at once: a grouped call of small float32 allreduces, and a step's
    # tensors submitted in one call, ride in their round together (engine.Engine._carry), in
    # place and scaled too; a group one element over what a round carries goes the usual way.
    from hvdlite.torch.mpi_ops import _allreduce_batch_async
    over = [(most - 3,), (4,)]
    # (An average postscaled by the set's size: exact, as 1/3 is not.)
    groups = [("plg.metrics", [(), (2,), (3, 3)],
               {"op": hvd.Average, "postscale_factor": float(size)}, True),
              ("plg.scaled", [(5,), (7,)],
               {"op": hvd.Sum, "prescale_factor": 0.5, "postscale_factor": 3.0}, True),
              ("plg.over", over, {"op": hvd.Sum}, False)]

    def ref_of(name, i, shape, kw, k):
        xs = [gen(r, shape, torch.float32, salt=(name, i, k)) for r in range(size)]
        total = sum(x * kw.get("prescale_factor", 1.0) for x in xs)
        total = total * kw.get("postscale_factor", 1.0)
        return total / size if kw["op"] == hvd.Average else total

    def grouped_run(k: int) -> None:
        for name, shapes, kw, _ in groups:
            xs = [gen(rank, sh, torch.float32, salt=(name, i, k)) for i, sh in enumerate(shapes)]
            for i, got in enumerate(hvd.grouped_allreduce(xs, name=name, **kw)):
                same(got, ref_of(name, i, shapes[i], kw, k), f"{name} member {i} step {k}")
            ys = [x.clone() for x in xs]
            hvd.grouped_allreduce_(ys, name=name + "_", **kw)
            for i, got in enumerate(ys):
                same(got, ref_of(name, i, shapes[i], kw, k), f"{name}_ member {i} step {k}")
        xs = [gen(rank, (6,), torch.float32, salt=("plb", i, k)) for i in range(3)]
        hs = _allreduce_batch_async(xs, [f"plb.{i}" for i in range(3)], hvd.Sum, 1.0, 1.0,
                                    hvd.global_process_set)
        for i, h in enumerate(hs):
            same(hvd.synchronize(h),
                 sum(gen(r, (6,), torch.float32, salt=("plb", i, k)) for r in range(size)),
                 f"batch {i} step {k}")

    d = steady_delta(grouped_run, range(3), range(3, 9))
    if d["coordinator_messages"]:
        fail(f"steady grouped steps sent {d['coordinator_messages']} messages to the "
             f"coordinator: {d}")
    if basics._state.engine.comms[(0, "cpu")].agreement is None:
        want = 6 * (2 * sum(len(shapes) for _, shapes, _, carried in groups if carried) + 3)
        if d["round_payloads"] != want:
            fail(f"{d['round_payloads']} grouped and batched allreduces carried by rounds over "
                 f"the control connections, expected {want}: {d}")

    # The same bits whether a round carried the tensor or the data path reduced it: a round adds
    # the ranks' copies in rank order, as the shared-memory path adds its slots. Fractional
    # inputs, so the order of the additions shows in the last bits. (The pair's second member
    # is more than a round carries, so the pair goes through the data path.)
    compared = shm_steps = 0
    for k in range(3):
        g = torch.Generator().manual_seed(50 + 7 * rank + k)
        x, y = torch.randn(300, generator=g), torch.randn(most, generator=g)
        before = counters()
        alone = hvd.allreduce(x, name="pl.det", op=hvd.Sum)
        carried = counters()["round_payloads"] - before["round_payloads"]
        before = counters()
        pair_of = hvd.grouped_allreduce([x, y], name="pl.detg", op=hvd.Sum)[0]
        on_shm = counters()["shm_collectives"] > before["shm_collectives"]
        shm_steps += on_shm
        if on_shm and carried:
            compared += 1
            if not torch.equal(alone, pair_of):
                fail(f"step {k}: a round's sum differs from the shared-memory path's: max abs "
                     f"diff {(alone - pair_of).abs().max().item()}")
    if basics._state.engine.comms[(0, "cpu")].agreement is None and shm_steps and not compared:
        fail("no allreduce was carried by a round next to the shared-memory path to compare")

    # Crossed submission orders: each rank's first round offers another tensor, so the tags
    # differ and no payload may be used; the next round releases both through the transport.
    for k in range(4):
        xs = {n: [gen(r, (6,), torch.float32, salt=(n, k)) for r in range(size)]
              for n in ("pl.x", "pl.y")}
        order = ["pl.x", "pl.y"] if rank != 1 else ["pl.y", "pl.x"]
        hs = {n: hvd.allreduce_async(xs[n][rank], name=n, op=hvd.Sum) for n in order}
        for n in order:
            same(hvd.synchronize(hs[n]), sum(xs[n]), f"crossed {n} step {k}")


def interrupted_reading():
    """A real SIGINT (Ctrl-C) reaches rank 0 while its caller applies a peer's round message it
    has just read (engine.Engine._read_peers, rounds over the control connections): the
    KeyboardInterrupt comes out of the wait once the message is applied (interrupts.py), the
    interrupted call still gets its result, and every rank goes on reducing the same name
    right. Before, the interrupt landed between reading the message and applying it: the
    message was lost, rank 0's round never ended, and every rank hung at the next call."""
    import os
    import signal

    from hvdlite.common import engine
    apply = engine.Engine._on_steady_msg
    armed = []

    def interrupting(self, msg):
        if armed and threading.current_thread() is threading.main_thread():
            armed.pop()
            os.kill(os.getpid(), signal.SIGINT)      # its handler runs at the next bytecode
        return apply(self, msg)

    def made(r, k):
        return gen(r, (40,), torch.float32, salt=("ir", k))

    engine.Engine._on_steady_msg = interrupting
    try:
        left, reads = None, counters()["caller_reads"]
        for k in range(300):
            x = made(rank, k)
            want = sum(made(r, k) for r in range(size))
            # In step, and all stop 6 steps after the interrupt; the peers then come a moment
            # later, so that rank 0 waits and reads their answer itself.
            done = rank == 0 and left is not None and k >= left[0] + 6
            if hvd.allreduce(torch.tensor([float(done)]), name="ir.sync", op=hvd.Sum).item():
                break
            if rank != 0:
                time.sleep(0.0005)
            elif left is None and k >= 4:
                armed[:] = [True]
            try:
                hvd.allreduce_(x, name="ir.x", op=hvd.Sum)
            except KeyboardInterrupt:
                if rank != 0 or left is not None:
                    raise
                left, armed[:] = (k, x, want), []
                continue
            armed[:] = []                  # (the background thread applied them this time)
            same(x, want, f"step {k}")
        if rank == 0:
            if left is None:
                fail(f"the caller never applied a peer's message while armed "
                     f"({counters()['caller_reads'] - reads} caller reads)")
            else:
                same(left[1], left[2], f"the interrupted call's result (step {left[0]})")
    finally:
        engine.Engine._on_steady_msg = apply


check("steady_hits", steady_hits)
check("payloads", payloads)
check("buckets", buckets)
check("grouped", grouped)
check("barrier", barrier)
check("unnamed", unnamed)
check("changed_shape", changed_shape)
check("join", join_uneven)
check("process_set", process_set)
if getattr(basics._state.engine.steady.get(0), "over_peers", False):   # (rounds over peers)
    check("interrupted_reading", interrupted_reading)
print("COUNTERS", counters(), flush=True)
finish()
hvd.shutdown()
no_threads_left()
