"""Single-process checks of pure pieces of the engine (the multi-process tests cover the rest)."""
import math

import pytest
import torch

from hvdlite.common.backends.base import PollableWork
from hvdlite.common.collectives import FusionBuffer
from hvdlite.common.fusion import fuse_responses
from hvdlite.common.messages import ALLREDUCE, BROADCAST, Response


def test_fusion_buffers_are_lent_and_reused_without_comparing_tensors():
    pool = FusionBuffer()
    bufs = [pool.acquire(n) for n in (1 << 20, 3 << 20, 1 << 16, 2 << 20, 5 << 20, 1 << 18)]
    assert len({id(b) for b in bufs}) == len(bufs)
    for b in bufs:
        pool.release(b)
    again = pool.acquire(2 << 20)           # the smallest idle buffer that fits
    assert again.numel() >= 2 << 20 and any(again is b for b in bufs)
    pool.release(again)
    assert sum(len(v) for v in pool._free.values()) <= FusionBuffer.KEEP


def _resp(name, dtype="float32", n=4, rtype=ALLREDUCE, root=-1):
    return Response(type=rtype, names=[name], dtype=dtype, shapes=[(n,)], root_rank=root,
                    cache_bits=[-1])


def test_fusion_respects_threshold_dtype_and_looks_ahead():
    rs = [_resp("a"), _resp("h1", "float16"), _resp("b"), _resp("h2", "float16"),
          _resp("big", n=1000)]
    fused = fuse_responses(rs, threshold=64)
    names = [f.names for f in fused]
    assert names[0] == ["a", "b"]            # looked past the fp16 tensor
    assert ["h1", "h2"] in names
    assert ["big"] in names                  # over the threshold: alone
    assert fuse_responses(rs, threshold=0) == rs or all(len(f.names) == 1 for f in
                                                        fuse_responses(rs, threshold=0))


def test_broadcasts_fuse_only_with_the_same_root():
    rs = [_resp("x", rtype=BROADCAST, root=0), _resp("y", rtype=BROADCAST, root=1),
          _resp("z", rtype=BROADCAST, root=0)]
    names = [f.names for f in fuse_responses(rs, threshold=1 << 20)]
    assert names == [["x", "z"], ["y"]]


def test_pack_and_unpack_round_trip_fused_groups_with_zeros_and_strides():
    from hvdlite.common.collectives import pack, unpack
    a, b, c = torch.arange(6.).view(2, 3), torch.arange(4.) + 10, torch.arange(3.) - 5
    counts = [6, 4, 3]
    buf = torch.empty(13)
    pack(buf, [a, b, c], counts)                      # one torch.cat
    assert torch.equal(buf, torch.cat([a.reshape(-1), b, c]))
    pack(buf, [a, None, c], counts)                   # a joined rank's zeros: the loop
    assert torch.equal(buf[6:10], torch.zeros(4)) and torch.equal(buf[10:], c)
    out_a = torch.empty(3, 2).t()                     # non-contiguous destination
    out_c = torch.empty(3)
    unpack(torch.arange(13.), [out_a, None, out_c], counts)
    assert torch.equal(out_a, torch.arange(6.).view(2, 3))
    assert torch.equal(out_c, torch.arange(10., 13.))
    unpack(torch.arange(13.), [out_a, None, out_c], counts, 0.5)     # Average's 1/size
    assert torch.equal(out_a, torch.arange(6.).view(2, 3) * 0.5)
    ints = [torch.empty(2, dtype=torch.int32), torch.empty(1, dtype=torch.int32)]
    unpack(torch.tensor([3, 5, 7], dtype=torch.int32), ints, [2, 1], 0.5)
    assert ints[0].tolist() == [1, 2] and ints[1].tolist() == [3]     # truncated, as Horovod


@pytest.mark.parametrize("views", ["torch", "loop"])
def test_unpack_matches_a_member_by_member_copy_for_every_float_dtype_and_size(monkeypatch, views):
    """unpack's one-call views, and its multi-tensor scaling of small members, give the bits a
    member-by-member torch.mul gives: for float32/64 (scaled after the copy when small) and
    16-bit floats (always torch.mul), with skipped, non-contiguous and empty outputs."""
    from hvdlite.common import collectives, flat
    if views == "loop":                                 # as if torch dropped its helper
        monkeypatch.setattr(flat, "_unflatten", None)
    g = torch.Generator().manual_seed(0)
    layouts = [[(2, 3), (4,), (), (0,), (5, 1)],        # small members: scaled in one call
               [(300, 100), (7,), (128, 128)]]          # large ones: one torch.mul each
    for shapes in layouts:
        counts = [math.prod(s) for s in shapes]
        base = torch.randn(sum(counts), generator=g)
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            buf = base.to(dtype)
            for scale in (1.0, 0.5, 1 / 3):
                for skip in (None, 1):
                    outs = [None if i == skip else
                            (torch.zeros(s[::-1], dtype=dtype).t() if len(s) == 2
                             else torch.zeros(s, dtype=dtype)) for i, s in enumerate(shapes)]
                    collectives.unpack(buf, outs, counts, scale)
                    at = 0
                    for out, s, n in zip(outs, shapes, counts):
                        if out is not None:
                            want = torch.mul(buf[at:at + n].view(s), scale)
                            assert torch.equal(out, want), (shapes, dtype, scale, s)
                        at += n


def test_fusion_buffers_are_aligned_for_every_dtype():
    buf = FusionBuffer().acquire(5 << 20)
    assert buf.data_ptr() % 64 == 0 and buf.numel() >= 5 << 20
    buf[:8].view(torch.float64).fill_(1.5)            # any dtype may be viewed on it


class _Work(PollableWork):
    """A transport request completing after `polls` tests (the polling logic alone)."""

    def __init__(self, polls: int, error: Exception | None = None):
        self.polls, self.error, self.waited = polls, error, False

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls <= 0

    def wait(self) -> None:
        self.waited = True
        if self.error is not None:
            raise self.error


def test_inline_poll_finishes_quick_work_and_hands_over_slow_work():
    from hvdlite.common.engine import Engine
    steps = []

    def gen(works):
        for w in works:
            yield w
            steps.append(w)

    def boxed(g):
        return [next(g)]

    quick = [_Work(3), _Work(2)]                      # two phases, both quick
    g = gen(quick)
    assert Engine._poll_inline(g, boxed(g), 1.0) is None
    assert steps == quick and all(w.waited for w in quick)

    steps.clear()
    first, slow = _Work(1), _Work(10 ** 9)
    g = gen([first, slow])
    box = boxed(g)
    assert Engine._poll_inline(g, box, 0.001) is slow    # deadline: back to the finisher
    # The box names the work the generator waits on now (what an interrupted caller hands
    # over: Engine._left_transfer).
    assert box == [slow] and not slow.waited and steps == [first]

    g = gen([_Work(1, RuntimeError("peer gone"))])
    try:
        Engine._poll_inline(g, boxed(g), 1.0)
    except RuntimeError as exc:
        assert "peer gone" in str(exc)
    else:
        raise AssertionError("a transport error must propagate")


def test_a_signal_during_a_hold_comes_out_at_its_release(monkeypatch):
    """interrupts.hold/release (engine.Engine._read_peers applies a peer's messages inside
    one): a real SIGINT sent inside a hold raises nothing there and KeyboardInterrupt at the
    last release; outside a hold it raises at once as before; a handler installed later is
    wrapped by the next hold; unwrap() puts the handlers back; off the main thread a hold is
    a no-op."""
    import os
    import signal
    import threading

    from hvdlite.common import interrupts
    before = signal.getsignal(signal.SIGINT)
    # Python's own handler (a test before may have left another: Ray Train installs one).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(interrupts, "RECHECK_S", 0.0)    # (every hold looks at the handlers)
    try:
        assert interrupts.hold()
        assert interrupts.hold()                       # nested
        os.kill(os.getpid(), signal.SIGINT)
        steps = [1, 2, 3]                              # (bytecodes: the handler ran, deferred)
        interrupts.release()                           # the inner one: still held
        with pytest.raises(KeyboardInterrupt):
            interrupts.release()
        assert steps == [1, 2, 3]
        # Outside a hold the wrapped handler runs at once.
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):
                pass
        # A handler installed since is wrapped by a later hold (RECHECK_S: at once here), and
        # runs at the release.
        seen = []
        signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
        assert interrupts.hold()
        os.kill(os.getpid(), signal.SIGINT)
        assert seen == []
        interrupts.release()
        assert seen == [signal.SIGINT]
        # A signal whose handler was reset to an action meanwhile gets that action (here:
        # ignored) at the release.
        usr2 = signal.getsignal(signal.SIGUSR2)
        signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
        try:
            assert interrupts.hold()
            os.kill(os.getpid(), signal.SIGUSR2)
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
            interrupts.release()
            assert seen == [signal.SIGINT]
        finally:
            signal.signal(signal.SIGUSR2, usr2)
        interrupts.unwrap()
        assert signal.getsignal(signal.SIGINT).__class__ is not interrupts._Wrapper
        off_main = []
        t = threading.Thread(target=lambda: off_main.append(interrupts.hold()))
        t.start()
        t.join()
        assert off_main == [False]
    finally:
        interrupts.unwrap()
        signal.signal(signal.SIGINT, before)


def test_handle_wait_interrupted_gives_the_handle_up_once_its_own_timeout_does_not():
    """An exception from outside the wait (Ctrl-C) hands the handle to the engine's
    _on_abandon, which frees its names on completion (Engine._orphan); the wait's own
    TimeoutError leaves the handle usable and its names taken, as documented."""
    from types import SimpleNamespace

    from hvdlite.common.engine import Entry, Completion
    h = Completion([Entry(SimpleNamespace(name="t"))])
    given_up = []
    h._on_abandon = given_up.append
    try:
        h.wait(timeout=0.01)
    except TimeoutError:
        pass
    else:
        raise AssertionError("an unfinished handle must time out")
    assert given_up == []

    def interrupt(_handle):
        raise KeyboardInterrupt
    h._on_wait = interrupt
    for _ in range(2):
        try:
            h.wait(timeout=0.01)
        except KeyboardInterrupt:
            pass
        except TimeoutError:
            pass
        h._on_wait = interrupt
    assert given_up == [h]                 # once: the hook is spent


def test_bucket_planner_cuts_the_last_pass_like_ddp_and_releases_complete_buckets():
    from hvdlite.common.buckets import BucketPlanner
    mb = 1 << 20
    plan = BucketPlanner(cap_bytes=4 * mb, first_bytes=mb)
    step = [("g3", mb // 2), ("g2", mb), ("g1", 3 * mb), ("g0", 2 * mb)]
    t = 0.0
    for name, n in step:                               # first pass: no plan, nothing held
        assert plan.observe(0, name, n, t) == (False, -1)
        t += 0.01
    # Second pass: bucket 0 = g3 + g2 (>= 1 MiB), bucket 1 = g1 + g0 (>= 4 MiB).
    assert plan.observe(0, "g3", mb // 2, 1.0) == (True, 0)     # held for g2
    assert not plan.complete(0, 0)
    assert plan.observe(0, "g2", mb, 1.01) == (False, -1)       # completes bucket 0
    assert plan.complete(0, 0)
    assert plan.observe(0, "g1", 3 * mb, 1.02) == (False, 1)
    assert plan.observe(0, "g0", 2 * mb, 1.03) == (False, -1)
    assert plan.observe(0, "new", 8, 1.04) == (False, -1)       # not in the plan: goes at once
    assert plan.observe(7, "g3", 8, 1.05) == (False, -1)        # another set: its own plan
    assert 0.05 <= plan.hold_s(0) <= 1.0
    assert not BucketPlanner(0, mb).enabled


def test_bucket_sizes_follow_how_many_ranks_share_the_cores():
    """No core to spare per rank: a pass of CPU tensors is one bucket, so every gradient of a
    step is held until the last one. A core to spare, sizes the user chose, buckets turned off
    or a pass with a GPU tensor: DDP's buckets."""
    from hvdlite.common.buckets import BucketPlanner, whole_pass_on_host
    mb = 1 << 20
    assert whole_pass_on_host(25 * mb, False, 2, 2)
    assert whole_pass_on_host(25 * mb, False, 4, 2)
    assert not whole_pass_on_host(25 * mb, False, 1, 2)
    assert not whole_pass_on_host(25 * mb, False, 2, 16)
    assert not whole_pass_on_host(25 * mb, True, 4, 2)
    assert not whole_pass_on_host(0, False, 4, 2)
    step = [("g3", 300 * mb), ("g2", mb), ("g1", 3 * mb), ("g0", 2 * mb)]

    def second_pass(plan: BucketPlanner, on_device: bool) -> list:
        for name, n in step:                           # first pass: learn it
            plan.observe(0, name, n, 0.0, on_device=on_device)
        return [plan.observe(0, name, n, 1.0, on_device=on_device)[1] for name, n in step]

    assert second_pass(BucketPlanner(25 * mb, mb, True), False) == [0, 0, 0, -1]  # one bucket
    # DDP's: g3 fills the first bucket alone, then g2..g0 go as the second.
    assert second_pass(BucketPlanner(25 * mb, mb, True), True) == [-1, 1, 1, -1]
    assert second_pass(BucketPlanner(25 * mb, mb, False), False) == [-1, 1, 1, -1]


def test_small_cpu_buckets_where_every_rank_has_cores_to_spare_and_shares_memory():
    """A one-host job through shared memory whose ranks have two cores or more cuts a pass of
    CPU tensors at 4 MiB, so transfers overlap backpropagation; over the network, with fewer
    cores, with the user's sizes or with buckets off the cap stays; a GPU pass keeps DDP's."""
    from hvdlite.common import basics
    from hvdlite.common.buckets import SPARE_CORES_CAP_BYTES, BucketPlanner, cpu_cap_on_host
    from hvdlite.common.config import Settings
    mb = 1 << 20
    assert SPARE_CORES_CAP_BYTES == 4 * mb
    assert cpu_cap_on_host(25 * mb, False, 2, 16, True) == 4 * mb
    assert cpu_cap_on_host(25 * mb, False, 2, 4, True) == 4 * mb
    assert cpu_cap_on_host(2 * mb, False, 2, 16, True) == 2 * mb       # never larger
    assert cpu_cap_on_host(25 * mb, False, 2, 3, True) == 25 * mb      # under 2 cores a rank
    assert cpu_cap_on_host(25 * mb, False, 2, 2, True) == 25 * mb
    assert cpu_cap_on_host(25 * mb, False, 2, 16, False) == 25 * mb    # over the network
    assert cpu_cap_on_host(25 * mb, True, 2, 16, True) == 25 * mb      # the user's choice
    assert cpu_cap_on_host(0, False, 2, 16, True) == 0                 # buckets off
    # The MLP of benchmarks/train_step.py in backward order: one bucket for the last three
    # gradients at DDP's cap, one each at 4 MiB; a pass with a GPU tensor keeps DDP's cut.
    step = [("l5", 41_000), ("l4", 4 * mb), ("l3", 4 * mb), ("l2", 4 * mb), ("l1", 2 * mb)]

    def buckets(plan: BucketPlanner, on_device: bool = False) -> list:
        for name, n in step:
            plan.observe(0, name, n, 0.0, on_device=on_device)
        return [plan.observe(0, name, n, 1.0, on_device=on_device)[1] for name, n in step]

    assert buckets(BucketPlanner(25 * mb, mb)) == [0, -1, 1, 1, -1]
    assert buckets(BucketPlanner(25 * mb, mb, cpu_cap_bytes=4 * mb)) == [0, -1, -1, -1, -1]
    assert buckets(BucketPlanner(25 * mb, mb, cpu_cap_bytes=4 * mb), True) == [0, -1, 1, 1, -1]
    # What init decides, from the host's cores and the job's data path (a copy each time).
    base = Settings()
    spare = basics._settings_for_host(base, 2, True, cores=16)
    assert spare.cpu_bucket_cap_bytes == 4 * mb and not spare.cpu_whole_pass
    assert base.cpu_bucket_cap_bytes is None
    assert basics._settings_for_host(base, 2, False, cores=16) is base
    tight = basics._settings_for_host(spare, 2, True, cores=2)
    assert tight.cpu_whole_pass and tight.cpu_bucket_cap_bytes is None


def test_bucket_planner_aligns_passes_to_waits_and_keeps_a_plan_per_pass_shape():
    """Learning began mid-step (g1, g0 | g3, g2, ...): without the wait boundary every bucket
    straddled two steps and never completed. A metric allreduce between steps keeps its own
    plan and does not overwrite the gradients' one."""
    from hvdlite.common.buckets import BucketPlanner
    mb = 1 << 20
    plan = BucketPlanner(cap_bytes=4 * mb, first_bytes=mb)
    step = [("g3", mb // 2), ("g2", mb), ("g1", 3 * mb), ("g0", 2 * mb)]
    t = 0.0
    for name, n in step[2:]:                           # joined mid-step
        plan.observe(0, name, n, t)
    for k in range(3):
        for i, (name, n) in enumerate(step):           # step() waited before each step
            plan.observe(0, name, n, t, boundary=(i == 0))
            t += 0.01
        plan.observe(0, "loss", 4, t, boundary=True)  # a synchronous metric after step()
    got = [plan.observe(0, name, n, t, boundary=(i == 0)) for i, (name, n) in enumerate(step)]
    assert got == [(True, 0), (False, -1), (False, 1), (False, -1)], got
    assert plan.observe(0, "loss", 4, t, boundary=True) == (True, -1)


def test_bucket_planner_reuses_a_repeated_pass_and_recuts_a_changed_one():
    """A pass equal to the one its plan was cut from keeps that plan (no recut per step); a
    changed size, order or bucket limit (the autotuner's) cuts a new one."""
    from hvdlite.common.buckets import BucketPlanner
    mb = 1 << 20
    plan = BucketPlanner(cap_bytes=4 * mb, first_bytes=mb)
    step = [("g3", mb // 2), ("g2", mb), ("g1", 3 * mb), ("g0", 2 * mb)]

    def run(steps, t0=0.0):
        got = []
        for name, n in steps:
            got.append(plan.observe(0, name, n, t0))
        return got

    run(step)
    run(step)                                          # cuts the first pass's plan
    learned = plan._sets[0].plans["g3"]
    for k in range(3):
        assert run(step) == [(True, 0), (False, -1), (False, 1), (False, -1)]
        assert plan._sets[0].plans["g3"] is learned    # reused, not rebuilt
    changed = [("g3", mb // 2), ("g2", mb), ("g1", 5 * mb), ("g0", 2 * mb)]
    run(changed)                                       # cuts the repeated pass: still equal
    run(step)                                          # cuts `changed`: a new plan
    assert plan._sets[0].plans["g3"] is not learned
    assert plan._sets[0].plans["g3"].sizes == [2, 1, 1]
    run(step)                                          # cuts `step` again
    plan.cap_bytes = 64 * mb                           # the autotuner changed the cap
    run(step)                                          # equal pass, other limits: recut
    assert plan._sets[0].plans["g3"].sizes == [2, 2]
    assert run(step)[0] == (True, 0)
    # A single tensor called again and again (a synchronous allreduce in a loop).
    for _ in range(3):
        assert plan.observe(0, "loss", 4, 0.0, boundary=True)[1] == -1


def test_engine_handle_latch_wakes_every_waiter_once_and_times_out_cleanly():
    """engine.Completion completes through a flag and a held lock (cheaper than an Event): every
    waiter wakes, a timeout leaves the handle usable, a late failure changes nothing."""
    import threading
    import time

    import pytest

    from hvdlite.common.engine import Entry, Completion
    from hvdlite.common.messages import Request

    entries = [Entry(Request(rank=0, name=f"t{i}", type=ALLREDUCE)) for i in range(2)]
    h = Completion(entries)
    assert not h.done()
    with pytest.raises(TimeoutError):
        h.wait(timeout=0)
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.05)
    fired, got = [], []
    h.add_callback(lambda: fired.append(1))
    waiters = [threading.Thread(target=lambda: got.append(h.wait(timeout=10)))
               for _ in range(4)]
    for t in waiters:
        t.start()
    time.sleep(0.05)
    for i, e in enumerate(entries):
        e.result = i
        h._complete_one()
    for t in waiters:
        t.join(10)
    assert got == [[0, 1]] * 4 and h.done() and fired == [1]
    h._fail("late")                       # already complete: no error, no second callback
    assert h.error is None and fired == [1] and h.wait(timeout=0) == [0, 1]
    h.add_callback(lambda: fired.append(2))   # after completion: at once
    assert fired == [1, 2]
    failed = Completion([Entry(Request(rank=0, name="f", type=ALLREDUCE))])
    failed._fail("boom")
    from hvdlite.common.exceptions import HorovodInternalError
    with pytest.raises(HorovodInternalError, match="boom"):
        failed.wait(timeout=1)


def test_claimed_site_names_a_blocking_call_by_its_line():
    """naming.claimed_site: one stable name per line (cacheable), unless the same line is in a
    call on another thread right now; then None (the caller falls back to a counted name)."""
    from hvdlite.common import naming

    def claim(sid=0):
        return naming.claimed_site("allreduce", sid)    # every call: this line

    with claim() as first:
        assert first is not None and first.startswith("allreduce.noname.test_units.py:")
        assert not first.rsplit(":", 1)[1].count(".")   # no per-call counter
        with claim() as busy:
            assert busy is None                         # still in progress
        with claim(3) as other_set:
            assert other_set == first                   # another set is another key
    with claim() as again:
        assert again == first                           # released on the way out
    with naming.claimed_site("allreduce", wanted=False) as unwanted:
        assert unwanted is None


def test_arith_folds_in_rank_order_and_truncates_integers_on_every_path():
    """arith.reduce_in_order adds the ranks' parts in rank order for torch and numpy alike (the
    shared-memory path, its rounds' payloads and the control connections' payloads use it, so
    every path gives the same bits); scale_ and copy_scaled truncate integers as Horovod does,
    and copy_scaled never writes its source (memory other ranks still read)."""
    import numpy as np

    from hvdlite.common.arith import copy_scaled, reduce_in_order, scale_
    # float32: (1e8 + 1) - 1e8 is 0 (1e8 + 1 rounds to 1e8), (1e8 - 1e8) + 1 is 1.
    parts = [torch.tensor([1e8, 2.0]), torch.tensor([1.0, 3.0]), torch.tensor([-1e8, 4.0])]
    out = torch.empty(2)
    assert reduce_in_order(torch.add, parts, out) is out and out.tolist() == [0.0, 9.0]
    other = [parts[0], parts[2], parts[1]]
    assert reduce_in_order(torch.add, other, torch.empty(2)).tolist() == [1.0, 9.0]
    arrays = [p.numpy() for p in parts]
    assert reduce_in_order(np.add, arrays, np.empty(2, np.float32)).tolist() == [0.0, 9.0]
    assert reduce_in_order(torch.maximum, parts, torch.empty(2)).tolist() == [1e8, 4.0]
    ints = torch.tensor([3, -3, 7])
    scale_(ints, 0.5)
    assert ints.tolist() == [1, -1, 3]
    src, dst = torch.tensor([5, 9]), torch.empty(2, dtype=torch.int64)
    copy_scaled(dst, src, 0.5)
    assert dst.tolist() == [2, 4] and src.tolist() == [5, 9]
    fsrc, fdst = torch.tensor([1.0, 3.0]), torch.empty(2)
    copy_scaled(fdst, fsrc, 0.25)
    assert fdst.tolist() == [0.25, 0.75] and fsrc.tolist() == [1.0, 3.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_scale_gives_torchs_bits_on_every_path_and_bumps_the_version(dtype):
    """scale_ multiplies small CPU float32/float64 tensors through NumPy (cheaper than torch's
    dispatch) and everything else with torch: the bits must be mul_'s on either side of the
    size limit, for factors that do not round exactly, and the version counter must move as
    mul_ moves it, so autograd still refuses a saved tensor that was scaled in place."""
    from hvdlite.common import arith
    g = torch.Generator().manual_seed(0)
    for n in (1, 1000, arith.NUMPY_SCALE_MAX, arith.NUMPY_SCALE_MAX + 1):
        x = (torch.randn(n, generator=g, dtype=torch.float64) * 1e3).to(dtype)
        for factor in (1 / 3, 1 / 7, 0.1, 3.7, 1 / 6):
            want, got = x.clone(), x.clone()
            want.mul_(factor)
            version = got._version
            arith.scale_(got, factor)
            assert torch.equal(want, got), (n, factor)
            assert got._version > version
    view = torch.arange(12, dtype=dtype)[2:8]          # a contiguous view at an offset
    arith.scale_(view, 0.5)
    assert view.tolist() == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    strided = torch.ones(4, 4, dtype=dtype).t()[1]      # not contiguous: torch's path
    arith.scale_(strided, 0.5)
    assert strided.tolist() == [0.5] * 4
    w = torch.ones(3, dtype=dtype, requires_grad=True)
    saved = torch.ones(3, dtype=dtype)
    loss = (w * saved).sum()                            # autograd saved `saved`
    arith.scale_(saved, 0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_hang_report_skips_collectives_that_already_failed():
    """The hang report names the first collective still in progress on each rank: one that
    failed earlier (a mismatch the job went on from) is over, not the one waited on."""
    from hvdlite.common.flight_report import divergence

    def rec(name, state):
        return {"name": name, "op": "allreduce", "shape": [2], "dtype": "float32",
                "process_set": 0, "state": state}

    old = rec("mismatch.shape", "failed")
    dumps = {0: {"records": [old, rec("step.1", "done"), rec("loss", "started")]},
             1: {"records": [old, rec("step.1", "done"), rec("grad.w", "enqueued")]}}
    text = divergence(dumps)
    assert "rank 0: allreduce 'loss'" in text and "rank 1: allreduce 'grad.w'" in text, text
    assert "mismatch.shape" not in text, text
    dumps[1]["records"][-1] = rec("loss", "enqueued")
    assert "waits on the same collective: allreduce 'loss'" in divergence(dumps)
    assert divergence({0: {"records": [old]}, 1: {"records": [old]}}) is None


def test_a_gpu_response_builds_the_communicator_on_this_ranks_own_gpu():
    """A response carries the device index of the request it was built from (the first rank's);
    the communicator must be built on this rank's GPU, named by its own requests (on a host of
    several GPUs rank 1 built its NCCL communicator on cuda:0, found itself "sharing" GPU 0 and
    was moved to host memory), and a joined rank with no tensor in it takes its current device."""
    from hvdlite.common.engine import Entry, own_device
    from hvdlite.common.messages import Request

    resp = Response(type=ALLREDUCE, names=["w", "b"], shapes=[(4,), (2,)], device=0)
    mine = [Entry(request=Request(rank=1, name=n, type=ALLREDUCE, shape=s, device=3))
            for n, s in (("w", (4,)), ("b", (2,)))]
    assert own_device(resp, mine) == 3
    assert own_device(resp, [None, mine[1]]) == 3
    assert own_device(resp, [None, None]) == -1          # joined: the current device
    cpu = Response(type=ALLREDUCE, names=["w"], shapes=[(4,)])
    assert own_device(cpu, [Entry(request=Request(rank=1, name="w", type=ALLREDUCE, shape=(4,)))]) == -1
