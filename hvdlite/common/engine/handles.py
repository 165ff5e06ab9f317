"""What a submission is tracked by: the entry of one tensor, and the completion the caller
waits on (Completion; ops.Handle is the public handle built on it).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .. import collectives
from ..exceptions import HorovodInternalError, HorovodMismatchError
from ..messages import (Request, Response)
log = logging.getLogger("hvdlite.common.engine")


class Completion:
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
        self._on_wait: Callable[["Completion"], None] | None = None
        # Called if an exception from outside (Ctrl-C) ends a wait first (Engine._orphan).
        self._on_abandon: Callable[["Completion"], None] | None = None
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
    free again already: `release` None): Completion's interface, nothing to wait for, no locks to
    create."""

    __slots__ = ("entries", "_release")

    def __init__(self, entries: list, release: Callable[[], None] | None):
        self.entries = entries
        self._release: Callable[[], None] | None = release   # frees the names, as Completion's

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
    handle: Completion | None = None
    result: Any = None
    extra: Any = None             # alltoall: received splits
    sent_bit: int = -1            # the cache bit sent instead of the request, if any
    ready_event: Any = None       # CUDA input: event recorded on the caller's stream
    flight: Any = None            # this collective's flight-recorder record
    gpu_done: Any = None          # GPU results: (CUDA event, or None once synced; device)
    seq: int = 0                  # submission order on this rank (bucket passes)
    planned: bool = False         # the bucket planner has seen it (buckets.py)
