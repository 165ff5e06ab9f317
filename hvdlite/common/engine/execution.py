"""Execution and the finisher: a response's collective launched on its set's communicator,
polled inline when small and quick, otherwise finished in launch order by the finisher thread,
which copies results out and completes the entries.
"""
from __future__ import annotations

import logging
import time

from .. import collectives
from ..flight_recorder import RECORDER
from ..backends.base import DONE, PollableWork, ThreadedWork
from ..messages import (ADD_PROCESS_SET, ALLREDUCE, BARRIER, ERROR, JOIN,
                       REMOVE_PROCESS_SET, TYPE_NAMES, Response)
from . import windows
from .handles import own_device

log = logging.getLogger("hvdlite.common.engine")


class Execution:
    """Part of engine.core.Engine: the execution (this module's docstring)."""

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
                    and resp.nbytes() <= windows.INLINE_POLL_BYTES:
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
