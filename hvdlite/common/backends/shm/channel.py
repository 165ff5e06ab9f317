"""The channel: one process's end of a segment, its worker thread, its waits and the work
objects it hands out.
"""
from __future__ import annotations

import collections
import logging
import mmap
import os
import select
import threading
import time
from typing import Callable, Optional

import numpy as np
import torch

from ...messages import MAX, SUM
from ..base import ThreadedWork
from . import settings
from .settings import (INLINE_BYTES, SPIN_CHUNK_BYTES, CALIBRATE_BYTES, CALIBRATE_ROUNDS,
                       header_bytes, _FNS, _REDUCIBLE, _RECHECK_S, _LIVENESS_S)
from .agreement import ShmAgreement
from .kernels import ShmKernels, _bytes

log = logging.getLogger("hvdlite.common.backends.shm")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmError(RuntimeError):
    """A shared-memory collective could not finish (timeout, dead peer)."""


class _Work(ThreadedWork):
    """Pending shared-memory collective: `wait()` blocks until the channel ran it.

    Completion is a flag and a lock held until then (as engine.Completion's): a threading.Event
    cost ~8 us to create and set, a quarter of a small collective run on its caller's thread.
    """

    __slots__ = ("_set", "_latch", "_error", "_timeout_s", "_lock", "_then")

    def __init__(self, timeout_s: float):
        self._set = False
        self._latch = threading.Lock()
        self._latch.acquire()
        self._error: Optional[BaseException] = None
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._then: Optional[Callable[[], None]] = None

    def _finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        with self._lock:
            self._set = True
            then, self._then = self._then, None
        self._latch.release()
        if then is not None:
            then()

    def then(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the thread that completes this work (at once if it is complete).

        Why: the engine finishes the collective there (copies nothing more, completes the
        handles) instead of waking its finisher thread to do it: one thread wake-up less
        between the data landing and the caller seeing it."""
        with self._lock:
            if not self._set:
                self._then = fn
                return
        fn()

    def is_completed(self) -> bool:
        return self._set

    def wait(self) -> None:
        # The worker bounds every phase by the timeout; the margin only guards against a bug.
        if not self._set:
            if not self._latch.acquire(timeout=self._timeout_s + 60.0):
                raise ShmError("shared-memory collective: the worker thread stopped answering")
            self._latch.release()     # let any other waiter through too
        if self._error is not None:
            raise self._error


class ShmChannel(ShmKernels):
    """The shared-memory data path of one communicator (see the module docstring).

    Collectives run in submission order on one worker thread per channel, as gloo runs them on
    its own threads, so collectives of different process sets never wait on each other.
    """

    def __init__(self, rank: int, size: int, timeout_s: float, slot: int, seg: mmap.mmap,
                 pids: dict[int, int], fifo_r: int, fifo_w: dict[int, int], own_w: int,
                 spin_s: float = 0.0):
        self.rank, self.size, self.timeout_s, self.slot = rank, size, timeout_s, slot
        # > 0 while every rank of this host has a core: small collectives then run on the
        # submitting thread, spinning for the peers this long (_submit).
        self.spin_s = spin_s
        # Bytes per chunk of a large collective: whole slots until settle_chunk decides.
        self.chunk = slot
        self._peers = [r for r in range(size) if r != rank]
        self.agreement = ShmAgreement(seg, rank, size, 64 * (size + 1))
        self._seg = seg
        self._pids = pids
        # Counters: int64 at byte 64 * (rank + 1) (byte 0 holds the token).
        self._ctr_all = np.ndarray((8 * (size + 1),), dtype=np.int64, buffer=seg)
        self._ctr = {r: self._ctr_all[8 * (r + 1):8 * (r + 1) + 1] for r in range(size)}
        self._slots = {r: torch.frombuffer(seg, dtype=torch.uint8, count=slot,
                                           offset=header_bytes(size) + r * slot) for r in range(size)}
        self._result = torch.frombuffer(seg, dtype=torch.uint8, count=slot,
                                        offset=header_bytes(size) + size * slot)
        self._typed: dict[tuple, torch.Tensor] = {}     # _view's typed slots
        self._fifo_r, self._fifo_w, self._own_w = fifo_r, fifo_w, own_w
        self._seq = 0
        self._end = 0                 # my counter after the last chunk's copy-out
        self._broken: Optional[BaseException] = None
        # Collectives not yet run, in order: (work, generator, the wait it stopped at or None).
        self._jobs: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._busy = False            # a collective is running (on the worker or inline)
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self.ops = 0                  # collectives run, for tests and diagnostics
        self.inline_ops = 0           # of which ran to the end on the submitting thread

    # ------------------------------------------------------------------ public
    def handles(self, tensor: torch.Tensor, reduce: bool) -> bool:
        """Whether this path can run a collective on `tensor` (else the caller uses gloo)."""
        # (is_cpu: tensor.device builds a torch.device object, ~0.5 us, twice per collective.)
        return (tensor.is_cpu and tensor.is_contiguous()
                and (not reduce or tensor.dtype in _REDUCIBLE))

    def allreduce(self, tensor: torch.Tensor, op: int) -> _Work:
        flat = tensor.view(-1)
        return self._submit(self._allreduce(
            [flat], [flat], _FNS[op], 1.0, 1.0), flat.numel() * flat.element_size())

    def allreduce_tensors(self, inputs: list, outputs: list, op: int, prescale: float,
                          postscale: float) -> _Work:
        """Allreduce `inputs` (all of one dtype) as one fused buffer into `outputs` (None:
        dropped), times prescale before and postscale after, without a fusion buffer."""
        ins = [t.reshape(-1) for t in inputs]
        return self._submit(self._allreduce(
            ins, [o.view(-1) if o is not None else None for o in outputs], _FNS[op], prescale,
            postscale), sum(t.numel() for t in ins) * (ins[0].element_size() if ins else 0))

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int) -> _Work:
        return self._submit(self._reducescatter(output.view(-1), tensor.view(-1), _FNS[op]),
                            tensor.numel() * tensor.element_size())

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor) -> _Work:
        # Moved as bytes (the slots are bytes): the engine passes bytes already, and any
        # other dtype would otherwise be cast into the slot element by element.
        return self._submit(self._allgather(_bytes(output), _bytes(tensor)),
                            output.numel() * output.element_size())

    def broadcast(self, tensor: torch.Tensor, root: int) -> _Work:
        return self._submit(self._broadcast(_bytes(tensor), root),
                            tensor.numel() * tensor.element_size())

    def settle_chunk(self) -> None:
        """Collective: set `self.chunk`, the bytes per chunk of a large collective, alike on
        every rank (each chunk's phases pair up across ranks, so all must cut the same).

        HVDLITE_SHM_CHUNK_MB where a rank sets it (the largest any rank sets; 0 means whole
        slots, the largest chunk). Otherwise whole slots when ranks outnumber cores (the waits
        sleep, and each wake-up costs ~50 us or more), and while every rank has a core, 2 MiB
        chunks or whole slots, whichever allreduced CALIBRATE_BYTES faster here, summed over
        the ranks (SPIN_CHUNK_BYTES says why it depends on the machine). A process measures
        once per shape of channel: later channels whose every rank knows the answer agree on
        it instead."""
        asked = settings.chunk_setting()
        key = (self.size, self.slot)
        known = settings._settled.get(key, -1)
        # One MAX allreduce: the largest chunk asked for, and the largest and (negated) the
        # smallest chunk the ranks measured before.
        agreed = torch.tensor([-1.0 if asked is None else float(asked or self.slot),
                               float(known), -float(known)], dtype=torch.float64)
        self.allreduce(agreed, MAX).wait()
        forced, most, least = int(agreed[0]), int(agreed[1]), -int(agreed[2])
        if forced >= 0:
            chunk = forced
        elif self.spin_s <= 0 or self.slot <= SPIN_CHUNK_BYTES:
            chunk = self.slot
        elif least >= 0 and least == most:
            chunk = most
        else:
            chunk = settings._settled[key] = self._measure_chunk()
        self.chunk = min(self.slot, chunk)
        self.ops = self.inline_ops = 0      # (counts the user's collectives only)

    def _measure_chunk(self) -> int:
        """settle_chunk's measurement: 2 MiB chunks or whole slots, the ranks agreeing."""
        data = torch.ones(min(CALIBRATE_BYTES, 4 * self.slot) // 4)
        tick = torch.zeros(1)
        ways = (SPIN_CHUNK_BYTES, self.slot)
        took: dict[int, list] = {c: [] for c in ways}
        for k in range(CALIBRATE_ROUNDS):
            for c in (ways if k % 2 == 0 else ways[::-1]):
                self.chunk = c
                # Each way's timed call follows an untimed one of the same way, so it does not
                # pay for the state the other way left behind; and the ranks start each call
                # together, or a call would also wait for the peers still copying out the one
                # before. (Both ways are this channel's: MPICH, against which a short
                # measurement like this one misled, needs ~15-20 calls to reach its speed:
                # backends/mpi.LARGE_MB.)
                for timed in (False, True):
                    self.allreduce(tick, MAX).wait()
                    t0 = time.perf_counter()
                    self.allreduce(data, SUM).wait()
                    if timed:
                        took[c].append(time.perf_counter() - t0)
        total = torch.tensor([sorted(took[c])[len(took[c]) // 2] for c in ways],
                             dtype=torch.float64)
        self.allreduce(total, SUM).wait()           # the same bits on every rank
        log.info("shared memory: an allreduce of %d MiB took %.2f ms in 2 MiB chunks and "
                 "%.2f ms in whole slots (median, summed over %d ranks)",
                 data.numel() * 4 >> 20, total[0] * 1e3, total[1] * 1e3, self.size)
        return SPIN_CHUNK_BYTES if total[0] <= total[1] else self.slot

    def close(self) -> None:
        with self._cv:
            thread, self._thread = self._thread, None
            self._stopping = True
            self._cv.notify_all()
        if thread is not None:
            thread.join(timeout=5.0)
            if thread.is_alive():
                # Still inside a wait (a peer died mid-collective): closing its FIFO could hand
                # the descriptor number to a new file that the worker would then read from.
                # Leave the descriptors and the mapping to the process; it raises on its own.
                log.debug("shared-memory worker still waiting at close; descriptors kept")
                return
        for fd in [self._fifo_r, self._own_w, *self._fifo_w.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fifo_w = {}
        self._slots.clear()
        self._typed.clear()
        self._ctr.clear()
        self._ctr_all = self._result = None
        self.agreement.close()
        try:
            self._seg.close()
        except (BufferError, ValueError):
            pass  # a tensor view still alive; the mapping goes with the process

    # ------------------------------------------------------------------ worker
    def _submit(self, job, nbytes: int) -> _Work:
        """Run the collective `job` (a generator of the phases' waits) after every earlier one.

        A small one (up to INLINE_BYTES) on an idle channel runs on this thread while every rank
        of the host has a core (spin_s > 0), spinning on the peers' counters: handing it to the
        worker cost a thread wake-up there and another back, and each sleeping wait a FIFO
        wake-up: ~0.7 ms for 4 KiB on 2 ranks, where the copies and the reduction take a few
        microseconds. If the peers have not arrived within spin_s, the worker takes the
        collective over at the wait it stopped at, ahead of anything submitted since, so the
        submitting thread (the engine's, or a caller holding its drive lock) is never held
        longer than that by a late or dead peer."""
        work = _Work(self.timeout_s)
        with self._cv:
            inline = (self.spin_s > 0 and nbytes <= INLINE_BYTES and not self._busy
                      and not self._jobs and self._broken is None)
            if inline:
                self._busy = True
            else:
                self._enqueue((work, job, None), front=False)
        if inline:
            stopped = self._run_inline(work, job)
            with self._cv:
                self._busy = False
                if stopped is not None:
                    self._enqueue((work, job, stopped), front=True)
                elif self._jobs:
                    self._cv.notify()
        return work

    def _enqueue(self, item: tuple, front: bool) -> None:
        """Queue a collective for the worker (started on first use); self._cv held."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hvdlite-shm", daemon=True)
            self._thread.start()
        if front:
            self._jobs.appendleft(item)
        else:
            self._jobs.append(item)
        self._cv.notify()

    def _run_inline(self, work: _Work, job) -> Optional[tuple]:
        """Run `job` here, spinning at each wait until spin_s has passed since it began.
        Returns None once it finished (work completed), else the (target, what) it stopped at."""
        deadline = time.perf_counter() + self.spin_s
        try:
            for target, what in job:
                if not self._spin(target, deadline):
                    return target, what
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            self._broken = exc
            work._finish(exc)
            return None
        self.ops += 1
        self.inline_ops += 1
        work._finish()
        return None

    def _spin(self, target: int, deadline: float, yield_core: bool = False) -> bool:
        """Until every peer's counter reached `target`; False at `deadline`. `yield_core`:
        give up the GIL and the core every 32 checks (the worker's waits: _wait)."""
        ctr, peers = self._ctr, self._peers
        checks = 0
        while True:
            for r in peers:
                if ctr[r][0] < target:
                    break
            else:
                return True
            if time.perf_counter() >= deadline:
                return False
            checks += 1
            if yield_core and checks % 32 == 0:
                os.sched_yield()

    def _run(self) -> None:
        while True:
            with self._cv:
                while (not self._jobs or self._busy) and not self._stopping:
                    self._cv.wait()
                if not self._jobs:
                    return
                work, job, stopped = self._jobs.popleft()
                self._busy = True
            if self._broken is not None:
                job.close()
                work._finish(self._broken)
            else:
                try:
                    if stopped is not None:
                        self._wait(*stopped)
                    for target, what in job:
                        self._wait(target, what)
                    self.ops += 1
                    work._finish()
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    # Counters are out of step once a phase failed: every later call fails
                    # alike.
                    self._broken = exc
                    work._finish(exc)
            with self._cv:
                self._busy = False
            # Unbind before waiting for the next collective: the arguments are views of the
            # caller's inputs and outputs. Left bound, the last collective of a step kept its
            # buffers referenced until the next step: the TensorFlow frontend could not reuse
            # its output buffers (it checks their reference count) and TensorFlow could not
            # reuse its gradients' memory, so every step faulted in fresh pages (~750 page
            # faults and ~8 ms of system time per step on the Keras benchmark's MLP).
            work = job = stopped = None

    # ------------------------------------------------------------------ phases
    def _publish(self) -> int:
        self._seq += 1
        self._ctr[self.rank][0] = self._seq
        for fd in self._fifo_w.values():
            try:
                os.write(fd, b"\0")
            except (BlockingIOError, BrokenPipeError):
                pass  # a full FIFO already wakes its reader; a dead peer is found by the wait
        return self._seq

    def _wait(self, target: int, what: str) -> None:
        """Until every peer's counter reached `target` (bounded; see the module docstring).

        While every rank has a core (spin_s > 0) the wait first spins for up to spin_s: the
        chunks of a large collective keep the ranks in step, so a peer is usually a few
        microseconds away, where a sleep in select() costs a wake-up of ~50 us or more. The
        spin gives up the GIL and the core every few microseconds (os.sched_yield), so the
        rank's own threads (its backward pass, its engine) are not held up by it."""
        ctr = self._ctr
        lagging = [r for r in ctr if r != self.rank and ctr[r][0] < target]
        if not lagging:
            return
        if self.spin_s > 0 and self._spin(target, time.perf_counter() + self.spin_s,
                                          yield_core=True):
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        liveness = start + _LIVENESS_S
        while lagging:
            ready, _, _ = select.select([self._fifo_r], [], [], _RECHECK_S)
            if ready:
                try:
                    os.read(self._fifo_r, 4096)
                except BlockingIOError:
                    pass
            lagging = [r for r in lagging if ctr[r][0] < target]
            now = time.monotonic()
            if lagging and now >= liveness:
                liveness = now + _LIVENESS_S
                dead = [r for r in lagging if self._pids[r] and not _alive(self._pids[r])]
                if dead:
                    raise ShmError(
                        f"shared-memory {what}: rank(s) {dead} (pid "
                        f"{[self._pids[r] for r in dead]}) exited while rank {self.rank} waited "
                        f"for them; see that rank's output for its error")
            if lagging and now >= deadline:
                raise ShmError(
                    f"shared-memory {what}: rank(s) {lagging} (pid "
                    f"{[self._pids[r] for r in lagging]}) did not arrive within "
                    f"{self.timeout_s:.0f} s; rank {self.rank} gave up (raise the transport "
                    f"timeout, HOROVOD_GLOO_TIMEOUT_SECONDS, if they are only slow)")

    def _end_chunk(self) -> None:
        self._end = self._publish()

    def _view(self, r: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `nbytes` of rank r's slot (r = -1: the result area) as `dtype`. The typed
        views are made once: a slice and a view per call cost ~3 us, several per chunk."""
        whole = self._typed.get((r, dtype))
        if whole is None:
            area = self._result if r < 0 else self._slots[r]
            whole = self._typed[(r, dtype)] = area.view(dtype)
        return whole[:nbytes // whole.element_size()]
