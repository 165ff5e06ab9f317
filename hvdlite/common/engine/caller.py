"""Rounds on the caller's thread: a caller whose set is steady runs its round (and, where
the transport spins, the collective) itself, reading its peers' answers, instead of waking the
background thread.
"""
from __future__ import annotations

import logging
import select
import time

from .. import interrupts
from ..steady import (SteadySet)
from ..wire import Channel
from . import windows
from .handles import Completion

log = logging.getLogger("hvdlite.common.engine")


class CallerRounds:
    """Part of engine.core.Engine: the caller (this module's docstring)."""

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
                            self._steady_kick(st, max(spin_s, windows.BLOCKING_POLL_S)
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

    def _caller_waits(self, handle: "Completion") -> None:
        """A caller starts waiting on `handle` (Completion.wait, once): nothing of it may stay held
        back for a bucket (_request_flush), and where its set's rounds go over the control
        connections the caller reads them itself for a while (_read_peers)."""
        if self.buckets.enabled:
            self._request_flush()
        if not handle._set:
            self._read_peers(handle)

    def _read_peers(self, handle: "Completion") -> None:
        """Read the peers' round messages on the caller's thread while `handle` waits for a
        round over the control connections, for up to windows.PEER_READ_S.

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
            deadline = time.perf_counter() + windows.PEER_READ_S
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
        looking up the thread), else after waiting up to windows.drive_wait_s()."""
        return self._drive.acquire(False) or self._drive.acquire(timeout=windows.drive_wait_s())
