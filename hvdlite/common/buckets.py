"""Gradient buckets: hold a step's cached allreduces back until a bucket of them is complete.

Why: a training step submits its gradients one by one as backpropagation produces them, and
the steady state (steady.py) releases whatever every rank has submitted at each round, so a
step's gradients went out as many small fused groups. Each transport call has a fixed cost
that does not shrink with its size (gloo: 0.6-0.9 ms for anything up to 1 MiB on this project's
machine), and on a machine with few cores the early groups' transfers also take the core from
the rank still computing its backward pass. torch DDP avoids both with buckets: a fixed plan of
~25 MB groups in gradient order, each sent once complete. Measured with 2 ranks on gloo, holding
a step's gradients until complete took the step from 1.26 / 1.27 / 1.21 x DDP to 1.17 / 1.07 /
1.05 x (MLP / CNN / transformer).

How: the planner learns, per process set, the order and sizes in which one pass (one training
step) submits its allreduces. A pass ends where a caller waited for results since the last
submission (the optimizer's step() synchronizing), or where a name comes back. Aligning passes
to waits matters: a pass learned from the middle of one step to the middle of the next (the
steady state begins at an arbitrary point) made every bucket straddle two steps, so none ever
completed and every gradient went out on its own. Each pass shape is kept under its first name,
so a loop that alternates shapes (gradients, then a metric allreduce) keeps a plan for each.
From a pass it cuts buckets as DDP does (the first one small, HVDLITE_FIRST_BUCKET_MB, so
transfer starts early; then about HVDLITE_BUCKET_CAP_MB each). An entry is held until every
tensor of its bucket has been submitted in this pass. It is released at once when there is no
plan yet, when its name is not in the plan (the pattern changed), when someone waits on its
handle (a synchronous call or `synchronize()` never waits for a bucket), or after a deadline
(1.5 x the last pass's span, between 50 ms and 1 s). Holding is rank-local: what is released
still goes through the steady state's rounds, which release only what every rank has, so a rank
that buckets differently is slower, never wrong. HVDLITE_BUCKET_CAP_MB=0 turns buckets off.

A host with no more cores than ranks sends a pass of CPU tensors as one bucket
(whole_pass_on_host): no rank has a core to spare there, so a transfer that overlaps
backpropagation only takes the core from it (and MPI's waits poll), while the whole step still
ends with the slowest rank. A pass with a GPU tensor keeps DDP's buckets: its backpropagation
runs on the GPU, and the overlap is what hides the transfer. Where a pass is one bucket, the
torch optimizer submits a backward pass's gradients together when it ends (ops.whole_pass),
since each would wait here for the last one anyway.

The other way round, a one-host job whose ranks each have two cores or more, with its data in
shared memory, cuts a pass of CPU tensors into buckets of SPARE_CORES_CAP_BYTES
(cpu_cap_on_host): a transfer there costs tens of microseconds beyond its bytes, not the
network's milliseconds DDP's 25 MB were chosen for, and smaller buckets start sooner and overlap
more of backpropagation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class _Plan:
    """Buckets cut from one learned pass."""

    bucket_of: dict = field(default_factory=dict)    # name -> bucket index
    sizes: list = field(default_factory=list)        # names per bucket
    span_s: float = 0.0                              # first to last submission
    seen: dict = field(default_factory=dict)         # the pass it was cut from: name -> nbytes
    limits: tuple = ()                               # (first_bytes, cap_bytes) it was cut with


@dataclass
class _SetPlan:
    """One process set's pass history and bucket plans."""

    current: dict = field(default_factory=dict)      # name -> nbytes, this pass, in order
    on_device: bool = False                           # this pass has a GPU tensor
    first_seen: float = 0.0
    last_seen: float = 0.0
    plans: dict = field(default_factory=dict)        # first name of a pass -> _Plan
    active: _Plan = field(default_factory=_Plan)     # the plan of the pass under way
    arrived: list = field(default_factory=list)      # names of each bucket seen this pass


WHOLE_PASS = 1 << 62                                 # a bucket size no pass reaches
SPARE_CORES_CAP_BYTES = 4 << 20                      # cpu_cap_on_host


def whole_pass_on_host(cap_bytes: int, explicit: bool, local_ranks: int, cores: int) -> bool:
    """Whether a rank on a host with `local_ranks` ranks and `cores` usable cores sends a pass
    of CPU tensors as one bucket.

    Why: with no core to spare per rank, holding a step's gradients until the pass is complete
    and sending them as one bucket measured faster than DDP-style buckets that overlap
    backpropagation. 4 ranks on 2 cores (benchmarks/train_step.py, two alternating runs): MPI
    CNN 0.96-0.99 x DDP against 1.04-1.05, transformer 0.98-1.04 against 1.05-1.07; gloo CNN
    0.89 against 0.92-0.93, transformer unchanged. 2 ranks on 2 cores, each with one torch
    thread (two alternating runs each, hvdlite's step above the serial floor): MPI CNN 1.9-2.2
    ms against 5.2, transformer 3.9-5.2 against 11-13; gloo CNN 1.4-3.4 against 4.2-4.5,
    transformer 4.4-5.5 against 4.3-9.4, the MLP the same. The rank's background threads
    (rounds, copies into fusion buffers, MPI's polling waits) share its one core with
    backpropagation. With a core to spare the overlap stays, as in DDP. Sizes the user set
    are kept; a cap of 0 (buckets off) too."""
    return not explicit and cap_bytes > 0 and local_ranks >= cores


def cpu_cap_on_host(cap_bytes: int, explicit: bool, local_ranks: int, cores: int,
                    shared_memory: bool) -> int:
    """The bucket cap for a pass of CPU tensors: SPARE_CORES_CAP_BYTES where every rank of a
    one-host job has two cores or more (one for backpropagation, one for the transfer) and the
    data moves through shared memory, else `cap_bytes`. Sizes the user set are kept.

    Why: DDP's 25 MB buckets suit a network, where each call costs milliseconds. Through shared
    memory a call costs tens of microseconds, and a 25 MB bucket only waits: the MLP of
    benchmarks/train_step.py (3.7 M parameters, four 2-4 MB gradients) sent its last three
    gradients as one bucket once backpropagation had ended, so nothing overlapped and its step
    sat at its serial floor. 2 ranks on a 16-core host, HVDLITE_BUCKET_CAP_MB 25 / 8 / 4 / 2, 5
    alternating rounds each against DDP: MLP 0.84 / 0.84 / 0.69 / 0.69 x DDP's step (spreads
    0.83-0.89 / 0.77-0.90 / 0.64-0.73 / 0.59-0.76), the CNN 1.00 / 0.98 / 1.06 / 1.00 (its
    3.5 MB after the first bucket make the same buckets at 25 and at 4: noise, spreads
    0.80-1.12 and 0.92-1.11). Over the network (a job on several hosts, or HVDLITE_SHM=0) the
    cap stays DDP's."""
    if explicit or cap_bytes <= 0 or not shared_memory or cores < 2 * local_ranks:
        return cap_bytes
    return min(cap_bytes, SPARE_CORES_CAP_BYTES)


class BucketPlanner:
    """Decides, per submitted allreduce, whether it may go now or waits for its bucket."""

    MIN_HOLD_S = 0.05
    MAX_HOLD_S = 1.0
    MAX_PLANS = 16                                   # pass shapes kept per set

    def __init__(self, cap_bytes: int, first_bytes: int, cpu_whole_pass: bool = False,
                 cpu_cap_bytes: int | None = None):
        self.cap_bytes = max(int(cap_bytes), 0)
        self.first_bytes = max(int(first_bytes), 0)
        # A pass of CPU tensors only is one bucket (whole_pass_on_host), or else is cut at
        # cpu_cap_bytes (cpu_cap_on_host; None: cap_bytes, as a pass with a GPU tensor is).
        self.cpu_whole_pass = cpu_whole_pass
        self.cpu_cap_bytes = self.cap_bytes if cpu_cap_bytes is None \
            else max(int(cpu_cap_bytes), 0)
        self._sets: dict[int, _SetPlan] = {}

    @property
    def enabled(self) -> bool:
        return self.cap_bytes > 0

    def observe(self, set_id: int, name: str, nbytes: int, now: float | None = None,
                boundary: bool = False, on_device: bool = False) -> tuple[bool, int]:
        """Record a submission (in submission order); `boundary` says a caller waited for
        results since the previous submission, `on_device` that the tensor is on a GPU.
        Returns (new_pass, bucket): new_pass says a pass just ended (anything still held should
        go), bucket is the index of the name's bucket if it is held back for it, else -1
        (release now)."""
        now = time.monotonic() if now is None else now
        plan = self._sets.get(set_id)
        if plan is None:                 # (setdefault built a _SetPlan on every call)
            plan = self._sets[set_id] = _SetPlan()
        new_pass = name in plan.current or (boundary and bool(plan.current))
        if new_pass:
            self._cut(plan)
        if not plan.current:
            plan.first_seen = now
            plan.active = plan.plans.get(name) or _Plan()
            plan.arrived = [0] * len(plan.active.sizes)
        plan.current[name] = nbytes
        plan.on_device = plan.on_device or on_device
        plan.last_seen = now
        b = plan.active.bucket_of.get(name, -1)
        if b < 0:
            return new_pass, -1
        plan.arrived[b] += 1
        return new_pass, (-1 if plan.arrived[b] >= plan.active.sizes[b] else b)

    def complete(self, set_id: int, bucket: int) -> bool:
        plan = self._sets.get(set_id)
        return plan is None or bucket >= len(plan.active.sizes) or \
            plan.arrived[bucket] >= plan.active.sizes[bucket]

    def hold_s(self, set_id: int) -> float:
        """How long an entry of this set may be held at most."""
        plan = self._sets.get(set_id)
        span = plan.active.span_s if plan is not None else 0.0
        return min(max(1.5 * span, self.MIN_HOLD_S), self.MAX_HOLD_S)

    def forget(self, set_id: int) -> None:
        self._sets.pop(set_id, None)

    def _cut(self, plan: _SetPlan) -> None:
        """The pass in `current` is complete: keep its buckets under its first name, DDP's way
        (in gradient order, the first bucket from first_bytes on, then about cap_bytes each)."""
        span = plan.last_seen - plan.first_seen
        if plan.on_device:
            limits = (self.first_bytes, self.cap_bytes)
        elif self.cpu_whole_pass:
            limits = (WHOLE_PASS, WHOLE_PASS)
        else:
            limits = (self.first_bytes, self.cpu_cap_bytes)
        learned = plan.active
        if learned.limits == limits and learned.seen == plan.current \
                and list(learned.seen) == list(plan.current):
            # The same pass as the one its plan was cut from (every training step, every
            # repeated call): the same buckets. Recutting built a plan per call, ~4 us of a
            # small synchronous allreduce.
            learned.span_s = span
        else:
            learned = _Plan(span_s=span, seen=plan.current, limits=limits)
            limit, filled, count = max(limits[0], 1), 0, 0
            for name, nbytes in plan.current.items():
                learned.bucket_of[name] = len(learned.sizes)
                filled += nbytes
                count += 1
                if filled >= limit:
                    learned.sizes.append(count)
                    limit, filled, count = limits[1], 0, 0
            if count:
                learned.sizes.append(count)
        first = next(iter(plan.current))
        plan.plans.pop(first, None)
        plan.plans[first] = learned                  # most recent last: evict the oldest
        while len(plan.plans) > self.MAX_PLANS:
            plan.plans.pop(next(iter(plan.plans)))
        plan.current = {}
        plan.on_device = False
