"""The steady state's rounds on the transport (steady.TransportRound) on 2 ranks: one MPI
allreduce each on MPI, the segment's agreement area on gloo's shared-memory path
(backends/shm.py, ShmAgreement).

2 ranks on this 2-core machine: waits spin, so a synchronous call with nothing else in flight
runs its round and its collective on the caller's thread (engine.Engine._drive_inline; on
shared memory the collective runs there too, ShmChannel._submit). Checks:
- inline: synchronous allreduces, averages and broadcasts after the steady state are driven by
  the caller, rounds run on the transport (no control message between the ranks), results equal
  the reference;
- express: the same calls with their inputs and references computed beforehand, and a spin
  window long enough that a rank descheduled on a busy machine still arrives within it: every
  allreduce takes the express lane (engine.Engine.express), no broadcast does;
- waiter: one rank submits 0.2 s late, so the other's round outlives the spin window and goes
  to the round waiter thread; the result is still right and nothing else waited;
- async: a step of async allreduces submitted together, synchronized at the end (rounds
  started by the background thread);
- crossed: rank 1 submits B asynchronously and then A, rank 0 A and then B, both synchronously:
  the first rounds have no common bit, so the express lane hands them to the general path, which
  releases A and then B on both ranks;
- large: a synchronous 2.4 MB allreduce takes the express lane too; its caller polls the
  transfer to the end (engine.BLOCKING_POLL_S), or, with that window set to 0 (a transfer that
  outlasts it), the finisher thread finishes it;
- mid: a synchronous 1 MiB allreduce whose transfer outlasts the spin window is polled to the
  end by its caller too (engine.BLOCKING_POLL_S), not handed to the finisher;
- late_peer: a blocking caller whose peer arrives 50 ms late polls its round past the spin
  window (engine.BLOCKING_POLL_S) and still takes the express lane;
- busy_engine: a blocking caller that finds another thread holding the engine for a moment
  waits for it (engine.DRIVE_WAIT_S) and still takes the express lane;
- batch: a step's tensors submitted in one call (the DistributedOptimizer's deferred gradients)
  and a grouped allreduce are driven by their caller too;
- changed_shape: a changed shape raises today's mismatch error on both ranks; the job returns
  to the steady state;
- compacted: after more changed signatures of one name than steady.COMPACT_WIDTH, the rounds
  carry only the live bits ("D"'s slots), stay on the transport and release the right tensors;
- reuse: one name whose allreduce (blocking, asynchronous, in place, in a batch) changes op,
  scale factors, shape or dtype right after the set became steady reduces as asked every
  time, and a shape that differs across ranks still raises the mismatch error;
- payload: a blocking allreduce of a small float32 tensor rides in its round
  (backends/mpi.Agreement, shm.ShmAgreement): sums, averages, pre- and postscaled ones and a
  tensor that fills the payload exactly finish with no data collective; one element more,
  float64, int32 and max go the two-call way; an asynchronous call whose caller drives its
  round carries it too. The waiter and compacted checks also count rounds that carried the
  tensor (a round finished by the waiter thread, and one whose bits are slots);
- grouped_payload: a round carries all the small float32 allreduces it releases (a grouped
  call, in place and scaled, a step's tensors submitted in one call), not one only, and a
  blocking grouped call it carries takes the express lane (engine.Engine.express_many); a
  group over the payload, with a float64 member or reduced by max goes the usual way; ranks
  whose round offers differ carry nothing in it and reduce every tensor right, and so does a
  grouped call that the lane hands to the general path (a rank with another tensor in
  flight, a peer later than the lane's polling window), and a group whose members' cache
  bits run in another order than the call's (one member's shape changed once).
"""
from __future__ import annotations

import contextlib
import threading
import time

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics, engine
from ops_common import (check, fail, finish, gen, no_threads_left, reduce_ref, same,
                        shape_mismatch, steady_delta)

hvd.init()
rank, size = hvd.rank(), hvd.size()
hvd.broadcast(torch.zeros(1), 0, name="setup")      # the set's communicator exists from here
comm = basics._state.engine.comms[(0, "cpu")]
assert size == 2 and comm.agreement is not None, \
    "steady_transport_rounds.py needs 2 ranks on MPI or on gloo's shared memory"
# Both agreements carry a payload (backends/mpi.Agreement, shm.ShmAgreement).
payloads = hasattr(comm.agreement, "payload_for")


def counters():
    return basics.engine_counters()


@contextlib.contextmanager
def long_spin():
    """A 2 s spin window instead of 250 us. Whether a round ends within the window depends on
    the scheduler (with one more busy process on this machine most did not); the long window
    takes timing out of the express lane's checks. The lane's code is the same."""
    channel = getattr(comm, "shm", None)     # gloo: the shared-memory channel spins too
    spin, comm.inline_poll_s = comm.inline_poll_s, 2.0
    if channel is not None:
        channel_spin, channel.spin_s = channel.spin_s, 2.0
    try:
        yield
    finally:
        comm.inline_poll_s = spin
        if channel is not None:
            channel.spin_s = channel_spin


@contextlib.contextmanager
def engine_windows(**values):
    """Set the engine's module-level windows (engine/windows.py: BLOCKING_POLL_S, DRIVE_WAIT_S) for a check, and
    restore them after it."""
    saved = {name: getattr(engine.windows, name) for name in values}
    for name, value in values.items():
        setattr(engine.windows, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(engine.windows, name, value)


def sync_step(k: int) -> None:
    x = gen(rank, (33,), torch.float32, salt=("x", k))
    same(hvd.allreduce(x, name="r.sum", op=hvd.Sum),
         sum(gen(r, (33,), torch.float32, salt=("x", k)) for r in range(size)), f"sum {k}")
    y = gen(rank, (4, 4), torch.float32, salt=("y", k))
    same(hvd.allreduce(y, name="r.avg"),
         sum(gen(r, (4, 4), torch.float32, salt=("y", k)) for r in range(size)) / size,
         f"average {k}")
    b = gen(rank, (5,), torch.float32, salt=("b", k))
    same(hvd.broadcast(b, 1, name="r.b"), gen(1, (5,), torch.float32, salt=("b", k)),
         f"broadcast {k}")


def inline():
    d = steady_delta(sync_step, range(4), range(4, 14))
    if d["coordinator_messages"] or d["peer_messages"]:
        fail(f"steady steps sent messages: {d}")
    if d["steady_released"] != 30 or d["transport_rounds"] != d["steady_rounds"]:
        fail(f"expected 30 tensors released by rounds on the transport: {d}")
    if d["inline_driven"] != 30:
        fail(f"synchronous calls not driven by the caller: {d}")


def express():
    steps = range(80, 92)
    xs = {k: gen(rank, (33,), torch.float32, salt=("ex", k)) for k in steps}
    ys = {k: gen(rank, (4, 4), torch.float32, salt=("ey", k)) for k in steps}
    bs = {k: gen(rank, (5,), torch.float32, salt=("eb", k)) for k in steps}
    got = {}

    def step(k: int) -> None:         # nothing computed between the calls
        got[k] = (hvd.allreduce(xs[k], name="r.sum", op=hvd.Sum),
                  hvd.allreduce(ys[k], name="r.avg"), hvd.broadcast(bs[k], 1, name="r.b"))

    with long_spin():
        d = steady_delta(step, steps[:2], steps[2:])
    for k in steps:
        x, y, b = got[k]
        same(x, sum(gen(r, (33,), torch.float32, salt=("ex", k)) for r in range(size)),
             f"express sum {k}")
        same(y, sum(gen(r, (4, 4), torch.float32, salt=("ey", k)) for r in range(size)) / size,
             f"express average {k}")
        same(b, gen(1, (5,), torch.float32, salt=("eb", k)), f"express broadcast {k}")
    # Every allreduce its caller drove took the lane (a call finds the background thread
    # holding the engine on rare occasions, and goes the general way: inline_driven says so).
    undriven = 30 - d["inline_driven"]
    if not 20 - undriven <= d["express"] <= 20:
        fail(f"expected the 20 allreduces (not the broadcasts) on the express lane: {d}")


def waiter():
    before = counters()
    for k in range(20, 23):
        if rank == 1:
            time.sleep(0.2)            # rank 0's round waits longer than any spin window
        t0 = time.monotonic()
        x = gen(rank, (33,), torch.float32, salt=("w", k))
        same(hvd.allreduce(x, name="r.sum", op=hvd.Sum),
             sum(gen(r, (33,), torch.float32, salt=("w", k)) for r in range(size)), f"waiter {k}")
        took = time.monotonic() - t0
        if rank == 0 and k > 20 and not 0.1 < took < 1.5:
            fail(f"rank 0 waited {took:.3f} s for a peer 0.2 s late")
    if counters()["steady_fallbacks"] != before["steady_fallbacks"]:
        fail(f"a late rank made the set fall back: {before} -> {counters()}")
    # Both ranks tagged their rounds with r.sum: rank 0's ended on the waiter thread, which
    # finished it from the payload too (engine.Engine._round_done).
    if payloads and counters()["round_payloads"] - before["round_payloads"] != 3:
        fail(f"late rounds did not carry the tensor: {before} -> {counters()}")


def async_step():
    for k in range(30, 36):
        xs = [gen(rank, (100 + i,), torch.float32, salt=("a", i, k)) for i in range(6)]
        hs = [hvd.allreduce_async(x, name=f"r.a{i}", op=hvd.Sum) for i, x in enumerate(xs)]
        for i, h in enumerate(hs):
            same(hvd.synchronize(h),
                 sum(gen(r, (100 + i,), torch.float32, salt=("a", i, k)) for r in range(size)),
                 f"async {k} {i}")


def crossed():
    def step(k: int, cross: bool) -> None:
        a = gen(rank, (7,), torch.float32, salt=("ca", k))
        b = gen(rank, (9,), torch.float32, salt=("cb", k))
        want_a = sum(gen(r, (7,), torch.float32, salt=("ca", k)) for r in range(size))
        want_b = sum(gen(r, (9,), torch.float32, salt=("cb", k)) for r in range(size))
        if rank == 1 and cross:
            hb = hvd.allreduce_async(b, name="x.b", op=hvd.Sum)
            same(hvd.allreduce(a, name="x.a", op=hvd.Sum), want_a, f"crossed a {k}")
            same(hvd.synchronize(hb), want_b, f"crossed b {k}")
        else:
            same(hvd.allreduce(a, name="x.a", op=hvd.Sum), want_a, f"crossed a {k}")
            same(hvd.allreduce(b, name="x.b", op=hvd.Sum), want_b, f"crossed b {k}")

    for k in range(50, 54):            # first sight of x.a and x.b, then the steady state again
        step(k, cross=False)
    before = counters()
    for k in range(54, 60):
        step(k, cross=True)
    after = counters()
    if after["steady_fallbacks"] != before["steady_fallbacks"]:
        fail(f"crossed submissions made the set fall back: {before} -> {after}")
    if after["steady_released"] - before["steady_released"] != 12:
        fail(f"crossed steps were not all released by the steady state: {before} -> {after}")


def large():
    shape = (600_000,)
    xs = {k: gen(rank, shape, torch.float32, salt=("L", k)) for k in range(60, 70)}
    want = {k: sum(gen(r, shape, torch.float32, salt=("L", k)) for r in range(size))
            for k in xs}
    got = {}

    def step(k: int) -> None:         # inputs ready: the ranks arrive together
        # The caller polls its transfer itself (k < 67), or hands it to the finisher thread at
        # once (a window of 0: the path a transfer longer than BLOCKING_POLL_S takes).
        with engine_windows(BLOCKING_POLL_S=engine.windows.BLOCKING_POLL_S if k < 67 else 0.0):
            got[k] = hvd.allreduce(xs[k], name="r.large", op=hvd.Sum)

    with long_spin():
        d = steady_delta(step, range(60, 64), range(64, 70))
    for k in xs:
        same(got[k], want[k], f"large {k}")
    if d["steady_released"] != 6 or d["coordinator_messages"]:
        fail(f"large synchronous allreduces left the steady state: {d}")
    if d["express"] < 3:
        fail(f"large synchronous allreduces did not take the express lane: {d}")


def late_peer():
    """Rank 1 calls 50 ms late, far past the 250 us spin window: rank 0's blocking caller
    still polls its round (for engine.BLOCKING_POLL_S, 2 s here, not the spin window) and takes
    the express lane, instead of handing the round to the waiter thread and its result back."""
    for k in range(4):
        hvd.allreduce(gen(rank, (700,), torch.float32, salt=("lp", k)), name="r.late",
                      op=hvd.Sum)
        hvd.allreduce(torch.zeros(1), name="r.sync")
    with engine_windows(BLOCKING_POLL_S=2.0):
        for k in range(4, 7):
            x = gen(rank, (700,), torch.float32, salt=("lp", k))
            want = sum(gen(r, (700,), torch.float32, salt=("lp", k)) for r in range(size))
            hvd.allreduce(torch.zeros(1), name="r.sync")   # (in step; cached, unlike barrier)
            if rank == 1:
                time.sleep(0.05)
            before = counters()
            same(hvd.allreduce(x, name="r.late", op=hvd.Sum), want, f"late peer {k}")
            d = {n: counters()[n] - before[n] for n in ("express", "coordinator_messages")}
            if rank == 0 and d != {"express": 1, "coordinator_messages": 0}:
                fail(f"a peer 50 ms late took rank 0 off the express lane ({k}): {d}")


def busy_engine():
    """Another thread holds the engine (its drive lock) for 20 ms when a blocking allreduce
    starts, as the background thread does for a moment on its periodic wake-ups: the caller
    waits for it (engine.DRIVE_WAIT_S) and still takes the express lane, instead of going
    through the queue and the background thread. Both windows (DRIVE_WAIT_S, and
    BLOCKING_POLL_S for the peer's round) are 2 s here, so that a loaded machine cannot
    stretch the hold or the ranks' distance past them."""
    eng = basics._state.engine
    held = threading.Event()

    def hold() -> None:
        with eng._drive:
            held.set()
            time.sleep(0.02)

    with engine_windows(DRIVE_WAIT_S=2.0, BLOCKING_POLL_S=2.0):
        for k in range(3):
            x = gen(rank, (33,), torch.float32, salt=("be", k))
            want = sum(gen(r, (33,), torch.float32, salt=("be", k)) for r in range(size))
            hvd.allreduce(torch.zeros(1), name="r.sync")
            held.clear()
            holder = threading.Thread(target=hold)
            holder.start()
            held.wait()
            before = counters()["express"]
            same(hvd.allreduce(x, name="r.busy", op=hvd.Sum), want, f"busy engine {k}")
            holder.join()
            if k and counters()["express"] - before != 1:     # (k = 0: first sight of r.busy)
                fail(f"an allreduce that found the engine busy for 20 ms left the express "
                     f"lane: {counters()}")


def batch():
    """Several tensors submitted in one call: the DistributedOptimizer's gradients at the end of
    backpropagation (mpi_ops._allreduce_batch_async, each its own named allreduce) and a
    grouped allreduce. With nothing else in flight, the caller runs their round and launches
    their collective itself (engine.Engine._drive_inline), with no control message and no
    hand-off to the background thread."""
    from hvdlite.torch.mpi_ops import _allreduce_batch_async
    shapes = [(50,), (3, 7), (300,)]

    def want(salt: str, i: int, k: int) -> torch.Tensor:
        return sum(gen(r, shapes[i], torch.float32, salt=(salt, i, k)) for r in range(size))

    def step(k: int) -> None:
        xs = [gen(rank, s, torch.float32, salt=("bt", i, k)) for i, s in enumerate(shapes)]
        hs = _allreduce_batch_async(xs, [f"r.bt{i}" for i in range(3)], hvd.Sum, 1.0, 1.0,
                                    hvd.global_process_set)
        got = [hvd.synchronize(h) for h in hs]
        gs = [gen(rank, s, torch.float32, salt=("gr", i, k)) for i, s in enumerate(shapes)]
        got += hvd.grouped_allreduce(gs, name="r.grp", op=hvd.Sum)
        for i in range(3):
            same(got[i], want("bt", i, k), f"batch {k} {i}")
            same(got[3 + i], want("gr", i, k), f"grouped {k} {i}")

    d = steady_delta(step, range(4), range(4, 10))
    if d["coordinator_messages"] or d["peer_messages"] or d["steady_released"] != 36:
        fail(f"batches left the steady state: {d}")
    if d["inline_driven"] != 36:
        fail(f"batches not driven by their caller: {d}")


def mid():
    """A synchronous allreduce of INLINE_POLL_BYTES (1 MiB) whose transfer outlasts the spin
    window (cut to 1 us here; ~300 us on 2 MPI ranks outlasted the default 250 us): its
    blocking caller still polls it to the end (engine.BLOCKING_POLL_S covers a blocking call of
    any size), with no hand-off to the finisher thread. On gloo the shared-memory channel runs
    it on the caller's thread (its own window is kept long)."""
    n = engine.windows.INLINE_POLL_BYTES // 4
    xs = {k: gen(rank, (n,), torch.float32, salt=("M", k)) for k in range(70, 80)}
    want = {k: sum(gen(r, (n,), torch.float32, salt=("M", k)) for r in range(size)) for k in xs}
    got = {}

    def step(k: int) -> None:
        got[k] = hvd.allreduce(xs[k], name="r.mid", op=hvd.Sum)

    with long_spin(), engine_windows(BLOCKING_POLL_S=2.0):
        comm.inline_poll_s = 1e-6
        d = steady_delta(step, range(70, 73), range(73, 80))
    for k in xs:
        same(got[k], want[k], f"mid {k}")
    if d["steady_released"] != 7 or d["coordinator_messages"]:
        fail(f"1 MiB synchronous allreduces left the steady state: {d}")
    if d["express"] < 4 or d["caller_finished"] != d["express"]:
        fail(f"1 MiB synchronous allreduces on the express lane went to the finisher thread "
             f"({d['caller_finished']} of {d['express']} finished by their caller): {d}")


def changed_shape():
    shape_mismatch("r.sum")
    entered = counters()["steady_entered"]
    for k in range(40, 46):
        sync_step(k)
    if counters()["steady_entered"] <= entered:
        fail(f"did not return to the steady state: {counters()}")


def compacted():
    """A name whose signature changes on every call hands out a new cache bit each time (bits
    are never reused). Past steady.COMPACT_WIDTH bits handed out, "D" lists the live ones and
    the rounds carry only those: the rounds stay on the transport, as narrow as the live
    tensors, and release the right tensors (mapped back from their positions)."""
    from hvdlite.common.steady import COMPACT_WIDTH
    for k in range(COMPACT_WIDTH + 50):
        hvd.allreduce(torch.ones(1 + k % 2), name="r.churn", op=hvd.Sum)
    d = steady_delta(sync_step, range(50, 54), range(54, 62))
    st = basics._state.engine.steady.get(0)
    if st is None or st.slots is None or st.width > 16:
        fail(f"rounds not compacted after {COMPACT_WIDTH + 50} changed signatures: width "
             f"{st and st.width}, slots {st and st.slots}")
    if payloads and d["round_payloads"] < 8:
        fail(f"compacted rounds (bits at slot positions) did not carry the tensors: {d}")
    if d["coordinator_messages"] or d["steady_released"] != 24 \
            or d["transport_rounds"] != d["steady_rounds"]:
        fail(f"compacted steady steps: expected 24 tensors released by rounds on the "
             f"transport and no coordinator message: {d}")
    handles = [hvd.allreduce_async(gen(rank, (9,), torch.float32, salt=("cp", i)),
                                   name=f"r.cp{i}", op=hvd.Sum) for i in range(3)]
    for i, h in enumerate(handles):         # new names: full negotiation, then steady again
        same(hvd.synchronize(h), sum(gen(r, (9,), torch.float32, salt=("cp", i))
                                     for r in range(size)), f"after compaction {i}")


def payload():
    from hvdlite.common.protocol import INLINE_FLOATS
    steps = range(100, 110)
    # (name, shape, dtype, keyword arguments, carried in the round)
    cases = [("p.sum", (33,), torch.float32, {"op": hvd.Sum}, True),
             ("p.avg", (4, 4), torch.float32, {}, True),
             ("p.scaled", (3, 5), torch.float32,
              {"op": hvd.Sum, "prescale_factor": 0.5, "postscale_factor": 3.0}, True),
             ("p.full", (INLINE_FLOATS,), torch.float32, {"op": hvd.Sum}, True),
             ("p.over", (INLINE_FLOATS + 1,), torch.float32, {"op": hvd.Sum}, False),
             ("p.f64", (8,), torch.float64, {"op": hvd.Sum}, False),
             ("p.i32", (8,), torch.int32, {"op": hvd.Sum}, False),
             ("p.max", (8,), torch.float32, {"op": hvd.Max}, False)]

    def want(name, shape, dtype, kw, k):
        xs = [gen(r, shape, dtype, salt=(name, k)) for r in range(size)]
        if kw.get("op") == hvd.Max:
            return torch.stack(xs).max(0).values
        total = sum(x * kw.get("prescale_factor", 1.0) for x in xs)
        if "op" not in kw:
            return total / size
        return (total * kw.get("postscale_factor", 1.0)).to(dtype)

    for name, shape, dtype, kw, carried in cases:
        inputs = {k: gen(rank, shape, dtype, salt=(name, k)) for k in steps}
        got = {}

        def step(k: int) -> None:
            got[k] = hvd.allreduce(inputs[k], name=name, **kw)

        with long_spin():
            d = steady_delta(step, steps[:3], steps[3:])
        for k in steps:
            same(got[k], want(name, shape, dtype, kw, k), f"payload {name} {k}")
        n = len(steps) - 3
        if d["steady_released"] != n or d["coordinator_messages"]:
            fail(f"{name}: left the steady state: {d}")
        if carried and not (d["round_payloads"] == n and d["express"] >= n - 2):
            fail(f"{name}: expected its {n} allreduces carried by their rounds: {d}")
        if not carried and d["round_payloads"]:
            fail(f"{name}: a round carried a tensor it may not: {d}")
    # An asynchronous call that is all its rank has in flight: its caller drives the round
    # (engine.Engine._drive_inline) and the tensor rides in it; the handle completes from it.
    got = {}

    def async_step(k: int) -> None:
        x = gen(rank, (6,), torch.float32, salt=("pa", k))
        got[k] = hvd.synchronize(hvd.allreduce_async(x, name="p.async", op=hvd.Sum))

    with long_spin():
        d = steady_delta(async_step, steps[:3], steps[3:])
    for k in steps:
        same(got[k], sum(gen(r, (6,), torch.float32, salt=("pa", k)) for r in range(size)),
             f"payload async {k}")
    if d["round_payloads"] < 1:
        fail(f"no asynchronous call's round carried its tensor: {d}")


def grouped_payload():
    """A round carries every tensor it releases when they are all small float32 allreduces by
    sum or average (engine.Engine._carry): a blocking grouped allreduce of a few metrics (a 0-d
    one among them), in place and pre- and postscaled, one that fills the payload exactly, and
    a step's tensors submitted in one call finish with no data collective, each member equal
    to the reference. A group one element over the payload, one with a float64 member and one
    reduced by max go the usual way. Ranks that offer different tensors in one round (the
    same bits in other calls and orders, as a busy rank would) carry nothing in it and still
    reduce every tensor right, in the steady state."""
    from hvdlite.common.protocol import INLINE_FLOATS
    from hvdlite.torch.mpi_ops import _allreduce_batch_async
    f32, f64 = torch.float32, torch.float64
    steps = range(200, 210)
    cases = [  # name, shapes, dtypes, keyword arguments, how submitted, carried
        ("g.metrics", [(), (1,), (3,)], [f32] * 3, {}, "grouped", True),
        ("g.scaled", [(4, 4), (7,)], [f32] * 2,
         {"op": hvd.Sum, "prescale_factor": 0.5, "postscale_factor": 3.0}, "grouped_", True),
        ("g.full", [(INLINE_FLOATS - 10,), (10,)], [f32] * 2, {"op": hvd.Sum}, "grouped", True),
        ("g.batch", [(5,), (2, 3), (1,)], [f32] * 3, {"op": hvd.Sum}, "batch", True),
        ("g.over", [(INLINE_FLOATS - 10,), (11,)], [f32] * 2, {"op": hvd.Sum}, "grouped",
         False),
        ("g.f64", [(3,), (3,)], [f32, f64], {"op": hvd.Sum}, "grouped", False),
        ("g.max", [(3,), (3,)], [f32] * 2, {"op": hvd.Max}, "grouped", False),
    ]

    def want(name, i, shape, dtype, kw, k):
        return reduce_ref([gen(r, shape, dtype, salt=(name, i, k)) for r in range(size)],
                          kw.get("op", hvd.Average), kw.get("prescale_factor", 1.0),
                          kw.get("postscale_factor", 1.0))

    for name, shapes, dtypes, kw, how, carried in cases:
        members = list(zip(shapes, dtypes))
        inputs = {k: [gen(rank, sh, dt, salt=(name, i, k)) for i, (sh, dt) in enumerate(members)]
                  for k in steps}
        got = {}

        def step(k: int) -> None:
            xs = inputs[k]
            if how == "grouped":
                got[k] = hvd.grouped_allreduce(xs, name=name, **kw)
            elif how == "grouped_":
                ys = [x.clone() for x in xs]
                hvd.grouped_allreduce_(ys, name=name, **kw)
                got[k] = ys
            else:
                hs = _allreduce_batch_async([x.clone() for x in xs],
                                            [f"{name}.{i}" for i in range(len(xs))],
                                            kw["op"], 1.0, 1.0, hvd.global_process_set)
                got[k] = [hvd.synchronize(h) for h in hs]

        with long_spin():
            d = steady_delta(step, steps[:3], steps[3:])
        for k in steps:
            for i, (sh, dt) in enumerate(members):
                same(got[k][i], want(name, i, sh, dt, kw, k), f"{name} step {k} member {i}")
        n = (len(steps) - 3) * len(members)
        if d["steady_released"] != n or d["coordinator_messages"] or d["peer_messages"]:
            fail(f"{name}: left the steady state: {d}")
        if carried and d["round_payloads"] != n:
            fail(f"{name}: expected its {n} allreduces carried by their rounds: {d}")
        if not carried and d["round_payloads"]:
            fail(f"{name}: a round carried a tensor it may not: {d}")
        # A blocking grouped call its round carries runs start to end on the caller's thread
        # (engine.Engine.express_many); one it cannot carry, and a batch, never take that lane.
        calls = len(steps) - 3
        if carried and how != "batch" and d["express"] < calls - 2:
            fail(f"{name}: expected its {calls} calls on the express lane: {d}")
        if (not carried or how == "batch") and d["express"]:
            fail(f"{name}: took the express lane: {d}")

    # Different offers in one round. Rank 0 submits A and B in one call, then C; rank 1 A and
    # C, then B (the same count, other bits), or rank 1 A alone, then B and C (another count).
    # However the rounds fall, each tensor is reduced once, right, with no fallback.
    names = ["g.cA", "g.cB", "g.cC"]

    def crossed_step(k: int) -> None:
        xs = {nm: gen(rank, (4,), f32, salt=(nm, k)) for nm in names}
        if rank == 0:
            order = [["g.cA", "g.cB"], ["g.cC"]]
        elif k % 2:
            order = [["g.cA", "g.cC"], ["g.cB"]]
        else:
            order = [["g.cA"], ["g.cB", "g.cC"]]
        handles = {}
        for batch_names in order:
            hs = _allreduce_batch_async([xs[nm].clone() for nm in batch_names], batch_names,
                                        hvd.Sum, 1.0, 1.0, hvd.global_process_set)
            handles.update(zip(batch_names, hs))
            time.sleep(0.002)      # let the first call's round start with only its tensors
        for nm in names:
            same(hvd.synchronize(handles[nm]),
                 sum(gen(r, (4,), f32, salt=(nm, k)) for r in range(size)), f"{nm} step {k}")

    d = steady_delta(crossed_step, range(3), range(3, 13))
    if d["steady_released"] != 30 or d["coordinator_messages"] or d["steady_fallbacks"]:
        fail(f"crossed offers left the steady state: {d}")

    # Bits in another order than the call's: the first member's shape changes once, so its
    # new cache bit is above the second's, and the round packs the second first. Each member
    # must still get its own sum (they differ in shape and value), on the express lane.
    def order_step(k: int, first=(3,)) -> None:
        shapes = [first, (2,)]
        xs = [gen(rank, sh, f32, salt=("g.o", i, k)) for i, sh in enumerate(shapes)]
        got = hvd.grouped_allreduce(xs, name="g.o", op=hvd.Sum)
        for i, sh in enumerate(shapes):
            same(got[i], sum(gen(r, sh, f32, salt=("g.o", i, k)) for r in range(size)),
                 f"reordered step {k} member {i}")

    for k in range(3):
        order_step(k)
    order_step(3, first=(4,))                  # a new bit for the first member
    with long_spin():
        d = steady_delta(order_step, range(4, 7), range(7, 13))
    if d["round_payloads"] != 12 or d["express"] < 4 or d["coordinator_messages"]:
        fail(f"a group whose bits are out of call order left the lane: {d}")

    # The express lane handing a group to the general path. Rank 1 has another tensor in
    # flight when it makes the grouped call, so its round offers three bits while rank 0's
    # express lane offers two: nothing is carried, the group is released through the data
    # path on both, and the third tensor in the next round. Then rank 1 arrives 50 ms late,
    # past the lane's polling window (engine.BLOCKING_POLL_S): rank 0's round goes to the
    # round waiter, and the call still returns the right sums.
    pair = [(2,), (3,)]

    def pair_want(i, k):
        return sum(gen(r, pair[i], f32, salt=("g.h", i, k)) for r in range(size))

    def handoff_step(k: int, late: bool) -> None:
        xs = [gen(rank, sh, f32, salt=("g.h", i, k)) for i, sh in enumerate(pair)]
        c = gen(rank, (5,), f32, salt=("g.hc", k))
        c_want = sum(gen(r, (5,), f32, salt=("g.hc", k)) for r in range(size))
        if late and rank == 1:
            time.sleep(0.05)
        pending = hvd.allreduce_async(c, name="g.hc", op=hvd.Sum) if rank == 1 else None
        got = hvd.grouped_allreduce(xs, name="g.h", op=hvd.Sum)
        if rank == 1:
            same(hvd.synchronize(pending), c_want, f"handoff third step {k}")
        else:
            same(hvd.allreduce(c, name="g.hc", op=hvd.Sum), c_want, f"handoff third step {k}")
        for i in range(2):
            same(got[i], pair_want(i, k), f"handoff step {k} member {i}")

    d = steady_delta(lambda k: handoff_step(k, False), range(3), range(3, 9))
    if d["steady_released"] != 18 or d["coordinator_messages"] or d["steady_fallbacks"]:
        fail(f"a group handed from the express lane left the steady state: {d}")
    d = steady_delta(lambda k: handoff_step(k, True), range(9, 10), range(10, 13))
    if d["steady_released"] != 9 or d["coordinator_messages"] or d["steady_fallbacks"]:
        fail(f"a late peer's group left the steady state: {d}")


def reuse():
    """One name, its allreduce's signature changed (op, scale factors, shape, dtype) right after
    the set became steady on the plain call, through each way a named allreduce is submitted:
    blocking, asynchronous out of place and in place, in a batch (the DistributedOptimizer's
    deferred gradients), and as the first member of a blocking grouped call, out of place and
    in place. The requests kept for the name (ops._allreduce_request, ops._grouped_requests)
    are never reused for a different signature, so every call reduces as asked (a stale
    request would match the plain call's cache bit and be released as it); and a shape that
    differs across ranks on the asynchronous path and in a group still raises the
    coordinator's mismatch error on both ranks."""
    from hvdlite.torch.mpi_ops import _allreduce_batch_async
    plain = ({"op": hvd.Sum}, (6,), torch.float32)
    variants = [({}, (6,), torch.float32),
                ({"op": hvd.Sum, "prescale_factor": 2.0}, (6,), torch.float32),
                ({"op": hvd.Sum, "postscale_factor": 0.5}, (6,), torch.float32),
                ({"op": hvd.Sum}, (2, 3), torch.float32),
                ({"op": hvd.Sum}, (6,), torch.float64),
                ({"op": hvd.Max}, (6,), torch.float32)]

    def submit(how, x, name, kw):
        if how == "blocking":
            return hvd.allreduce(x, name=name, **kw)
        if how in ("grouped", "grouped_"):   # with a copy as second member: both must agree
            xs = [x, x.clone()]
            if how == "grouped":
                xs = hvd.grouped_allreduce(xs, name=name, **kw)
            else:
                hvd.grouped_allreduce_(xs, name=name, **kw)
            same(xs[1], xs[0], f"{name}: the second member")
            return xs[0]
        if how == "async":
            return hvd.synchronize(hvd.allreduce_async(x, name=name, **kw))
        if how == "async_":
            hvd.synchronize(hvd.allreduce_async_(x, name=name, **kw))
            return x
        op = kw.get("op", hvd.Average)
        [h] = _allreduce_batch_async([x], [name], op, kw.get("prescale_factor", 1.0),
                                     kw.get("postscale_factor", 1.0), hvd.global_process_set)
        hvd.synchronize(h)
        return x

    def call(how, kw, shape, dtype, salt):
        xs = [gen(r, shape, dtype, salt=salt) for r in range(size)]
        if kw.get("op") == hvd.Max:
            want = torch.stack(xs).max(0).values
        elif "op" not in kw:
            want = sum(xs) / size
        else:
            want = sum(x * kw.get("prescale_factor", 1.0) for x in xs) \
                * kw.get("postscale_factor", 1.0)
        same(submit(how, xs[rank].clone(), f"r.reuse.{how}", kw), want, f"reuse {how} {salt}")

    for how in ("blocking", "async", "async_", "batch", "grouped", "grouped_"):
        for i, variant in enumerate(variants):
            for k in range(6):
                call(how, *plain, salt=("rp", how, i, k))
            steady = basics._state.engine.steady.get(0) is not None
            call(how, *variant, salt=("rv", how, i))
            if not steady:
                fail(f"reuse {how} {i}: the set was not steady before the changed call: "
                     f"{counters()}")
    # Steady on the plain call again, then a shape that differs across ranks.
    for k in range(6):
        call("async_", *plain, salt=("rm", k))
    shape_mismatch("r.reuse.async_", lambda x, name: submit("async_", x, name, {"op": hvd.Sum}))
    call("async_", *plain, salt=("ra",))
    for k in range(6):
        call("grouped", *plain, salt=("rg", k))
    shape_mismatch("r.reuse.grouped.0", lambda x, name: submit(
        "grouped", x, "r.reuse.grouped", {"op": hvd.Sum}))
    call("grouped", *plain, salt=("rga",))


def interrupted():
    """A KeyboardInterrupt (Ctrl-C) reaches rank 0's caller while it polls, on its own thread:
    - its round (steady.TransportRound.advance): a blocking allreduce and a blocking grouped
      one on the express lane (express, express_many), and an asynchronous allreduce whose
      caller drives its round in enqueue (_drive_inline);
    - its transfer (Engine._poll_inline): a blocking average too large for the round's
      payload (the express lane's data path; the division follows the transfer) and a blocking
      broadcast (_execute, run from the caller's drive);
    - its wait for the handle (Handle.wait), after the lane handed the call to the general path
      (the peer 0.3 s late): a case for every transport, since any blocking call may wait so.
    The caller gets it; the round or the collective it left still ends (engine._left_lane,
    _left_transfer), the interrupted tensor gets its result, and both ranks go on reducing the
    same names right, with no hang and no name left taken. On the code before, the job hung at
    the next call in each case."""
    from hvdlite.common import steady
    advance = steady.TransportRound.advance
    poll = engine.execution.Execution.__dict__["_poll_inline"]
    wait_signal = engine.Completion._wait_signal
    armed = {}

    def interrupting(where):
        def raise_once():
            if armed.pop(where, False) and \
                    threading.current_thread() is threading.main_thread():
                raise KeyboardInterrupt(f"injected: Ctrl-C while polling the {where}")
        return raise_once

    at_round, at_transfer = interrupting("round"), interrupting("transfer")
    at_wait = interrupting("wait")

    def waiting(self, timeout):
        at_wait()
        return wait_signal(self, timeout)

    def advancing(self):
        at_round()
        return advance(self)

    def polling(gen, box, poll_s):
        at_transfer()
        return poll.__func__(gen, box, poll_s)

    def one(k, how):
        def made(r, n):
            return gen(r, (n,), torch.float32, salt=("ki", how, k, n))
        sizes = {"grouped": (40, 3), "big": (100_000,), "broadcast": (100_000,)}.get(how, (40,))
        xs = [made(rank, n) for n in sizes]
        if how == "broadcast":
            return (lambda: hvd.broadcast_(xs[0], 1, name="r.ki.b")), xs, [made(1, sizes[0])]
        want = [sum(made(r, n) for r in range(size)) for n in sizes]
        if how == "grouped":
            return (lambda: hvd.grouped_allreduce_(xs, name="r.ki.g", op=hvd.Sum)), xs, want
        if how == "async":
            return (lambda: hvd.synchronize(hvd.allreduce_async_(xs[0], name="r.ki.a",
                                                                 op=hvd.Sum))), xs, want
        if how == "big":         # (an average: the division follows the transfer)
            return (lambda: hvd.allreduce_(xs[0], name="r.ki.big")), xs, [want[0] / size]
        return (lambda: hvd.allreduce_(xs[0], name=f"r.ki.{how}", op=hvd.Sum)), xs, want

    steady.TransportRound.advance = advancing
    engine.Engine._poll_inline = staticmethod(polling)
    engine.Completion._wait_signal = waiting
    try:
        for how in ("one", "grouped", "async", "big", "broadcast", "wait"):
            where = {"big": "transfer", "broadcast": "transfer", "wait": "wait"}.get(how, "round")
            left = None
            for k in range(12):
                call, xs, want = one(k, how)
                interrupt = rank == 0 and k == 6
                hvd.allreduce(torch.zeros(1), name="r.ki.sync")
                if rank == 1 and k == 6 and where != "transfer":
                    # Rank 0 is polling (or, 0.3 s late, waiting) when the interrupt comes.
                    time.sleep(0.3 if where == "wait" else 0.05)
                before = counters()
                if interrupt:
                    armed[where] = True
                try:
                    # (The transfer is polled by the caller only where the round ended within
                    # the caller's window: 2 s here, so that a descheduled peer still makes it.)
                    with long_spin() if where == "transfer" else contextlib.nullcontext(), \
                            engine_windows(BLOCKING_POLL_S=2.0 if where == "transfer" else
                                           engine.windows.BLOCKING_POLL_S):
                        call()
                except KeyboardInterrupt:
                    if not interrupt:
                        raise
                    left = (xs, want)
                else:
                    if interrupt:
                        fail(f"the injected interrupt never came ({how}, step {k})")
                    for x, w in zip(xs, want):
                        same(x, w, f"after an interrupt ({how}) step {k}")
                if interrupt:
                    continue
                # (Blocking calls poll for BLOCKING_POLL_S; an asynchronous one only for the
                # spin window, which a descheduled peer may miss.)
                if k > 6 and rank == 0 and how in ("one", "grouped", "big") \
                        and counters()["express"] == before["express"]:
                    fail(f"the express lane stayed shut after the interrupt ({how}): step {k}")
            if left is not None:
                for x, w in zip(*left):
                    same(x, w, f"the interrupted call's result ({how})")
    finally:
        steady.TransportRound.advance = advance
        engine.Engine._poll_inline = poll
        engine.Completion._wait_signal = wait_signal


check("inline", inline)
check("express", express)
check("waiter", waiter)
check("async", async_step)
check("crossed", crossed)
check("large", large)
check("changed_shape", changed_shape)
check("compacted", compacted)
check("reuse", reuse)
if payloads:
    check("payload", payload)
    check("grouped_payload", grouped_payload)
# (After compacted: these names would add cache bits to the set it counts.)
check("late_peer", late_peer)
check("busy_engine", busy_engine)
check("batch", batch)
check("mid", mid)
check("interrupted", interrupted)
print("COUNTERS", counters(), flush=True)
finish()
hvd.shutdown()
no_threads_left()
