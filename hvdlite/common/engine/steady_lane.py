"""The steady lane: a set the coordinator handed to the ranks (Item.STEADY) releases its
cached tensors by rounds among them (steady.py documents the protocol), and falls back to
negotiation the moment anything is new.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Any

from ..protocol import INLINE_FLOATS, PEER_INLINE_FLOATS, Msg
from ..steady import (RoundWaiter, SteadySet, TransportRound, build_responses,
                     gone_message, payload_sum, value_from_wire, value_to_wire)

log = logging.getLogger("hvdlite.common.engine")


class SteadyLane:
    """Part of engine.core.Engine: the steady lane (this module's docstring)."""

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
        while the caller polled the round, where such a caller spends up to windows.BLOCKING_POLL_S.
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
