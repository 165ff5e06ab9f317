"""Submission: a frontend's entries become pending collectives with a completion each;
names stay reserved until waited for, and a caller that left by an exception leaves its
completion to free them (orphans).
"""
from __future__ import annotations

import logging
import time

from ..exceptions import HorovodInternalError
from ..flight_recorder import RECORDER
from ..messages import (TYPE_NAMES)
from .handles import Completion, Entry

log = logging.getLogger("hvdlite.common.engine")


class Submission:
    """Part of engine.core.Engine: the submission (this module's docstring)."""

    def enqueue(self, entries: list[Entry], blocking: bool = False) -> Completion:
        """Submit tensors; raises at once for misuse that no other rank needs to hear about.
        `blocking`: the caller waits for the handle straight away; where it drives its set's
        round itself (_drive_inline) it polls that round for up to windows.BLOCKING_POLL_S, as the
        express lane's caller does (_express says why), instead of handing it to the round
        waiter after the spin window and waking up again when that thread has finished it."""
        if self._orphaned:
            self._await_orphans(entries)
        handle = Completion(entries)
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

    def _attach(self, entries: list, seq: int = -1) -> Completion:
        """Give detached express entries (express, express_many) one handle and the engine's
        tables, so the general path can finish them: in flight (seq < 0) or launched on the
        transport."""
        handle = Completion(entries)
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

    def _orphan(self, handle: Completion) -> None:
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
