"""The express lane: a blocking call of one cached allreduce (or a few small float32 ones
the round can carry) runs its round and collective on its caller's thread, with no completion,
queue or bucket plan unless the general path has to take over.
"""
from __future__ import annotations

import logging
import time

from ..exceptions import HorovodInternalError
from ..flight_recorder import RECORDER
from ..messages import (ADASUM, ALLREDUCE, Response)
from ..protocol import INLINE_FLOATS
from ..steady import (SteadySet, TransportRound, build_responses)
from . import windows
from .handles import Entry, Finished

log = logging.getLogger("hvdlite.common.engine")


class ExpressLane:
    """Part of engine.core.Engine: the express (this module's docstring)."""

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
        holds the result; a Completion to wait on when the collective had to continue on the
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
        Returns as express() does: True when every entry's output holds its result; a Completion
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
                deadline = time.perf_counter() + (max(spin_s, windows.BLOCKING_POLL_S)
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
            if spin_s and (detached or e.request.nbytes() <= windows.INLINE_POLL_BYTES):
                work = self._poll_inline(gen, box, windows.BLOCKING_POLL_S if detached else spin_s)
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
