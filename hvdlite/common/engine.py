"""The engine: one background thread per process that turns enqueued requests into collectives.

    frontend --enqueue--> queue --(control socket)--> coordinator --responses--> execute --> handles

The background thread sends new requests (or their cache bits) to the coordinator and launches
the responses it gets back, in order, on the process set's communicator; a finisher thread waits
for each launched transport call in the same order, copies results out and completes handles.
So negotiation of the next tensors overlaps the transport of the previous ones. Any failure
completes every pending handle with HorovodInternalError, so no caller waits forever.

Once the coordinator has put a process set into the steady state (Item.STEADY), the background
thread releases that set's cached tensors itself: rounds of a recursive-doubling AND of cache
bits over direct connections to the other ranks (steady.py documents the protocol), and falls
back to the coordinator the moment anything is not a cache hit. `counters` counts both paths.

A blocking allreduce of one cached tensor, with nothing else of its rank in flight, takes the
express lane (express): its caller runs the round and the collective, without a handle, the
queue or the bucket planner, and returns with the result; only where the general path must
take over does the entry get a handle and a place in the engine's tables (_attach). A blocking
call of several small float32 tensors that the round can carry (a grouped call of metrics)
takes the same lane (express_many).

Callers run rounds and collectives on their own threads (the express lane, _drive_inline), so an
exception from outside the engine (Ctrl-C, a signal handler's) can land there, most likely while
they poll. The rule: what a caller leaves, the engine finishes, as every other rank does its
part. A round goes to the round waiter and its entries to the general path (_left_lane), a
transfer to the finisher (_left_transfer), and a wait gives its handle up (Handle.wait): the
handle's names free when it completes, and a new call of one of them waits for it (_orphan).
A caller that applies the peers' round messages itself (_read_peers) holds signals back while
it does (interrupts.py): a message read off its socket is always applied. Only a collective
interrupted inside its own steps, which cannot be resumed, fails the job on every rank, as a
transport error does.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import select
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from . import collectives, interrupts, rendezvous, straggler
from .exceptions import HorovodInternalError, HorovodMismatchError
from .flight_recorder import RECORDER, dump, dump_async
from .backends.base import DONE, PollableWork, ThreadedWork
from .messages import (ADASUM, ADD_PROCESS_SET, ALLREDUCE, BARRIER, ERROR, JOIN,
                       REMOVE_PROCESS_SET, TYPE_NAMES, Request, Response)
from .protocol import INLINE_FLOATS, PEER_INLINE_FLOATS, Item, Msg
from .response_cache import RankCache
from .buckets import BucketPlanner
from .steady import (RoundWaiter, SteadySet, TransportRound, build_responses,
                     gone_message, payload_sum, value_from_wire, value_to_wire)
from .wire import Channel, ProtocolError, peer_name

log = logging.getLogger(__name__)

SHUT_DOWN_MESSAGE = ("Horovod has been shut down. This was caused by an exception on one of the "
                     "ranks or an attempt to allreduce, allgather or broadcast a tensor after one "
                     "of the ranks finished execution.")


# Collectives up to this size may be finished on the background thread (Engine._poll_inline).
INLINE_POLL_BYTES = 1 << 20
# How long a blocking caller on the express lane polls its own larger collective before the
# finisher thread takes it over (Engine._express says why).
BLOCKING_POLL_S = 0.02
# How long a caller waits for the drive lock before it leaves its collective to the background
# thread. That thread takes the lock for a few microseconds on each periodic wake-up (every 50
# ms in the steady state); a caller that found it taken and gave up at once went through the
# queue, a thread wake-up and the GIL's switch interval instead: ~5 ms for 2 of 30 16 MiB
# allreduces on 2 MPI ranks, ~0.3 ms a call on average. Bounded, so a thread holding the lock
# for a long time (the round waiter, a shutdown) still only delays the caller this much.
DRIVE_WAIT_S = 0.002
# How long a caller waiting on a round over the control connections reads them itself before
# it leaves them to the background thread (Engine._read_peers).
PEER_READ_S = 0.002


def _drive_wait_s() -> float:
    """How long this thread may wait for the drive lock: DRIVE_WAIT_S on a caller's thread, 0
    (try once) on hvdlite's own threads ("hvdlite-..."), which may hold the lock themselves:
    a completion callback that submits another collective runs there."""
    return 0.0 if threading.current_thread().name.startswith("hvdlite-") else DRIVE_WAIT_S


class Handle:
    """Completion of one enqueue call (one or more tensors)."""

    __slots__ = ("_latch", "_set", "_pending", "entries", "error", "_lock", "callbacks",
                 "_release", "mismatch", "_on_wait", "_on_abandon", "gpu_pending")

    def __init__(self, entries: list):
        # Completion: a flag, and a lock held until then that waiters block on. A
        # threading.Event (a Condition, its lock and a waiter list) cost ~3 us per collective
        # to create, set and wait on; a small allreduce costs ~35 us in all.
        self._latch = threading.Lock()
        self._latch.acquire()
        self._set = False
        self._pending = len(entries)
        self._lock = threading.Lock()
        self.entries = entries
        self.error: str | None = None
        self.mismatch = False       # the error is the coordinator's (ranks disagreed)
        self.callbacks: list[Callable] = []
        self._release: Callable[[], None] | None = None   # frees the names once waited for
        # Called once when a caller starts waiting (Engine._caller_waits): held-back entries
        # (buckets.py) go at once, and a round over the control connections is read here.
        self._on_wait: Callable[["Handle"], None] | None = None
        # Called if an exception from outside (Ctrl-C) ends a wait first (Engine._orphan).
        self._on_abandon: Callable[["Handle"], None] | None = None
        # Results of a GPU response: wait() hands them to the caller's stream (waits for them
        # there with async completion; collectives.gpu_done and await_gpu).
        self.gpu_pending = False

    def done(self) -> bool:
        return self._set

    def _signal(self) -> bool:
        """Mark the handle complete and wake its waiters; False if it already was."""
        with self._lock:
            if self._set:
                return False
            self._set = True
        self._latch.release()
        return True

    def _wait_signal(self, timeout: float) -> bool:
        if self._set:
            return True
        if self._latch.acquire(timeout=timeout):
            self._latch.release()      # let any other waiter through too
        return self._set

    def _complete_one(self, error: str | None = None, count: int = 1,
                      mismatch: bool = True) -> None:
        """`count` of this handle's entries are done (a fused response completes its members
        of one handle at once: one lock and one check for a grouped call of 100, not 100).
        `error` with `mismatch`: the ranks disagreed (HorovodMismatchError); without: the job
        broke (a member left: HorovodInternalError)."""
        with self._lock:
            if error and self.error is None:
                self.error = error
                self.mismatch = mismatch
            self._pending -= count
            finished = self._pending <= 0
        if finished and not self._set:
            # Every entry has been through the transport: drop the inputs now. Entries and
            # their handle reference each other, so without this the inputs lived until
            # Python's cyclic garbage collector ran, and a TensorFlow gradient handed over by
            # DLPack kept its memory from TensorFlow's allocator for that long (fresh pages
            # and page faults on every step instead). The results (a gradient, in place) are
            # kept by the entries until the caller has them, so the cycle is broken too: an
            # allreduced gradient then dies with the caller's last reference, at zero_grad(),
            # instead of at the next garbage collection, and backward reuses its memory
            # (kept alive, every step's gradients took fresh pages: a few hundred page faults
            # per step on the CNN of benchmarks/train_step.py). Nothing reaches a finished
            # entry through its handle any more: entries leave the engine's tables before
            # they complete.
            for e in self.entries:
                e.tensor = None
                e.handle = None
            if self._signal():
                self._fire()

    def _fail(self, error: str) -> None:
        with self._lock:
            if self._set:              # already complete: its result stands
                return
            if self.error is None:
                self.error = error
            self._pending = 0
        if self._signal():
            self._fire()

    def _fire(self) -> None:
        """Run the completion callbacks (on the engine's thread that completed the handle)."""
        if not self.callbacks:     # none were added before completion (_set is final now)
            return
        with self._lock:
            callbacks, self.callbacks = self.callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:  # a user's callback must not kill the engine's threads
                log.exception("hvdlite: a completion callback raised")

    def add_callback(self, cb: Callable[[], None]) -> None:
        """Call `cb()` once the handle completes (at once if it already has)."""
        with self._lock:
            if not self._set:
                self.callbacks.append(cb)
                return
        cb()

    def wait(self, alive: Callable[[], bool] | None = None,
             timeout: float | None = None) -> list:
        """Results of every entry, in order; raises HorovodInternalError on failure, and
        TimeoutError (leaving the handle usable) when `timeout` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        on_wait, self._on_wait = self._on_wait, None
        while True:
            try:
                if on_wait is not None:
                    if not self._set:
                        on_wait(self)
                    on_wait = None
                step = 1.0 if deadline is None else \
                    min(1.0, max(0.0, deadline - time.monotonic()))
                if self._wait_signal(step):
                    break
            except BaseException:
                # Not this loop's own errors: a KeyboardInterrupt (Ctrl-C) or a signal
                # handler's exception. The caller may never wait again, so the names this
                # handle holds must free when it completes, not at a wait (Engine._orphan).
                abandon, self._on_abandon = self._on_abandon, None
                if abandon is not None:
                    abandon(self)
                raise
            if alive is not None and not alive():
                if not self._set:
                    raise HorovodInternalError(
                        "the hvdlite background thread stopped before this collective finished; "
                        "see the errors above")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"collective {self.names()} did not finish within "
                                   f"{timeout:g} s")
        release, self._release = self._release, None
        if release is not None:
            release()
        if self.error is not None:
            raise (HorovodMismatchError if self.mismatch else HorovodInternalError)(self.error)
        if self.gpu_pending:
            collectives.await_gpu(self.entries)
        return [e.result for e in self.entries]

    def names(self) -> list:
        return [e.request.name for e in self.entries[:4]]


class Finished:
    """The handle of a collective that completed before its call returned (the express lane of
    a one-member set, Engine.express with blocking=False; Engine.express_many, whose names are
    free again already: `release` None): Handle's interface, nothing to wait for, no locks to
    create."""

    __slots__ = ("entries", "_release")

    def __init__(self, entries: list, release: Callable[[], None] | None):
        self.entries = entries
        self._release: Callable[[], None] | None = release   # frees the names, as Handle's

    def done(self) -> bool:
        return True

    def wait(self, alive: Callable[[], bool] | None = None,
             timeout: float | None = None) -> list:
        release, self._release = self._release, None
        if release is not None:
            release()
        return [e.result for e in self.entries]

    def add_callback(self, cb: Callable[[], None]) -> None:
        cb()

    def names(self) -> list:
        return [e.request.name for e in self.entries[:4]]


def own_device(resp: Response, entries: list) -> int:
    """The CUDA device index of this rank's own tensors in `resp` (-1: a CPU response, or a
    GPU one this rank has no tensor in, having joined: its current device is meant).
    `resp.device` is the first rank's index, not this rank's (Engine._comm says why)."""
    if resp.device < 0:
        return -1
    for e in entries:
        if e is not None:
            return e.request.device
    return -1


@dataclass(slots=True)
class Entry:
    request: Request
    tensor: Any = None            # input (any device)
    output: Any = None            # preallocated output (allreduce / broadcast), or None
    handle: Handle | None = None
    result: Any = None
    extra: Any = None             # alltoall: received splits
    sent_bit: int = -1            # the cache bit sent instead of the request, if any
    ready_event: Any = None       # CUDA input: event recorded on the caller's stream
    flight: Any = None            # this collective's flight-recorder record
    gpu_done: Any = None          # GPU results: (CUDA event, or None once synced; device)
    seq: int = 0                  # submission order on this rank (bucket passes)
    planned: bool = False         # the bucket planner has seen it (buckets.py)


class _PeerGreeting:
    """An accepted steady-state connection whose magic and client nonce are still arriving."""

    __slots__ = ("sock", "head")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.head = b""


class Engine:
    def __init__(self, *, rank: int, size: int, settings, channel: Channel,
                 comm_factory: Callable[..., Any], set_ranks: dict[int, list],
                 timeline=None, peer_listener: socket.socket | None = None,
                 key: bytes = b"", peers: dict | None = None, peer_nonce: bytes = b""):
        self.rank = rank
        self.size = size
        self.settings = settings
        self.channel = channel
        self.comm_factory = comm_factory
        self.set_ranks = dict(set_ranks)
        self.timeline = timeline
        self.cycle_s = max(settings.cycle_time_ms, 0.0) / 1000.0
        self.cache = RankCache()
        self.executor = collectives.Executor(timeline)
        self.executor.async_completion = getattr(settings, "async_completion", False)
        self.comms: dict[int, Any] = {}
        self.joined = False
        self._lock = threading.Lock()
        self._queue: deque[Entry] = deque()
        self._inflight: dict[tuple[int, str], Entry] = {}
        # Names stay taken from submission until the caller has waited for the result, so a
        # duplicate-name error does not depend on how fast the collective happened to finish
        # (which differs between ranks and would make their code paths diverge).
        self._reserved: set[tuple[int, str]] = set()
        # Names held by handles whose callers left by an exception (_orphan): a new call of
        # one of them waits for that handle instead of failing as a duplicate (_await_orphans).
        self._orphaned: dict[tuple[int, str], Handle] = {}
        self._closed: str | None = None
        self._stopping = False
        self._last_send = 0.0
        # The coordinator sends at least a heartbeat every second; silence far past the stall
        # shutdown time means rank 0 is hung (stopped) or unreachable.
        self._last_heard = time.monotonic()
        shutdown_s = getattr(settings, "stall_shutdown_s", 0) or 0
        self._silence_limit_s = shutdown_s + 10.0 if shutdown_s > 0 else 0.0
        # Launched collectives, in launch order, until the finisher completes them.
        self._transport: queue.Queue = queue.Queue(maxsize=64)
        self._in_transport: dict[int, list] = {}
        self._transport_seq = 0
        self._idle = threading.Condition(self._lock)
        self._idle_waiters = 0     # threads in _wait_transport_idle (notify only for them)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_pending = False      # a wake-up byte is on its way, not yet read (_wake)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._sel.register(channel.sock, selectors.EVENT_READ, "hub")
        # The decentralised steady state (steady.py): per set, the state of its rounds; direct
        # connections to the other ranks (one we opened per destination, any number accepted).
        self.key = key
        self.peer_addrs = dict(peers or {})
        self._peer_nonce = peer_nonce                 # our listener's half of each peer key
        self._seen_client_nonces: set[bytes] = set()  # refuse a connection replayed to us
        self.steady: dict[int, SteadySet] = {}
        # set -> (epoch, rounds finished) of steady states this rank has left (fallback, a
        # departed member): its "S" message carries them with the current ones (_steady_gone).
        self._rounds_left: dict[int, tuple[int, int]] = {}
        # Why this rank leaves, told the coordinator at shutdown (basics.exit_reason: an
        # uncaught exception), and why others left, as their GONE items said.
        self.exit_reason: str | None = None
        self._gone_reasons: dict[int, str] = {}
        self.epochs: dict[int, int] = {}            # set -> last Item.STEADY epoch seen
        self._early: dict[tuple[int, int], list] = {}   # (set, epoch) -> ROUNDs before STEADY
        self._peer_out: dict[int, Channel] = {}
        self._listener = peer_listener
        if peer_listener is not None:
            peer_listener.setblocking(False)
            self._sel.register(peer_listener, selectors.EVENT_READ, "listen")
        self._releasing = False
        # Whoever holds the drive lock runs the engine's state machine: the background thread
        # for what it hears, a caller driving its own collective (enqueue, _drive_inline) or the
        # round waiter finishing a transport round. Taken before self._lock, never while holding
        # it (callers wait for it at most DRIVE_WAIT_S).
        self._drive = threading.Lock()
        self._waiter: RoundWaiter | None = None
        # Gradient buckets (buckets.py): steady-state allreduces held back until their bucket
        # is complete, as (entry, set, bucket, deadline); a waiter sets _flush.
        self.buckets = BucketPlanner(settings.bucket_cap_bytes, settings.first_bucket_bytes,
                                     settings.cpu_whole_pass, settings.cpu_bucket_cap_bytes) \
            if settings.steady_state else BucketPlanner(0, 0)
        self._held: list = []
        self._flush = False
        self._submitted = 0               # entries enqueued so far (Entry.seq)
        self._wait_marks: collections.deque = collections.deque()  # _submitted at each wait
        self._observed_seq = 0            # seq of the last entry the planner saw
        self._report_after = max(0.05, min(1.0, settings.stall_warning_s / 4))
        # This rank's time to submit, for the straggler report (straggler.Pace; fed by ops).
        self.pace = straggler.Pace() if size > 1 and straggler.interval_from_env() > 0 \
            else None
        self.counters = {"coordinator_messages": 0, "coordinator_tensors": 0,
                         "steady_entered": 0, "steady_rounds": 0, "steady_released": 0,
                         "steady_groups": 0,
                         "steady_fallbacks": 0, "bounced": 0, "peer_messages": 0,
                         "transport_rounds": 0, "inline_driven": 0, "express": 0,
                         "round_payloads": 0, "caller_reads": 0, "caller_finished": 0}
        self.thread = threading.Thread(target=self._run, name="hvdlite-background", daemon=True)
        self.finisher = threading.Thread(target=self._finish_loop, name="hvdlite-finisher",
                                         daemon=True)
        self.finisher.start()
        self.thread.start()

    # ------------------------------------------------------------------ frontend side
    @property
    def closed_reason(self) -> str | None:
        return self._closed

    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def whole_pass(self) -> bool:
        """Whether this rank holds a step's CPU allreduces until the step has submitted them
        all, and sends them as one bucket (buckets.whole_pass_on_host)."""
        return self.buckets.enabled and self.buckets.cpu_whole_pass

    def enqueue(self, entries: list[Entry], blocking: bool = False) -> Handle:
        """Submit tensors; raises at once for misuse that no other rank needs to hear about.
        `blocking`: the caller waits for the handle straight away; where it drives its set's
        round itself (_drive_inline) it polls that round for up to BLOCKING_POLL_S, as the
        express lane's caller does (_express says why), instead of handing it to the round
        waiter after the spin window and waking up again when that thread has finished it."""
        if self._orphaned:
            self._await_orphans(entries)
        handle = Handle(entries)
        with self._lock:
            if self._closed is not None:
                raise HorovodInternalError(self._closed)
            keys = []
            seen: set = set()           # (a set: a grouped call of 100 searched a list 5,000 times)
            checked = None              # the last process set found registered, with this rank
            for e in entries:
                req = e.request
                if req.process_set_id != checked:
                    ranks = self.set_ranks.get(req.process_set_id)
                    if ranks is None:
                        raise ValueError(f"process set {req.process_set_id} is not registered "
                                         f"(it was removed, or never added on this rank).")
                    if self.rank not in ranks:
                        raise ValueError(f"rank {self.rank} is not a member of process set "
                                         f"{req.process_set_id} (ranks {ranks}); only members "
                                         f"may submit '{req.name}' to it.")
                    checked = req.process_set_id
                key = (req.process_set_id, req.name)
                if key in self._reserved or key in seen:
                    raise ValueError(
                        f"Requested to {TYPE_NAMES[req.type].lower()} a tensor with the same name "
                        f"as another tensor that is currently being processed: '{req.name}'. "
                        f"A name stays in use until synchronize() has returned its result; give "
                        f"each in-flight collective a unique name.")
                keys.append(key)
                seen.add(key)
            # With nothing outstanding there is nothing to batch with: send from this thread
            # at once instead of waking the background thread to do it (one thread hop less).
            direct = not (self._inflight or self._in_transport or self._stopping
                          or self.steady)
            tags = dict(self.epochs) if direct else None
            self._reserved.update(keys)
            handle._release = lambda: self._unreserve(keys)
            handle._on_abandon = self._orphan
            if self.steady:
                handle._on_wait = self._caller_waits
            for key, e in zip(keys, entries):
                e.handle = handle
                e.flight = RECORDER.enqueued(e.request)
                t = e.tensor
                if t is not None and getattr(t, "is_cuda", False):
                    # The transport runs on other threads' streams: remember when the caller's
                    # stream has produced the input (Horovod's ready event).
                    import torch
                    e.ready_event = torch.cuda.Event()
                    e.ready_event.record()
                self._submitted += 1
                e.seq = self._submitted
                self._inflight[key] = e
            wake = not direct
            inline = None
            go = entries
            if not direct and self.steady and self.buckets.enabled:
                # Decide holding here, in the caller's thread: a gradient held for its bucket
                # needs nothing from the background thread, and waking it once per gradient
                # took the core from backpropagation (on a rank with one core, each wake-up cost
                # the training thread ~100 us: 3 ms of a transformer's step).
                go = self._hold_back(entries)
                inline = self._inline_set(go)      # then go is everything in flight
                if inline is None:
                    self._queue.extend(go)
                # Wake only to send: while holding, the background thread looks at the holds'
                # deadlines at least every BucketPlanner.MIN_HOLD_S on its own (_loop).
                wake = bool(go) or self._flush
            elif not direct:
                inline = self._inline_set(go) if self.steady else None
                if inline is None:
                    self._queue.extend(entries)
        if direct:
            self._send_entries(entries, tags)
        elif inline is not None:
            try:
                self._drive_inline(inline, go, blocking)
            except BaseException:
                self._orphan(handle)     # (Ctrl-C in the round's poll: _left_lane)
                raise
        elif wake:
            self._wake()
        return handle

    def _inline_set(self, go: list, in_flight: int | None = None,
                    peers: bool = True) -> SteadySet | None:
        """The steady set whose round this caller may start itself for `go`, or None.

        Why: handing a collective to the background thread, and its result back, costs a thread
        wake-up each way (~60 and ~35 us on 2 cores), more than a whole small MPI allreduce.
        When this caller's tensors are all this rank has in flight and their set runs rounds on
        the transport (MPI, shared memory), the caller starts the round on its own thread
        (_drive_inline): one synchronous call, or a step's gradients submitted together at the
        end of backpropagation (a whole-pass bucket, torch/optimizer.py), whose hand-off to the
        background thread and back cost 1-2 % of the CNN's step on 2 gloo ranks here.
        Where waits may spin (every rank has a core) it also polls the round for a short window
        and, if every rank is there, runs the collective too, so nothing crosses a thread.
        A one-member set's round ends at once on any transport: its caller always runs it.
        A round over the control connections is started here too, and its caller reads the
        peers' answer when it waits (_read_peers). (Starting it here alone gained nothing
        measurable: the answer still arrived on the background thread. 4 KiB on 2 ranks with
        HVDLITE_SHM=0 took 250-348 us either way, three alternating runs each; on a 16-core
        host 386-514 us against 363-548.) `in_flight`: how many
        entries this rank has in flight, `go` included (default: len(go); 0 for the express
        lane's call, which is not enqueued). Called with self._lock held."""
        if in_flight is None:
            in_flight = len(go)
        if not go or self._queue or self._held or self._in_transport or self._flush \
                or len(self._inflight) != in_flight or self._releasing or self._stopping:
            return None
        sid = go[0].request.process_set_id
        if len(go) > 1 and any(e.request.process_set_id != sid for e in go):
            return None
        st = self.steady.get(sid)
        if st is None or (not peers and st.over_peers) \
                or st.round is not None \
                or st.pending or st.held or st.fallback or st.gone is not None:
            return None
        return st

    def _drive_inline(self, st: SteadySet, go: list, blocking: bool = False) -> None:
        """Run the round of `go` (everything this rank has in flight, _inline_set) and, when it
        completes in time, their collectives on this thread; one entry may take the express
        lane (_express).

        The background thread may have changed the state since enqueue looked, or may hold the
        drive lock longer than DRIVE_WAIT_S: then `go` goes the usual way, through the queue."""
        if self._take_drive():
            try:
                with self._lock:
                    ok = self._closed is None and self._inline_set(go) is st
                if ok:
                    self.counters["inline_driven"] += len(go)
                    for e in go:
                        e.planned = True
                    self._steady_add(st, go)
                    comm = self.comms.get((st.set_id, "cpu"))
                    spin_s = comm.inline_poll_s if comm is not None else 0.0
                    e = go[0]
                    try:
                        if st.over_peers:
                            self._steady_kick(st)         # the answer is read at the wait
                        elif len(go) == 1 and e.sent_bit >= 0 and self._express_ok(e, comm):
                            self._express(st, go, comm, spin_s)
                        else:
                            self._steady_kick(st, max(spin_s, BLOCKING_POLL_S)
                                              if blocking and spin_s else spin_s)
                    except BaseException:
                        self._left_lane(st, go, False)
                        raise
                    return
            finally:
                self._drive.release()
        with self._lock:
            if self._closed is None:
                self._queue.extend(go)
        self._wake()

    def _caller_waits(self, handle: "Handle") -> None:
        """A caller starts waiting on `handle` (Handle.wait, once): nothing of it may stay held
        back for a bucket (_request_flush), and where its set's rounds go over the control
        connections the caller reads them itself for a while (_read_peers)."""
        if self.buckets.enabled:
            self._request_flush()
        if not handle._set:
            self._read_peers(handle)

    def _read_peers(self, handle: "Handle") -> None:
        """Read the peers' round messages on the caller's thread while `handle` waits for a
        round over the control connections, for up to PEER_READ_S.

        Why: there the peers' answer arrived on the background thread, which then woke the
        caller: a thread wake-up each way around one message. Synchronous 4 KiB allreduces,
        alternating runs of 1,500 calls against the code before: 2 ranks with HVDLITE_SHM=0,
        median 264 us (230-330, 15 runs) against 336 (194-480; the fast runs are those where
        that thread happened to be awake); 3 ranks on 2 cores, the default gloo path when ranks
        outnumber cores, 464-519 us against 639-714 (4 runs each). With the round's messages
        sent by the caller too (_drive_inline). The 4-rank training step on 2 cores did not
        move (MLP 0.70 / 0.71 against 0.71 / 0.69, CNN 0.83 / 0.85 against 0.84 / 0.84 x DDP).

        The inbound connections are non-blocking, so the background thread, woken by the same
        bytes, finds nothing left when it gets the drive lock. Drive lock held for the whole
        window; polling sleeps in poll(), it does not spin. Past the window, or once the round
        is over (its collective then runs on the transport, or already finished in the round),
        the caller blocks on the handle as before."""
        entries = handle.entries
        st = self.steady.get(entries[0].request.process_set_id) if entries else None
        if st is None or not st.over_peers or not self._drive.acquire(False):
            return
        try:
            mapping = self._sel.get_map()        # None once the engine has closed its selector
            if mapping is None or self._closed is not None:
                return
            chans = {k.fd: k.data for k in mapping.values() if isinstance(k.data, Channel)}
            poller = select.poll()
            for fd in chans:
                poller.register(fd, select.POLLIN)
            deadline = time.perf_counter() + PEER_READ_S
            while st.round is not None and not handle._set and self._closed is None \
                    and self.steady.get(st.set_id) is st:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return
                for fd, _ in poller.poll(left * 1000.0):
                    ch = chans[fd]
                    if ch.sock.fileno() != fd:          # closed meanwhile (EOF): no more polls
                        poller.unregister(fd)
                        continue
                    self.counters["caller_reads"] += 1
                    # Read and applied whole, or not at all: a signal's exception (Ctrl-C)
                    # comes out once the messages are applied (interrupts.py says why).
                    held = interrupts.hold()
                    try:
                        self._on_peer_readable(ch)
                    finally:
                        if held:
                            interrupts.release()
        finally:
            self._drive.release()

    def _take_drive(self) -> bool:
        """Take the drive lock for a caller: at once when it is free (the common case, without
        looking up the thread), else after waiting up to _drive_wait_s()."""
        return self._drive.acquire(False) or self._drive.acquire(timeout=_drive_wait_s())

    def _express_ok(self, e: Entry, comm) -> bool:
        """Whether `e` may take the express lane (_express): one CPU allreduce into an output,
        on a communicator that exists already, with no timeline recording phases."""
        req = e.request
        return (req.type == ALLREDUCE and req.reduce_op != ADASUM and req.device < 0
                and e.output is not None and comm is not None and comm.device == "cpu"
                and (self.timeline is None or not self.timeline.enabled))

    def express(self, e: Entry, blocking: bool = True):
        """Run one synchronous caller's cached allreduce from start to end on its thread.

        Why: a blocking call needs no handle, no queue and no bucket plan while the steady state
        has nothing else in flight for this rank. Through enqueue, a 4 KiB allreduce on 2 MPI
        ranks spent ~70 us in Python around ~12 us of MPI; the layers it skips here (handles,
        the planner, the general release path) were most of it. Returns True when `e.output`
        holds the result; a Handle to wait on when the collective had to continue on the
        general path (a late peer, a fallback, a slow transfer); None when the lane is not open
        (the set is not steady, the name has no cache bit with this signature, something else is
        in flight, another thread drives the engine): nothing was done, submit `e` as usual,
        which also raises every misuse error. Raises HorovodInternalError on a transport failure.
        `blocking=False` (an asynchronous call) takes the lane only for a one-member set, whose
        collective never waits for anyone: it must not block its caller for a peer. It returns
        a Finished handle instead of True, which keeps the name taken until it is waited for,
        as every handle does.
        """
        req = e.request
        key = (req.process_set_id, req.name)
        if not self._take_drive():
            return None
        try:
            with self._lock:
                if self._closed is not None or key in self._reserved \
                        or not req.cacheable or req.group is not None:
                    return None
                st = self._inline_set([e], in_flight=0, peers=False)
                if st is None or (not blocking and len(st.ranks) > 1):
                    return None
                hit = self.cache.by_name.get(key)
                comm = self.comms.get((st.set_id, "cpu"))
                if hit is None or hit[1] != req.signature() or not self._express_ok(e, comm):
                    return None
                self._reserved.add(key)
                self._submitted += 1
                e.seq = self._submitted
                # (No wait mark for the bucket planner: the planner never sees this call, and
                # a mark per call would pile up while no planned submission consumes them.)
            e.flight = RECORDER.enqueued(req)
            e.sent_bit = hit[0]
            e.planned = True
            st.pending[hit[0]] = e
            self.counters["inline_driven"] += 1
            done = None
            try:
                done = self._express(st, [e], comm, comm.inline_poll_s, True)
                if done is True and not blocking:
                    done = Finished([e], lambda: self._unreserve([key]))
                return done
            except BaseException:
                self._left_lane(st, [e], True)
                raise
            finally:
                if e.handle is None and done.__class__ is not Finished:
                    with self._lock:       # finished (or failed) here: the name is free again
                        self._reserved.discard(key)
        finally:
            self._drive.release()

    def express_many(self, entries: list):
        """Run one synchronous caller's cached allreduces of several small float32 tensors (a
        grouped call of a few metrics, TensorFlow's SyncBatchNormalization statistics) from
        start to end on its thread, their round carrying them all (_carry).

        Why: through enqueue, a blocking grouped_allreduce of two one-element metrics took
        ~50 us on 2 MPI ranks even once its round carried the tensors, against ~11-15 us for
        one tensor on the express lane: two separate calls cost less than the grouped one.
        Here the call skips the handle, the queue and the bucket planner, as express() does.
        Returns as express() does: True when every entry's output holds its result; a Handle
        to wait on when the general path took over (a late peer, a fallback, ranks whose
        rounds offered other tensors); None when the lane is not open (express()'s reasons,
        or tensors the round cannot carry: other dtypes or ops, more than a payload's
        elements together, a one-member set): nothing was done, submit them as usual."""
        if not self._take_drive():
            return None
        try:
            with self._lock:
                if self._closed is not None:
                    return None
                st = self._inline_set(entries, in_flight=0, peers=False)
                if st is None or st.agreement is None:
                    return None
                comm = self.comms.get((st.set_id, "cpu"))
                # A group is offered whole, as _steady_add says: a grouped call is one group,
                # all of it (ops.allreduce), and anything else goes the usual way.
                group = entries[0].request.group
                keys, bits = [], []
                for e in entries:
                    req = e.request
                    key = (req.process_set_id, req.name)
                    hit = self.cache.by_name.get(key)
                    if key in self._reserved or not req.cacheable or hit is None \
                            or req.group != group or (group is not None
                                                      and req.group_size != len(entries)) \
                            or hit[1] != req.signature():
                        return None
                    keys.append(key)
                    bits.append(hit[0])
                if len(set(bits)) != len(bits) or self._carryable(entries, comm,
                                                                  INLINE_FLOATS) < 0:
                    return None
                self._reserved.update(keys)
                for e in entries:
                    self._submitted += 1
                    e.seq = self._submitted
            for e, bit in zip(entries, bits):
                e.flight = RECORDER.enqueued(e.request)
                e.sent_bit = bit
                e.planned = True
                st.pending[bit] = e
            self.counters["inline_driven"] += len(entries)
            try:
                return self._express(st, entries, comm, comm.inline_poll_s, True)
            except BaseException:
                self._left_lane(st, entries, True)
                raise
            finally:
                if entries[0].handle is None:
                    with self._lock:   # finished (or failed) here: the names are free again
                        self._reserved.difference_update(keys)
        finally:
            self._drive.release()

    def _attach(self, entries: list, seq: int = -1) -> Handle:
        """Give detached express entries (express, express_many) one handle and the engine's
        tables, so the general path can finish them: in flight (seq < 0) or launched on the
        transport."""
        handle = Handle(entries)
        keys = [(e.request.process_set_id, e.request.name) for e in entries]
        with self._lock:
            if self._closed is not None:
                raise HorovodInternalError(self._closed)
            for e in entries:
                e.handle = handle
            handle._release = lambda: self._unreserve(keys)
            handle._on_abandon = self._orphan
            if seq < 0:
                for key, e in zip(keys, entries):
                    self._inflight[key] = e
            else:
                self._in_transport[seq] = list(entries)
        return handle

    def _express(self, st: SteadySet, entries: list, comm, spin_s: float,
                 detached: bool = False):
        """The steady state's common case in one straight line: this rank's one cached
        allreduce (or a few small ones that its round carries, express_many) is all it has in
        flight, and the caller runs its round and its collective.

        Why: the general path (_steady_kick, _round_done, _execute, collectives.run, _done)
        handles fused releases, fallbacks, joins, timelines and every collective type, and its
        layers cost ~20 us of Python per call: more than the two MPI calls a small synchronous
        allreduce needs (~12 us). Here a round that releases exactly this bit, with no
        fallback, goes straight to the executor's allreduce; anything else (the round is not
        over within `spin_s`, another rank lacks the bit or asks for the fallback, a stall was
        reported) continues on the general path from the same state, so the protocol and its
        messages are the same either way (steady.py). Drive lock held; `e` is pending in `st`.
        On MPI and through shared memory, a small float32 tensor rides in the round itself
        (steady.py, point 2): when every rank put it there, the round was the whole allreduce,
        one transport call instead of two (a 4 KiB allreduce went from ~17 to ~13 us on 2 MPI
        ranks here).

        `detached`: the entries came from express() or express_many(), with no handle and in
        none of the engine's tables; they get both (_attach) only where the general path takes
        over, and then the handle is returned. Otherwise they were enqueued as usual and None is
        returned. Several entries finish here only when their round carried them all; any
        other outcome hands them to the general path (_round_done) as the round left them.

        Polling: a small collective is polled for `spin_s`, as _poll_inline says. A detached
        entry's caller blocks until the result is in, so its collective, of any size, is polled
        for up to BLOCKING_POLL_S (16 MiB take ~3 ms on MPI through shared memory): handing it
        to the finisher cost a thread wake-up before its wait started and another back to the
        caller after it ended, ~100 us of a 16 MiB allreduce with the caches cold from the
        transfer (0.91 of raw MPI's bandwidth, against 0.95 asked). That holds for the sizes up
        to INLINE_POLL_BYTES as well: a 1 MiB allreduce took ~300 us on 2 MPI ranks on a loaded
        machine, longer than `spin_s`, and every one of them went to the finisher (435 us a
        call against raw MPI's ~300; 338 polled to the end). Past that window the
        finisher takes it over as before, so a slow or dead peer holds the caller (and the
        drive lock) at most that long here. The round is polled as long for a detached entry,
        for the same reason: a peer more than `spin_s` late (one still copying the previous
        transfer's results out, or descheduled a moment) sent the round to the waiter thread
        and the collective through the general path, 30 of 50 16 MiB allreduces in one run here."""
        handle = None
        if self._releasing:
            if detached:
                handle = self._attach(entries)
            self._steady_kick(st, spin_s)
            return handle
        # A small float32 tensor rides in the round itself where the agreement carries one
        # (MPI's, backends/mpi.Agreement; shared memory's, shm.ShmAgreement); when every rank
        # put it there, the round is the whole allreduce (_finish_in_round). Several go
        # through _carry; one is copied straight in (this is the 4 KiB allreduce's hot path).
        e = entries[0]
        tag = -1
        if st.agreement is not None and not st.fallback:
            if len(entries) > 1:
                tag = self._carry(st)[0]
            elif self.executor.inline_in(st.agreement.payload_for(st.width), e.request,
                                         e.tensor):
                tag = e.sent_bit
        rnd = st.start_round(None, time.monotonic(), tag)  # a transport or a one-member round
        counters = self.counters
        counters["steady_rounds"] += 1
        if rnd.__class__ is TransportRound:
            counters["transport_rounds"] += 1
            if rnd.advance() is None:
                deadline = time.perf_counter() + (max(spin_s, BLOCKING_POLL_S)
                                                  if detached and spin_s else spin_s)
                while rnd.advance() is None:
                    if time.perf_counter() >= deadline:
                        if detached:
                            handle = self._attach(entries)
                        self._watch(st, rnd)
                        return handle
            result = rnd.result
        else:
            result = rnd.advance()
        common, fallback = result[0], result[1]
        bits = st.round_bits
        carried = tag >= 0 and rnd.carried()
        if fallback or st.reported or common & bits != bits or self._closed is not None \
                or (len(entries) > 1 and not carried):
            if detached:
                handle = self._attach(entries)
            self._round_done(st, result)
            return handle
        released = st.finish_round(bits)
        counters["steady_released"] += len(entries)
        counters["steady_groups"] += 1
        counters["express"] += 1
        if carried:
            # In ascending bit order, as _carry packed them: a caller's order can differ (a
            # member whose signature changed once has a newer bit than the others).
            self._finish_in_round(st, [e for _, e in released], rnd.request.payload())
            return True if detached else None
        resp = build_responses(self.cache, st.set_id, [e.sent_bit],
                               self.settings.fusion_threshold,
                               not self.settings.disable_group_fusion)[0]
        with self._lock:
            if not detached:
                self._inflight.pop((st.set_id, e.request.name), None)
            seq = self._transport_seq
            self._transport_seq += 1
            if not detached:
                self._in_transport[seq] = [e]
        RECORDER.started(e.flight)
        e.result = e.output
        gen, box = None, [None]
        try:
            gen = self.executor.allreduce(comm, resp, [e.tensor], [e.output])
            work = box[0] = next(gen)
            if spin_s and (detached or e.request.nbytes() <= INLINE_POLL_BYTES):
                work = self._poll_inline(gen, box, BLOCKING_POLL_S if detached else spin_s)
                if work is None:
                    return self._express_done(seq, resp, e, detached)
        except StopIteration:
            return self._express_done(seq, resp, e, detached)
        except Exception as exc:
            message = self._op_failed(seq, resp, None, exc)
            if not detached:
                return None
            RECORDER.finished(e.flight, message)
            raise HorovodInternalError(message) from exc
        except BaseException as exc:
            self._left_transfer(seq, gen, box[0], resp, None, exc, entries if detached else None)
            raise
        if detached:
            handle = self._attach(entries, seq)
        self._transport.put((seq, gen, work, resp, None))
        return handle

    def _finish_in_round(self, st: SteadySet, entries: list, payload) -> None:
        """Every rank's round carried the tensors of `entries` (this round's released bits, in
        ascending order: TransportRound.carried, or the tag of a round over the control
        connections): `payload` holds their allreduces, one after another, so they finish here
        with no collective launched, on every rank alike. Drive lock held, before the set's
        next round reuses a transport's payload."""
        for e in entries:
            RECORDER.started(e.flight)
        self.executor.inline_out_all(payload, entries, len(st.ranks))
        handled = []
        for e in entries:
            e.result = e.output
            RECORDER.finished(e.flight)
            if e.handle is not None:
                handled.append(e)
        self.counters["round_payloads"] += len(entries)
        if handled:
            self._pop(st.set_id, [e.request.name for e in handled])
            # (Taken first: a handle's completion clears its entries' links to it.)
            for handle in [e.handle for e in handled]:
                handle._complete_one()

    def _express_done(self, seq: int, resp: Response, e: Entry, detached: bool):
        self.counters["caller_finished"] += 1
        if not detached:
            self._done(seq, resp, None)
            return None
        RECORDER.finished(e.flight)
        return True

    def _unreserve(self, keys: list) -> None:
        with self._lock:
            self._reserved.difference_update(keys)

    def _request_flush(self) -> None:
        """A caller waits on a handle: nothing of it may stay held back for a bucket, and the
        next submission starts a new bucket pass."""
        self._wait_marks.append(self._submitted)
        if self._held or self._queue:
            with self._lock:
                # The waiter's one held entry, with nothing else in flight (a synchronous call
                # the bucket planner held for the rest of its pass): drive it from here, as
                # enqueue would have, rather than through the background thread.
                st = None
                if len(self._held) == 1 and not self._queue:
                    held, self._held = self._held, []
                    st = self._inline_set([held[0][0]])
                    if st is None:
                        self._held = held
                if st is None:
                    self._flush = True
            if st is not None:
                self._drive_inline(st, [held[0][0]])
                return
            self._wake()

    def _wake(self) -> None:
        """Wake the background thread from select(), unless a wake-up it has not read yet is
        already on its way: whatever the caller changed before calling is seen then too, since
        that thread looks at its state after reading the byte (_step, then _loop).

        Why: a wake-up is a send() on a socket pair, ~35 us on 2 cores here. A synchronous
        allreduce over the control connections (HVDLITE_SHM=0) woke the thread twice, at
        enqueue and again when its caller started waiting with the entry still queued
        (_request_flush): 4 in 10 calls paid the second send for nothing."""
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed is not None:
            # The job failed: nothing pending will complete (_close failed it all), so
            # transfers still waited for end now, not at the transport's timeout, and the
            # threads joined below are not held by them (backends/mpi.MPICommunicator.abandon).
            for comm in list(self.comms.values()):
                comm.abandon()
        self._stopping = True
        self._wake()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
            self.finisher.join(timeout)
            waiter = self._waiter
            if waiter is not None:        # stopped by the background thread as it ended
                waiter.stop()
                waiter.join(timeout)
        for comm in self.comms.values():
            comm.close()
        self.comms.clear()
        interrupts.unwrap()               # (the signal handlers _read_peers wrapped)

    # ------------------------------------------------------------------ background thread
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # never leave a caller waiting on a dead thread
            log.exception("hvdlite background thread failed")
            self._close(f"hvdlite background thread failed on rank {self.rank}: {exc!r}")
        finally:
            if self._waiter is not None:
                self._waiter.stop()
            self._transport.put(None)
            # Closing the channel tells the coordinator this rank is gone (a crash, unless SHUTDOWN
            # was sent first).
            self.channel.close()
            self._close_peer_sockets()
            try:
                self._sel.close()
                self._wake_r.close()
                self._wake_w.close()
            except OSError:
                pass

    def _loop(self) -> None:
        while True:
            with self._drive:
                if self._stopping:
                    self._finish_shutdown()
                    return
                timeout = self._next_timeout()
            events = self._sel.select(timeout)
            with self._drive:
                if not self._step(events):
                    return

    def _next_timeout(self) -> float:
        """How long the background thread may sleep in select(); sends what is due first."""
        timeout = 0.5
        if self._queue:
            left = self.cycle_s - (time.monotonic() - self._last_send)
            # The cycle time batches tensors that arrive while earlier ones are still being
            # negotiated or reduced; with nothing outstanding, waiting only adds latency.
            if left <= 0 or (len(self._inflight) == len(self._queue)
                             and not self._in_transport):
                self._send_queued()
            else:
                timeout = left
        if self.steady:
            timeout = min(timeout, self._steady_timeout())
        if self.steady and self.buckets.enabled:
            # Callers hold entries without waking this thread (enqueue): look at least this
            # often, so a hold's deadline (>= MIN_HOLD_S) is late by at most as much.
            timeout = min(timeout, self.buckets.MIN_HOLD_S)
        with self._lock:
            if self._held:
                timeout = max(0.0, min(timeout,
                                       min(h[3] for h in self._held) - time.monotonic()))
        return timeout

    def _step(self, events) -> bool:
        """Handle what select() reported, then whatever is due; False once the engine ends."""
        eof = False
        for key, _ in events:
            if key.data == "wake":
                try:
                    self._wake_r.recv(65536)
                except BlockingIOError:
                    pass
                # Cleared after the read, never before: a byte sent in between stays for the
                # next select() (one spurious wake-up), while clearing first could leave the flag
                # set with no byte on its way, and _wake would then skip a needed wake-up.
                self._wake_pending = False
            elif key.data == "listen":
                self._accept_peer()
            elif key.data != "hub":
                self._on_peer_readable(key.data)
                if self._closed is not None:
                    return False
            else:
                try:
                    eof = not self.channel.feed()
                    self._last_heard = time.monotonic()
                except OSError:
                    eof = True
        if self._silence_limit_s and not eof and \
                time.monotonic() - self._last_heard > self._silence_limit_s:
            silent = time.monotonic() - self._last_heard
            rendezvous.report_hung([0])
            self._close(f"rank 0 (the coordinator) has sent nothing for {silent:.0f} s, "
                        f"more than the stall shutdown time + 10 s: it is hung (stopped) "
                        f"or its host is unreachable. {SHUT_DOWN_MESSAGE}")
            return False
        try:
            msgs = self.channel.messages()
        except ProtocolError as exc:
            self._close(f"rank {self.rank}: {exc}")
            return False
        for msg in msgs:
            if not self._on_message(msg):
                return False
        if self._held:
            self._release_held()
        if self.steady:
            for st in list(self.steady.values()):
                self._steady_kick(st)      # rounds held back while another released
            self._steady_reports()
        if eof:
            self._close(self._closed or
                        f"rank {self.rank} lost its connection to the coordinator (rank 0): "
                        f"rank 0 exited, crashed or shut down. {SHUT_DOWN_MESSAGE}")
            return False
        return True

    def _finish_shutdown(self) -> None:
        # The steady rounds this rank finished: a peer still in the last of them will finish it
        # (this rank's part of it is sent), so it must not fail that round's tensors.
        rounds = dict(self._rounds_left)
        rounds.update({sid: (st.epoch, st.round_no) for sid, st in list(self.steady.items())})
        self._close(SHUT_DOWN_MESSAGE)
        self._close_peer_sockets()
        try:
            reason = self.exit_reason
            self.channel.send((Msg.SHUTDOWN, rounds) if reason is None else
                              (Msg.SHUTDOWN, rounds, reason))
        except OSError:
            pass
        self.channel.close()

    def _close_peer_sockets(self) -> None:
        """The steady state's outgoing connections and listener (idempotent)."""
        for ch in self._peer_out.values():
            ch.close()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass

    def _send_queued(self) -> None:
        with self._lock:
            entries = list(self._queue)
            self._queue.clear()
        if entries and self.steady and self.buckets.enabled:
            with self._lock:
                entries = self._hold_back(entries)
        self._dispatch(entries)

    def _hold_back(self, entries: list) -> list:
        """Hold steady-state allreduces until their bucket is complete (buckets.py); returns
        what goes now, in submission order, including held entries whose bucket just filled.
        Called with self._lock held, from enqueue (the caller's thread) or the background
        thread; each entry is planned once."""
        now = time.monotonic()
        go = []
        for e in entries:
            req = e.request
            sid = req.process_set_id
            st = self.steady.get(sid)
            # A one-member set sends nothing: holding its tensors for a bucket gains nothing.
            if e.planned or st is None or len(st.ranks) == 1 or req.type != ALLREDUCE \
                    or req.group is not None or not req.cacheable:
                e.planned = True
                go.append(e)
                continue
            e.planned = True
            marks, boundary = self._wait_marks, False
            while marks and marks[0] < e.seq:     # a caller waited before e was submitted...
                boundary = boundary or marks[0] >= self._observed_seq   # ...and after the last
                marks.popleft()
            self._observed_seq = e.seq
            new_pass, bucket = self.buckets.observe(sid, req.name, req.nbytes(), now, boundary,
                                                    req.device >= 0)
            if new_pass:                  # a new step began: whatever the last one held goes
                go[:0] = [h[0] for h in self._held if h[1] == sid]
                self._held = [h for h in self._held if h[1] != sid]
            if bucket < 0 or self._flush:
                done = {h[2] for h in self._held if h[1] == sid
                        and self.buckets.complete(sid, h[2])}
                if done:
                    go.extend(h[0] for h in self._held if h[1] == sid and h[2] in done)
                    self._held = [h for h in self._held if not (h[1] == sid and h[2] in done)]
                go.append(e)
            else:
                self._held.append((e, sid, bucket, now + self.buckets.hold_s(sid)))
        if self._flush:
            self._flush = False
            go.extend(h[0] for h in self._held)
            self._held = []
        return go

    def _release_held(self) -> None:
        """Send held entries that are due: on a waiter's request, past their deadline, or whose
        set is no longer steady (they go to the coordinator like any other request)."""
        now = time.monotonic()
        with self._lock:
            flush, self._flush = self._flush, False
            go = [h for h in self._held if flush or now >= h[3] or h[1] not in self.steady]
            if go:
                self._held = [h for h in self._held
                              if not (flush or now >= h[3] or h[1] not in self.steady)]
        if go:
            self._dispatch([h[0] for h in go])

    def _dispatch(self, entries: list) -> None:
        """Hand entries on: cached ones of a steady set to its rounds, the rest to rank 0."""
        if not entries:
            return
        if self.steady:
            rest = []
            by_set: dict[int, list] = {}
            for e in entries:
                sid = e.request.process_set_id
                if sid in self.steady:
                    by_set.setdefault(sid, []).append(e)
                else:
                    rest.append(e)
            for sid, mine in by_set.items():
                st = self.steady[sid]
                self._steady_add(st, mine)
                self._steady_kick(st)
            entries = rest
        if entries:
            self._send_entries(entries, self.epochs)

    def _send_entries(self, entries: list, tags: dict) -> None:
        """Send requests, or just their cache bits (any thread; the channel serializes).

        `tags` says, per set, the last steady-state epoch this rank has seen, so the coordinator
        can hand back what was sent before the rank saw its latest Item.STEADY (steady.py)."""
        full = []
        masks: dict[int, int] = {}
        for e in entries:
            req = e.request
            bit = self.cache.hit(req) if req.cacheable else -1
            e.sent_bit = bit
            if bit >= 0:
                masks[req.process_set_id] = masks.get(req.process_set_id, 0) | (1 << bit)
            else:
                full.append(req)
        self._last_send = time.monotonic()
        if self.timeline is not None and self.timeline.enabled:
            self.timeline.cycle()
        sets = {e.request.process_set_id for e in entries}
        self.counters["coordinator_messages"] += 1
        self.counters["coordinator_tensors"] += len(entries)
        try:
            self.channel.send((Msg.QUERY, full, list(masks.items()),
                               {sid: tags.get(sid, 0) for sid in sets}))
        except OSError as exc:
            self._close(f"rank {self.rank} could not reach the coordinator: {exc}")

    def _resend(self, set_id: int, bits: list) -> None:
        """The coordinator forgot these bits before our hits arrived: send the requests in full."""
        wanted = set(bits)
        with self._lock:
            reqs = [e.request for e in self._inflight.values()
                    if e.request.process_set_id == set_id and e.sent_bit in wanted]
        for e_bit in wanted:
            self.cache.evict(set_id, [e_bit])
        self.counters["coordinator_messages"] += 1
        try:
            self.channel.send((Msg.QUERY, reqs, [], {set_id: self.epochs.get(set_id, 0)}))
        except OSError as exc:
            self._close(f"rank {self.rank} could not reach the coordinator: {exc}")

    def _maybe_send(self) -> None:
        if self._queue and time.monotonic() - self._last_send >= self.cycle_s:
            self._send_queued()

    def _on_message(self, msg) -> bool:
        kind = msg[0]
        if kind == Msg.RESPONSES:
            for item in msg[1]:
                tag = item[0]
                if tag == Item.RESPONSE:
                    self._execute(item[1])
                elif tag == Item.CACHED:
                    _, set_id, bits, joined = item
                    self._execute(self.cache.expand(set_id, bits, joined), cached=True)
                elif tag == Item.EVICT:
                    st = self.steady.get(item[1])
                    if st is not None:
                        st.deferred.append(item[2])   # applied once this rank falls back
                    else:
                        self.cache.evict(item[1], item[2])
                elif tag == Item.STEADY:
                    self._enter_steady(item[1], item[2], item[3] if len(item) > 3 else 0,
                                       item[4] if len(item) > 4 else None)
                elif tag == Item.TAKE_BACK:
                    self._take_back(item[1], item[2], item[3])
                elif tag == Item.GONE:
                    if len(item) > 5 and item[5]:
                        self._gone_reasons.update({r: item[5] for r in item[2]})
                    self._steady_gone(item[1], item[2], *item[3:5])
                elif tag == Item.RESEND:
                    self._resend(item[1], item[2])
                elif tag == Item.CYCLE_TIME:
                    # Autotune hook: the coordinator's tuner set a new cycle time (ms).
                    self.cycle_s = max(float(item[1]), 0.0) / 1000.0
                if self._closed is not None:
                    return False
            return True
        if kind == Msg.FATAL:
            if len(msg) > 2 and isinstance(msg[2], dict):
                if msg[2].get("dump"):
                    dump(msg[2]["dump"])  # now, before closing changes the records' states
                if msg[2].get("hung"):
                    # Elastic: the next join request names them, so the driver ends them.
                    rendezvous.report_hung(msg[2]["hung"])
            self._close(msg[1])
            return False
        if kind == Msg.DUMP:
            dump_async(msg[1])  # the coordinator saw a stall: flight-recorder dump
        elif kind == Msg.HEARTBEAT and self.pace is not None:
            total, count = self.pace.take()
            if count:
                self._send_coordinator((Msg.PACE, total, count))
        return True

    # ------------------------------------------------------------------ steady state
    def _enter_steady(self, sid: int, epoch: int, width: int = 0,
                      slots: tuple | None = None) -> None:
        """The coordinator's Item.STEADY: from here this set's cached tensors are released by
        rounds.

        `width` > 0 asks for rounds on the transport where the set's CPU communicator offers an
        Agreement (MPI, and gloo's shared-memory path) that carries that many bits: every
        member decides alike, since all run the same transport and have executed the same
        responses (so all have, or all lack, the communicator). `slots`: the live bits such
        rounds carry, in order, when the coordinator compacted them (steady.COMPACT_WIDTH)."""
        ranks = self.set_ranks.get(sid)
        if ranks is None or self.rank not in ranks:
            return
        st = SteadySet(sid, epoch, list(ranks), ranks.index(self.rank))
        comm = self.comms.get((sid, "cpu"))
        agreement = comm.agreement if comm is not None and width > 0 else None
        if agreement is not None and width <= agreement.max_width:
            st.agreement, st.width = agreement, width
            if slots is not None:
                st.slots, st.slot_of = slots, {bit: i for i, bit in enumerate(slots)}
        with self._lock:
            self.epochs[sid] = epoch
            self.steady[sid] = st
        self.counters["steady_entered"] += 1
        for msg in self._early.pop((sid, epoch), []):
            self._on_steady_msg(msg)

    def _steady_add(self, st: SteadySet, entries: list) -> None:
        """Offer `entries` (all of set `st`) to the set's next round, or hold them for the
        fallback they raise.

        A grouped op is offered whole or not at all: its members become pending bits only when
        every member is here, in this call, and a cache hit. A group offered in part could have
        some members released by a round and the rest sent to the coordinator by the fallback
        that round raised, which would hold them for members that never come. Every rank
        decides alike, so a round's common bits hold a group whole or not at all."""
        members = missed = None     # group -> its members here; groups with a miss here
        for e in entries:
            req = e.request
            e.sent_bit = self.cache.hit(req) if req.cacheable else -1
            if req.group is not None:
                if members is None:     # (made only for a group: not on the hot path)
                    members, missed = collections.Counter(), set()
                members[req.group] += 1
                if e.sent_bit < 0:
                    missed.add(req.group)
        for e in entries:
            bit, req = e.sent_bit, e.request
            if bit >= 0 and req.group is not None and (
                    req.group in missed or members[req.group] != req.group_size):
                bit = -1
            if bit >= 0 and bit not in st.pending:
                st.pending[bit] = e
            else:
                # First sight, a changed signature, join, part of a group...: full negotiation
                # for all.
                e.sent_bit = -1
                st.held.append(e)
                st.fallback = True

    def _steady_kick(self, st: SteadySet, spin_s: float = 0.0) -> None:
        """Start the set's next round if it has something to offer (drive lock held).

        A transport round is polled for up to `spin_s` (a caller driving its own collective),
        then handed to the round waiter; a round over the control connections advances as its
        messages arrive. A round whose pending tensors are all small float32 allreduces
        carries them (_carry)."""
        # Not while a round's responses are being launched: a round started (and finished) from
        # inside would launch its collectives before the rest of the round's, out of order.
        if self._releasing or not st.wants_round():
            return
        if st.gone is not None:                 # a member left: no round can end any more
            self._steady_fail_gone(st, st.gone)
            return
        tag, payload = self._carry(st)
        rnd = st.start_round(lambda idx, k, step, value: self._peer_send(
            st.ranks[idx], (Msg.ROUND, st.set_id, st.epoch, k, step) + value_to_wire(value)),
            time.monotonic(), tag, payload)
        self.counters["steady_rounds"] += 1
        if self._closed is not None:
            return
        if not isinstance(rnd, TransportRound):
            self._advance(st, rnd)
            return
        self.counters["transport_rounds"] += 1
        deadline = time.perf_counter() + spin_s
        while rnd.advance() is None:
            if time.perf_counter() >= deadline:
                self._watch(st, rnd)
                return
        self._round_done(st, rnd.result)

    def _watch(self, st: SteadySet, rnd: TransportRound) -> None:
        """Hand a transport round to the round waiter, which finishes it (_waited_round)."""
        if self._waiter is None:
            self._waiter = RoundWaiter(self._waited_round, self._round_current,
                                       f"hvdlite-rounds-{self.rank}")
        self._waiter.watch(st, rnd)

    def _left_lane(self, st: SteadySet, entries: list, detached: bool) -> None:
        """An exception left a caller's own drive of its round (the express lane, or
        _drive_inline) while `entries` were in it: mostly a KeyboardInterrupt, Ctrl-C landing
        while the caller polled the round, where such a caller spends up to BLOCKING_POLL_S.
        Drive lock held.

        Why: the other ranks' rounds pair with this one and end; if nothing here polled it any
        more, the set's next round could never start, and every rank's next collective waited
        forever (the next call of the same name on this rank, and its peers' calls, hung).
        So the round goes to the round waiter and its entries to the general path, which
        finishes them as if the caller were still waiting (the result lands in the output);
        detached entries (express, express_many) get a handle for that, and one nobody will
        wait on: their names are free again once it completes (_orphan). Detached entries
        whose round never started leave the set, as if never submitted; entries the round has
        released already are finished or failed with their caller. `detached`: the entries
        came from express() or express_many(), so a handle they have by now (_attach) never
        reached the caller either."""
        rnd = st.round
        first = entries[0] if entries else None
        if detached and first is not None and first.handle is not None:
            self._orphan(first.handle)
        elif detached and first is not None and first.result is None:
            if not any(st.pending.get(e.sent_bit) is e for e in entries):
                return
            if rnd is None:
                for e in entries:
                    if st.pending.get(e.sent_bit) is e:
                        del st.pending[e.sent_bit]
                return
            self._orphan(self._attach(entries))
        if rnd.__class__ is TransportRound and not rnd.owned_by_waiter \
                and self._round_current(st, rnd):
            self._watch(st, rnd)

    def _orphan(self, handle: Handle) -> None:
        """Free `handle`'s names when it completes: its caller left by an exception before it
        got the handle, so no wait() will free them (enqueue, _left_lane, _left_transfer).
        Until then a new call of one of its names waits for it (_await_orphans): the caller
        that caught the exception and calls again must not get a duplicate-name error for the
        collective it left."""
        release, handle._release = handle._release, None
        if release is None:
            return
        keys = [(e.request.process_set_id, e.request.name) for e in handle.entries]
        for key in keys:
            self._orphaned[key] = handle

        def freed() -> None:
            release()
            for key in keys:
                if self._orphaned.get(key) is handle:
                    del self._orphaned[key]
        handle.add_callback(freed)

    def _await_orphans(self, entries: list) -> None:
        """Wait until no orphaned handle (_orphan) holds one of these entries' names, or the
        engine has stopped (enqueue then raises as usual)."""
        for e in entries:
            key = (e.request.process_set_id, e.request.name)
            while key in self._orphaned and self._closed is None and self.alive():
                handle = self._orphaned.get(key)
                if handle is not None and handle._wait_signal(0.1):
                    time.sleep(0.0005)      # completed: its callback frees the names next

    def _carry(self, st: SteadySet) -> tuple[int, Any]:
        """Put the tensors of the round `st` is about to start in its payload, where the round
        can carry them all (steady.py, point 2): each pending entry a CPU allreduce of float32
        by sum or average, into an output, together at most a payload's elements. Returns the
        round's tag (the lowest bit, or for a round over the control connections the mask of
        every bit offered) and that round's payload array; (-1, None) where it carries nothing.
        Drive lock held.

        Why every pending tensor and not one: a grouped call of a few metrics (a loss and an
        accuracy averaged together), or a few small tensors in flight at once, went through a
        round and then the data path, with a fusion buffer: a blocking grouped_allreduce of
        two one-element metrics took 80 us on 2 MPI ranks (50 us carried) against 11-15 us for
        a lone 4 KiB allreduce, which the round carried already (benchmarks/steady_paths.py).
        Bits are packed in ascending order, so every rank that offers the same bits lays the
        same tensors out alike (a bit stands for its signature, shape included), and the
        agreements carry a round only when every rank tagged the same bits."""
        pending = st.pending
        if st.fallback or not pending or not (st.agreement is not None or st.over_peers):
            return -1, None         # (a one-member set's allreduce is a copy: nothing to carry)
        bits = sorted(pending) if len(pending) > 1 else list(pending)
        # (A generator: a step's large gradients stop the check at the first one.)
        total = self._carryable((pending[bit] for bit in bits),
                                self.comms.get((st.set_id, "cpu")),
                                INLINE_FLOATS if st.agreement is not None
                                else 2 * PEER_INLINE_FLOATS // len(st.ranks))
        if total < 0:
            return -1, None
        entries = [pending[bit] for bit in bits]
        payload = st.agreement.payload_for(st.width) if st.agreement is not None else None
        if payload is None:
            array = self.executor.inline_array(entries, total)
            if array is None:
                return -1, None
            mask = 0
            for bit in bits:
                mask |= 1 << bit
            return mask, array
        if not self.executor.inline_pack(payload, entries):
            return -1, None
        return bits[0], None

    def _carryable(self, entries, comm, cap: int) -> int:
        """How many elements the entries' tensors hold together, where a round may carry them
        all (each a CPU allreduce into an output, _express_ok, of a kind the payload carries,
        Executor.carries, at most `cap` elements together); else -1. (_carry packs them;
        express_many takes its lane only for such calls.)"""
        total = 0
        for e in entries:
            if not self._express_ok(e, comm) or not self.executor.carries(e.request):
                return -1                       # (a barrier's entry has no tensor)
            total += e.tensor.numel()
            if total > cap:
                return -1
        return total

    def _round_current(self, st: SteadySet, rnd) -> bool:
        """Whether a transport round still matters (the round waiter drops it otherwise)."""
        return self._closed is None and st.round is rnd and self.steady.get(st.set_id) is st

    def _waited_round(self, st: SteadySet, rnd) -> None:
        """The round waiter saw `rnd` finish: release its tensors from the waiter's thread."""
        with self._drive:
            if self._round_current(st, rnd):
                self._round_done(st, rnd.result)

    def _advance(self, st: SteadySet, rnd) -> None:
        result = rnd.advance()
        if result is not None and st.round is rnd:
            self._round_done(st, result)

    def _on_steady_msg(self, msg) -> None:
        sid, epoch, k, step = msg[1:5]
        st = self.steady.get(sid)
        if st is None or st.epoch != epoch:
            if epoch > self.epochs.get(sid, 0):      # a peer saw Item.STEADY before this rank did
                self._early.setdefault((sid, epoch), []).append(msg)
            return
        st.offer(k, step, value_from_wire(msg[5:]))
        if st.round is not None and k == st.round_no:
            self._advance(st, st.round)

    def _round_done(self, st: SteadySet, result: tuple) -> None:
        common, fallback = result[0], result[1]
        rnd = st.round
        released = st.finish_round(common & st.round_bits)
        if st.reported:
            st.reported = False
            self._send_coordinator((Msg.STEADY_WAIT, st.set_id, st.epoch, [], 0.0))
        self.counters["steady_released"] += len(released)
        if released:
            # A round every rank tagged with the same bits (an express caller's, handed on
            # here, or any whose tensors _carry packed) carried their allreduces: finish them
            # from the payload, as every other rank does.
            if rnd.__class__ is TransportRound:
                if rnd.carried():
                    self.counters["steady_groups"] += 1
                    self._finish_in_round(st, [e for _, e in released], rnd.request.payload())
                    released = []
            elif len(result) > 2:
                self.counters["steady_groups"] += 1
                self._finish_in_round(st, [e for _, e in released], payload_sum(result[3]))
                released = []
        interrupted, stopped = None, False
        if released:
            threshold = self.settings.fusion_threshold
            self._releasing = True
            try:
                for resp in build_responses(self.cache, st.set_id, [b for b, _ in released],
                                            threshold, not self.settings.disable_group_fusion):
                    self.counters["steady_groups"] += 1
                    try:
                        self._execute(resp, cached=True)
                    except BaseException as exc:
                        # A Ctrl-C in a caller's poll of one of them (_left_transfer handed it
                        # on): the round's other collectives still launch, and its fallback
                        # still happens, as on every other rank; then the caller gets it.
                        interrupted = interrupted or exc
                    if self._closed is not None:
                        stopped = True
                        break
            finally:
                self._releasing = False
        if not stopped:
            if st.gone is not None:
                self._steady_fail_gone(st, st.gone)
            elif fallback:
                self._fall_back(st)
            else:
                self._steady_kick(st)
        if interrupted is not None:
            raise interrupted

    def _fall_back(self, st: SteadySet) -> None:
        """Every rank saw the flag in the same round: back to full negotiation for this set."""
        with self._lock:
            self.steady.pop(st.set_id, None)
        self._rounds_left[st.set_id] = (st.epoch, st.round_no)
        self.counters["steady_fallbacks"] += 1
        for bits in st.deferred:
            self.cache.evict(st.set_id, bits)
        self._send_coordinator((Msg.STEADY_LEFT, st.set_id, st.epoch))
        entries = list(st.pending.values()) + st.held
        if entries:
            self._send_entries(entries, self.epochs)

    def _take_back(self, sid: int, names: list, bits: list) -> None:
        """The coordinator returned tensors sent before this rank saw the set's latest
        Item.STEADY."""
        wanted = set(bits)
        with self._lock:
            entries = [self._inflight.get((sid, n)) for n in names]
            entries += [e for e in self._inflight.values()
                        if e.request.process_set_id == sid and e.sent_bit in wanted
                        and e.request.name not in names]
        entries = [e for e in entries if e is not None]
        self.counters["bounced"] += len(entries)
        st = self.steady.get(sid)
        if st is None:
            if entries:
                self._send_entries(entries, self.epochs)
            return
        self._steady_add(st, entries)
        self._steady_kick(st)

    def _steady_gone(self, sid: int, gone: list, epoch: int | None = None,
                     rounds: int | None = None) -> None:
        """A member shut down while this set was steady: fail what waits, as negotiation does.

        Except the round this rank is in, when the departed rank finished it (`rounds`: how
        many rounds of `epoch` it finished): its part of the round was sent before it left, so
        the round ends here too and releases what it offered (a barrier that every rank passed
        must not fail on the rank that saw it last). Whatever that round leaves fails then
        (_round_done, _steady_kick)."""
        st = self.steady.get(sid)
        if st is None:
            return
        if st.round is not None and rounds is not None and epoch == st.epoch \
                and st.round_no < rounds:
            st.gone = list(gone)
            return
        self._steady_fail_gone(st, gone)

    def _steady_fail_gone(self, st: SteadySet, gone: list) -> None:
        with self._lock:
            if self.steady.get(st.set_id) is st:
                del self.steady[st.set_id]
        self._rounds_left[st.set_id] = (st.epoch, st.round_no)
        sid = st.set_id
        entries = list(st.pending.values()) + st.held
        if not entries:
            return
        what = ", ".join(repr(e.request.name) for e in entries[:6])
        message = gone_message(gone, what, self._gone_reasons)
        for e in entries:
            with self._lock:
                self._inflight.pop((sid, e.request.name), None)
            e.handle._complete_one(message, mismatch=False)

    def _steady_timeout(self) -> float:
        now = time.monotonic()
        left = 0.5
        for st in self.steady.values():
            if st.round is not None and not st.reported:
                left = min(left, st.round_started + self._report_after - now)
        return max(left, 0.0)

    def _steady_reports(self) -> None:
        """Tell the coordinator about rounds that wait long, so the stall inspector sees them."""
        now = time.monotonic()
        for st in list(self.steady.values()):
            if st.round is not None and not st.reported \
                    and now - st.round_started >= self._report_after:
                st.reported = True
                names = [e.request.name for e in st.pending.values()]
                names += [e.request.name for e in st.held]
                self._send_coordinator((Msg.STEADY_WAIT, st.set_id, st.epoch, names,
                                        now - st.round_started))

    def _send_coordinator(self, msg) -> None:
        self.counters["coordinator_messages"] += 1
        try:
            self.channel.send(msg)
        except OSError as exc:
            self._close(f"rank {self.rank} could not reach the coordinator: {exc}")

    # ------------------------------------------------------------------ peer connections
    def _peer_send(self, g: int, msg) -> None:
        ch = self._peer_out.get(g)
        if ch is None:
            hostname, addr, port, nonce = self.peer_addrs[g]
            if addr.startswith("127.") and hostname != self.peer_addrs[self.rank][0]:
                addr = self.channel.sock.getpeername()[0]     # rank 0's host, as seen from here
            try:
                sock = socket.create_connection((addr, port), timeout=30)
                sock.settimeout(None)
                # Our nonce goes first, in the clear; nothing waits for an answer (see
                # rendezvous.peer_session_key for why, and why that is still replay-proof).
                client_nonce = os.urandom(rendezvous.PEER_NONCE)
                sock.sendall(rendezvous.PEER_MAGIC + client_nonce)
                ch = Channel(sock, rendezvous.peer_session_key(
                    self.key, bytes.fromhex(nonce), client_nonce))
                ch.send((Msg.PEER_HELLO, self.rank))
            except OSError as exc:
                self._report_failure(
                    f"rank {self.rank} could not open a control connection to rank {g} at "
                    f"{addr}:{port} for the steady state: {exc}. Open the ports between the "
                    f"hosts, or set HVDLITE_STEADY_STATE=0 to keep every cycle on rank 0.")
                return
            self._peer_out[g] = ch
        self.counters["peer_messages"] += 1
        try:
            ch.send(msg)
        except OSError:
            pass   # the peer is gone; the coordinator reports why

    def _accept_peer(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, OSError):
            return
        conn.setblocking(True)
        self._sel.register(conn, selectors.EVENT_READ, _PeerGreeting(conn))

    def _greet_peer(self, greeting: "_PeerGreeting") -> None:
        """Read an accepted connection's magic and client nonce (as they arrive: never blocks),
        then turn it into a channel keyed with both nonces."""
        sock = greeting.sock
        want = len(rendezvous.PEER_MAGIC) + rendezvous.PEER_NONCE
        try:
            data = sock.recv(want - len(greeting.head))   # select said readable: no wait
        except OSError:
            data = b""
        greeting.head += data
        problem = None
        if not data:
            problem = "closed before its greeting"
        elif not rendezvous.PEER_MAGIC.startswith(greeting.head[:len(rendezvous.PEER_MAGIC)]):
            problem = "not an hvdlite steady-state connection"
        elif len(greeting.head) < want:
            return
        else:
            client_nonce = greeting.head[len(rendezvous.PEER_MAGIC):]
            if client_nonce in self._seen_client_nonces:
                problem = "replayed a connection (its nonce was used before)"
            else:
                self._seen_client_nonces.add(client_nonce)
                sock.setblocking(False)
                ch = Channel(sock, rendezvous.peer_session_key(self.key, self._peer_nonce,
                                                               client_nonce))
                self._sel.modify(sock, selectors.EVENT_READ, ch)
                return
        if data:
            log.error("hvdlite: rejected a steady-state connection from %s: %s",
                      peer_name(sock), problem)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _on_peer_readable(self, ch) -> None:
        if isinstance(ch, _PeerGreeting):
            self._greet_peer(ch)
            return
        try:
            alive = ch.feed()
            msgs = ch.messages()
        except ProtocolError as exc:
            log.error("hvdlite: rejected a steady-state connection: %s", exc)
            alive, msgs = False, []
        except OSError:
            alive, msgs = False, []
        for msg in msgs:
            if msg[0] == Msg.ROUND:
                self._on_steady_msg(msg)
        if not alive:
            try:
                self._sel.unregister(ch.sock)
            except (KeyError, ValueError):
                pass
            ch.close()

    # ------------------------------------------------------------------ execution
    def _pop(self, set_id: int, names: list) -> list:
        with self._lock:
            return [self._inflight.pop((set_id, n), None) for n in names]

    def _comm(self, set_id: int, resp: Response, entries: list):
        """The set's communicator for `resp`'s tensors: the CPU one, or the GPU one built on
        this rank's own GPU.

        Why not `resp.device`: a response carries the device index of the request it was built
        from, the first rank's (cuda:0 on a host of several GPUs), so rank 1 built its NCCL
        communicator on cuda:0, named GPU 0 when the ranks compared GPUs, was found "sharing" it
        with rank 0 and was moved to host memory. Each rank's own requests name its GPU; a rank
        with none in this response (it joined) builds on its current device (Horovod's
        `torch.cuda.set_device(hvd.local_rank())`)."""
        kind = "cuda" if resp.device >= 0 else "cpu"
        comm = self.comms.get((set_id, kind))
        if comm is None:
            device = own_device(resp, entries)
            comm = self.comms[(set_id, kind)] = self.comm_factory(set_id, self.set_ranks[set_id],
                                                                   kind, device)
        return comm

    @staticmethod
    def _finish_entries(entries: list, result) -> None:
        """Complete the submitted `entries` (None: not this rank's) of a response that carries
        no tensor data (join, barrier, process-set changes), each with `result`."""
        for e in entries:
            if e is not None:
                e.result = result
                RECORDER.finished(e.flight)
                e.handle._complete_one()

    def _execute(self, resp: Response, cached: bool = False) -> None:
        """Run one response; `cached`: built from this rank's cache, nothing new to learn."""
        set_id = resp.process_set_id
        if resp.type == ERROR:
            for e in self._pop(set_id, resp.names):
                if e is not None:
                    RECORDER.finished(e.flight, resp.error)
                    e.handle._complete_one(resp.error, mismatch=not resp.gone)
            return
        entries = self._pop(set_id, resp.names)
        for e in entries:
            if e is not None:
                RECORDER.started(e.flight)
        if resp.cache_bits and not cached:
            self.cache.learn(resp, {e.request.name: e.request for e in entries if e is not None})
        if resp.type in (JOIN, BARRIER):
            if resp.type == JOIN:
                self.joined = False
            self._finish_entries(entries, resp.last_joined_rank if resp.type == JOIN else None)
            return
        if resp.type == ADD_PROCESS_SET:
            sid, ranks = resp.extra
            self.set_ranks[sid] = list(ranks)
            self._finish_entries(entries, sid)
            return
        if resp.type == REMOVE_PROCESS_SET:
            self._wait_transport_idle()
            sid = resp.extra
            self.set_ranks.pop(sid, None)
            for kind in ("cpu", "cuda"):
                comm = self.comms.pop((sid, kind), None)
                if comm is not None:
                    comm.close()
            self.cache.drop_set(sid)
            with self._lock:
                st = self.steady.pop(sid, None)
            if st is not None:
                for e in list(st.pending.values()) + st.held:
                    with self._lock:
                        self._inflight.pop((sid, e.request.name), None)
                    e.handle._complete_one(
                        f"remove_process_set: process set {sid} still had '{e.request.name}' "
                        f"in flight on rank {self.rank}; synchronize it first.")
            self._finish_entries(entries, sid)
            return
        if any(e is None for e in entries) and (resp.type != ALLREDUCE or not resp.joined):
            missing = [n for n, e in zip(resp.names, entries) if e is None]
            self._report_failure(f"rank {self.rank} got a response for tensors it did not submit: "
                                 f"{missing}")
            return
        self._maybe_send()
        tl = self.timeline if (self.timeline is not None and self.timeline.enabled) else None
        if tl is not None:
            tl.start_op(resp.names, TYPE_NAMES[resp.type],
                        {"dtype": resp.dtype, "shape": str(resp.shapes[0]) if resp.shapes else ""})
            # Timeline: QUEUE opens inside the op, so the collective's first phase ends QUEUE
            # (not the op itself) and every op's events nest and balance.
            tl.activity(resp.names, "QUEUE")
        with self._lock:
            seq = self._transport_seq
            self._transport_seq += 1
            self._in_transport[seq] = [e for e in entries if e is not None]
        gen, box = None, [None]
        try:
            comm = self._comm(set_id, resp, entries)
            gen = collectives.run(self.executor, comm, resp, entries)
            work = box[0] = next(gen)
            while work is DONE:  # a one-rank set: nothing to wait for, finish here
                work = box[0] = gen.send(None)
            poll_s = comm.inline_poll_s
            if poll_s and seq == self._transport_seq - 1 and len(self._in_transport) == 1 \
                    and resp.nbytes() <= INLINE_POLL_BYTES:
                work = self._poll_inline(gen, box, poll_s)
                if work is None:
                    self._done(seq, resp, tl)
                    return
        except StopIteration:
            self._done(seq, resp, tl)
            return
        except Exception as exc:
            self._op_failed(seq, resp, tl, exc)
            return
        except BaseException as exc:       # (on a caller's thread: _left_transfer)
            self._left_transfer(seq, gen, box[0], resp, tl, exc, None)
            raise
        if isinstance(work, ThreadedWork):   # the transport finishes the collective itself
            work.then(lambda: self._resume(seq, gen, work, resp, tl))
            return
        self._transport.put((seq, gen, work, resp, tl))

    def _resume(self, seq: int, gen, work, resp: Response, tl) -> None:
        """Finish a collective on the thread that completed its transport work (works with a
        `then` hook: the shared-memory path). Anything more to wait for goes to the finisher,
        so this thread never waits on work queued behind it."""
        try:
            work.wait()                   # complete: returns at once, or raises its error
            work = gen.send(None)
        except StopIteration:
            self._done(seq, resp, tl)
            return
        except Exception as exc:
            self._op_failed(seq, resp, tl, exc)
            return
        self._transport.put((seq, gen, work, resp, tl))

    @staticmethod
    def _poll_inline(gen, box: list, poll_s: float):
        """Finish a small collective on this thread if it completes within `poll_s`.

        Why: with nothing else in flight, handing a collective to the finisher thread and its
        result back costs a thread wake-up each way (~70 us on 2 cores), while a small MPI
        allreduce whose peers launched it at the same moment (the steady state releases it on
        every rank in the same round) completes in a few microseconds. Polling is bounded, and
        only communicators that set `inline_poll_s` (MPI, and gloo's shared memory, when every
        rank has a core) are polled, and never a collective run by a thread of the transport;
        whatever is unfinished at the deadline goes to the finisher as before, so a slow or dead
        peer costs at most `poll_s` here. Returns None once the collective has finished (results
        copied out), else the work still pending. Raises what the transport raised.
        `box[0]`: the work `gen` waits on, kept current here, so that a caller interrupted in
        this loop knows what to hand over (_left_transfer).
        """
        deadline = time.perf_counter() + poll_s
        work = box[0]
        while isinstance(work, PollableWork):
            if not work.is_completed() and isinstance(work, ThreadedWork):
                # Run by a thread of the transport (shared memory's worker): polling would
                # only take the GIL from it (a 14 MB allreduce ran 3x slower so).
                return work
            while not work.is_completed():
                if time.perf_counter() > deadline:
                    return work
            work.wait()                   # completed: raises a transport error, copies back
            try:
                work = box[0] = gen.send(None)
            except StopIteration:
                return None
        return work

    def _left_transfer(self, seq: int, gen, work, resp: Response, tl, exc: BaseException,
                       detached: list | None) -> None:
        """An exception that is no transport error (a KeyboardInterrupt: Ctrl-C) left a caller
        that ran collective `seq` on its own thread (_express, or _execute from a caller's
        drive): mostly while it polled the transfer (_poll_inline), for up to BLOCKING_POLL_S.

        Why: the other ranks' parts of the collective go on; abandoned here, its results were
        never copied out, its entries never finished and their names never freed, and a
        collective of several calls (collectives.Executor._allreduce_in_place) never made the
        rest of its calls, for which the other ranks then waited. So a collective suspended at
        a transfer (`gen` alive, waiting on `work`) goes to the finisher thread, which finishes
        it as if the caller still waited; `detached` entries (the express lane's) get a handle
        for that, whose names free when it completes (_orphan). One interrupted inside its own
        steps (the generator gone) cannot be resumed, and the ranks' collectives may no longer
        pair up: the job fails on every rank with this error, as for a transport's."""
        if gen is not None and work is not None and gen.gi_frame is not None \
                and not gen.gi_running:
            if detached is not None:
                self._orphan(self._attach(detached, seq))
            self._transport.put((seq, gen, work, resp, tl))
            return
        self._op_failed(seq, resp, tl, exc)

    def _finish_loop(self) -> None:
        """Wait for launched collectives in launch order; resume each to copy results out."""
        while True:
            item = self._transport.get()
            if item is None:
                return
            seq, gen, work, resp, tl = item
            try:
                while True:
                    work.wait()
                    work = gen.send(None)
            except StopIteration:
                self._done(seq, resp, tl)
            except Exception as exc:
                self._op_failed(seq, resp, tl, exc)
            # Nothing of this collective may stay referenced while the next one is awaited: it
            # would pin the caller's buffers (ShmChannel._run says what that costs).
            item = gen = work = resp = tl = None

    def _done(self, seq: int, resp: Response, tl) -> None:
        if tl is not None:
            tl.activity_end(resp.names)
            tl.end_op(resp.names)
        with self._lock:
            entries = self._in_transport.pop(seq, [])
            if self._idle_waiters:
                self._idle.notify_all()
        handles = []
        for e in entries:
            RECORDER.finished(e.flight)
            handles.append(e.handle)
        # (Taken first: a handle's completion clears its entries' links to it.)
        last, count = None, 0
        for h in handles:
            if h is not last:
                if last is not None:
                    last._complete_one(count=count)
                last, count = h, 0
            count += 1
        if last is not None:
            last._complete_one(count=count)

    def _op_failed(self, seq: int, resp: Response, tl, exc: Exception) -> str:
        """Fail the job for a transport error; returns the message every rank's callers get."""
        if tl is not None:
            tl.activity_end(resp.names)
            tl.end_op(resp.names)
        message = (f"{TYPE_NAMES[resp.type]} of {resp.names[:4]} failed on rank {self.rank}: "
                   f"{type(exc).__name__}: {exc}")
        self._report_failure(message)
        return message

    def _wait_transport_idle(self) -> None:
        """Block until every launched collective has finished (before tearing a communicator
        down); a failure ends the wait too."""
        with self._lock:
            self._idle_waiters += 1
            try:
                while self._in_transport and self._closed is None:
                    self._idle.wait(0.1)
            finally:
                self._idle_waiters -= 1

    def _report_failure(self, message: str) -> None:
        try:
            self.channel.send((Msg.FAILED, message))
        except OSError:
            pass
        self._close(message)

    def _close(self, reason: str) -> None:
        """Fail everything pending; later enqueues raise with the same reason."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
            reason = self._closed
            pending = list(self._inflight.values())
            for launched in self._in_transport.values():
                pending.extend(launched)
            self._in_transport.clear()
            self._idle.notify_all()
            self._inflight.clear()
            self._queue.clear()
            self._held = []
        for e in pending:
            RECORDER.finished(e.flight, reason)
            e.handle._fail(reason)
