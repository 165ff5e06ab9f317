"""The decentralised steady state: cached tensors released without a round trip through rank 0.

Why: in steady-state training every step submits the same named tensors with the same
parameters. The response cache already shrinks each request to one bit, but sending those bits
to the coordinator in rank 0 and waiting for its answer cost a round trip per cycle (~0.5 ms
here) and made rank 0 handle one message per rank per cycle, O(N) work. Horovod's answer is a
bitwise allreduce of the ranks' cache bits on every rank; hvdlite does the same over direct TCP
connections between the ranks (control channels, HMAC-signed with a key per connection:
rendezvous.peer_session_key),
so no transport call of gloo or MPI is spent on it and nothing waits in a blocking call.

The protocol, per process set (every rank of the set runs it; rank 0 is not special):

1. Entering. The coordinator sends ``(Item.STEADY, set, epoch)`` on the ordered response stream of
   every member once the set is quiet (no table entry, no pending bit, nobody joined, no open
   group) and its last release was all cache hits. Every rank therefore enters the steady state
   for the set at the same point of that stream: after every response released before it.
   A one-member set (a one-rank job, a process set of one rank) enters too: its rounds have
   nobody to wait for and end at once, on the caller's thread (engine.Engine._inline_set), and
   its allreduces copy and scale without a transport call or fusion buffer
   (collectives.Executor.allreduce). Through the coordinator each call cost ~400 us.
2. Rounds. While steady, a rank keeps the tensors it submits for the set to itself. A cached one
   (same name and signature as its cache entry) becomes a pending bit; anything else (first
   sight, a changed shape or dtype, join, process-set changes) is held and raises the
   *fallback* flag. A grouped op's members are cached one by one, and a rank offers a group
   whole or not at all (engine.Engine._steady_add), so a round releases it whole. A barrier (one
   name per set) is cached like a collective: its round, which ends only once every rank has
   offered the bit, is the barrier. A rank with anything pending starts round k: the value
   ``(AND of pending bits, OR of fallback flags)`` is combined by recursive doubling over the
   set's ranks (``(Msg.ROUND, set, epoch, k, step, bits, flag)`` messages; ceil(log2 N)
   exchanges per rank and round, plus one pre/post step when N is not a power of two), so every
   rank ends round k with the same value. Rounds are numbered, so a message that arrives early
   waits in an inbox.
   On MPI a round is instead one allreduce (bitwise AND) on a duplicate of the set's
   communicator (TransportRound, backends/mpi.Agreement). Item.STEADY carries the width: the
   number of bits the set's cache has handed out (no new bit can appear before the next
   fallback, since new bits need the coordinator). Bits are never reused, so a name whose
   signature keeps changing hands out a new one each time; once they outnumber COMPACT_WIDTH,
   Item.STEADY also carries the live bits (slots), and a round carries bit slots[i] at position
   i: its width stays the number of live tensors instead of growing with the job (after 5,000
   changes of one name, the
   shared-memory rounds no longer fitted and went to the control connections: a 4 KiB allreduce
   took 300 us instead of 40 for the rest of the job). MPI matches every rank's k-th round. It
   costs a few us through shared memory against ~100 us for messages between Python threads,
   and every rank leaves the round at almost the same moment. A caller whose tensors are all
   its rank has in flight (one call, or a step's gradients submitted together) runs the round
   itself, and, where MPI waits may spin, their collective too (engine.Engine._drive_inline); a
   round nobody spins on is polled by a RoundWaiter thread. Over the control connections such
   a caller sends the round's messages itself and, once it waits, reads the peers' answer on
   its own thread for up to 2 ms (engine.Engine._read_peers) before leaving it to the
   background thread; the messages and their order are the same either way.
   The express lane (engine.Engine.express and _express) is the same round and release in
   one straight line, for the commonest case: a blocking allreduce of one cached tensor with
   nothing else in flight (ops.allreduce_now). It offers the same bits in the same round, so a
   peer on the general path cannot tell the difference; any other outcome (a peer without the
   bit, the fallback flag, a round that outlives the spin window) hands the entry, now with a
   handle, to the general path in the state the round left.
   A round can also carry the data of the small allreduces it releases. A rank whose round
   offers only float32 allreduces by sum or average, together at most a payload's elements
   (engine.Engine._carry: one tensor on the express lane, a grouped call of a few metrics, a
   few small tensors in flight at once), copies their tensors, prescaled, into the round's
   payload one after another in ascending bit order and tags the round. When every rank
   offered the same bits and tagged (the agreements check it exactly), every rank lays the same
   tensors out alike, since a bit stands for its signature, and the payloads' sum holds each
   tensor's allreduce at the same offset: every rank finishes them from there, with no data
   collective (engine.Engine._finish_in_round, from the express lane or from _round_done when
   the round ended elsewhere). Otherwise the payload is ignored and the bits are released as
   usual; every rank reads the same tags, so all decide alike. On MPI (backends/mpi.Agreement)
   the round is a float32 sum of a flag per bit, the fallback flag, a tag (the number of bits
   offered) and the tag's square, and a payload of INLINE_FLOATS elements; through shared
   memory (shm.ShmAgreement) each rank's round area holds a tag word and a payload beside its
   bits, read by every rank.
   A round over the control connections carries them the same way: a rank whose pending
   tensors are all such allreduces, with N x their elements at most 2 x PEER_INLINE_FLOATS
   (protocol.py; a step's message carries at most PEER_INLINE_FLOATS of them, the result sent
   to an extra rank all N copies), adds ``(tag, payload)`` to its Msg.ROUND messages
   (value_to_wire), its tag the mask of the bits it offers. Each step of the recursive
   doubling gathers the payloads when both sides carry the same tag (combine), so every rank
   ends the round with every rank's payload, adds them in rank order (payload_sum: the same
   bits as the shared-memory data path, on every rank) and finishes the allreduces from there
   (engine.Engine._round_done). A step where a side carries another tag, or none, drops the
   payloads for the rest of the round, on every rank.
   (Where gloo's TCP or MPI moves the data of 3 or more ranks, the transport adds in its own
   order, so a float sum there may differ in the last bit between a round's copy and the
   transport's, as it does between a fused and a lone tensor.) On 2 gloo ranks without shared
   memory, a 4 KiB allreduce took ~1.7 ms as a round and a gloo call here, ~0.25-0.4 ms as the
   round alone; 64 KiB ~1.9 ms and ~0.3-0.5 ms.
   HVDLITE_STEADY_ROUNDS=peers keeps the messages.
3. Release. Every rank releases the common bits of the round, in ascending bit order, fused
   exactly as the coordinator fuses (fusion.fuse_responses with the configured threshold), from
   the same cache templates. Identical input gives identical collectives on every rank, so
   validation needs no extra message: a bit stands for the name *and* the signature (type,
   dtype, shape, op, scale factors, root, device) that every rank agreed on when the bit was
   made, and a rank that changed any of them has no bit to offer. Bits that are not common stay
   pending for the next round; a rank with nothing pending takes no part until it has.
4. Fallback. When a round ends with the flag set, every rank (having released that round's
   common bits) leaves the steady state for the set, sends ``(Msg.STEADY_LEFT, set, epoch)`` and
   then sends its remaining bits and held requests to the coordinator in full, tagged with the
   epoch. Full negotiation then runs exactly as before, with every cross-rank check and error
   message it has. Cache evictions the coordinator announces while a rank is still steady wait
   until it has fallen back. The coordinator answers a message tagged with an older epoch (sent
   before the sender saw Item.STEADY) with ``(Item.TAKE_BACK, set, names, bits)``: the rank
   takes those tensors back into whichever mode it is in now. A new Item.STEADY for the set is
   only sent once every member's Msg.STEADY_LEFT of the previous epoch has arrived.
5. Stalls and ends. A rank that has waited in a round longer than a report interval sends the
   coordinator ``("W", set, epoch, names, waited_s)`` (and an empty one once released), so the
   stall inspector names the ranks that have not submitted, as before. A rank that shuts down
   makes the coordinator send ``("G", set, [rank], epoch, rounds)`` to the others: their steady
   entries fail with the same "already called hvd.shutdown()" message as in full negotiation.
   The departed rank's "S" said how many rounds of the epoch it finished: a rank still inside
   the last of those finishes it first (the departed rank's part of it was sent before it
   left), and only what that round leaves fails. Without this, a rank whose last barrier
   round was slow to end here (4 ranks on 2 busy cores) failed a barrier that every rank had
   passed.

Cost per cycle at any rank: O(log N) messages of O(cache bits) bytes and O(bits) local work;
the coordinator does no per-cycle work at all (benchmarks/control_plane.py measures it).
Autotune (HOROVOD_AUTOTUNE) keeps every cycle on the coordinator, whose threshold it tunes, and
so does a running timeline (HOROVOD_TIMELINE, hvd.start_timeline), whose NEGOTIATE phases record
when each rank submitted; sets that were already steady when a timeline starts stay steady until
their next fallback. HVDLITE_STEADY_STATE=0 turns the steady state off.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .arith import reduce_in_order
from .fusion import fuse_responses
from .messages import Response


def gone_message(gone: list, what: str, reasons: dict | None = None) -> str:
    """The error for collectives that a rank which already shut down still had to join.
    `reasons`: rank -> why it left, where it said (an uncaught exception: basics.exit_reason);
    such a rank crashed, and the hint about uneven data would mislead."""
    said = {r: reasons[r] for r in gone if reasons and r in reasons}
    if said:
        why = "; ".join(f"rank {r} exited after {said[r]}" for r in sorted(said))
        return (f"Horovod has been shut down: {why}, while {what} still needed "
                f"{'it' if len(gone) == 1 else f'ranks {gone}'}. See that rank's output for "
                f"the traceback.")
    return (f"Horovod has been shut down: rank(s) {gone} already called hvd.shutdown() (or "
            f"finished) while {what} still needed them. This is usually a rank that ran "
            f"out of data early; use hvd.join() for uneven inputs.")


def combine(a: tuple, b: tuple) -> tuple:
    """The round's reduction: AND of ready bits, OR of fallback flags. Values that carry
    payloads, ``(bits, flag, tag, {set rank: payload})``, keep them when both sides carry the
    same tag, gathered into one dict; otherwise the result is ``(bits, flag)`` and stays so for
    the rest of the round, on every rank (a rank that offered no payload, or another tensor, is
    in it). The round gathers the payloads rather than adding partial sums so that every rank
    can add them in rank order (payload_sum): the order the shared-memory data path adds slots
    in, so a tensor gets the same bits whether a round carried it or the transport did."""
    if len(a) == 2 or len(b) == 2 or a[2] != b[2]:
        return a[0] & b[0], a[1] or b[1]
    return a[0] & b[0], a[1] or b[1], a[2], {**a[3], **b[3]}


def payload_sum(parts: dict) -> np.ndarray:
    """The sum of a round's gathered payloads (combine), added in rank order
    (arith.reduce_in_order, as backends/shm.py adds its slots). A new array."""
    with np.errstate(all="ignore"):      # inf and nan are results here, as on the transport
        return reduce_in_order(np.add, [parts[r] for r in range(len(parts))],
                               np.empty_like(parts[0]))


def value_to_wire(value: tuple) -> tuple:
    """A round value as the last fields of its Msg.ROUND message: ``(bits, flag)``, or with payloads
    ``(bits, flag, tag, ((set rank, float32 bytes), ...))``. value_from_wire reads it back."""
    if len(value) == 2:
        return value
    return value[0], value[1], value[2], tuple((r, p.tobytes()) for r, p in value[3].items())


def value_from_wire(fields: tuple) -> tuple:
    """The round value a Msg.ROUND message's last fields carry (value_to_wire)."""
    if len(fields) == 2:
        return fields
    bits, flag, tag, parts = fields
    return bits, flag, tag, {r: np.frombuffer(p, dtype=np.float32) for r, p in parts}


class Round:
    """One recursive-doubling allreduce of (bits, flag) over a set's ranks; transport-agnostic.
    A value may also carry a tag and float32 payloads (combine), which the round gathers.

    `send(index, tag, value)` delivers to the set rank `index`; `offer(tag, value)` hands in a
    message received for this round. `advance()` makes every step whose input is present and
    returns the final value once known, else None. A rank sends and receives ceil(log2 N)
    messages (power-of-two N; one more pre/post step otherwise).
    """

    __slots__ = ("me", "n", "p", "value", "step", "stage", "inbox", "send", "result")

    def __init__(self, me: int, n: int, value: tuple,
                 send: Callable[[int, Any, tuple], None]):
        self.me, self.n = me, n
        p = 1
        while p * 2 <= n:
            p *= 2
        self.p = p
        self.value = value
        self.step = 0
        self.inbox: dict = {}
        self.send = send
        self.result: tuple | None = None
        if me >= p:                      # an extra rank: hand the value in, wait for the result
            send(me - p, "pre", value)
            self.stage = "post"
        elif me + p < n:
            self.stage = "pre"
        else:
            self.stage = "steps"
            self._send_step()

    def _send_step(self) -> None:
        if (1 << self.step) < self.p:
            self.send(self.me ^ (1 << self.step), self.step, self.value)

    def offer(self, tag, value: tuple) -> None:
        self.inbox[tag] = value

    def advance(self) -> tuple | None:
        while self.result is None:
            if self.stage == "post":
                if "post" not in self.inbox:
                    return None
                self.result = self.inbox.pop("post")
            elif self.stage == "pre":
                if "pre" not in self.inbox:
                    return None
                self.value = combine(self.value, self.inbox.pop("pre"))
                self.stage = "steps"
                self._send_step()
            else:
                if (1 << self.step) >= self.p:
                    if self.me + self.p < self.n:
                        self.send(self.me + self.p, "post", self.value)
                    self.result = self.value
                    break
                if self.step not in self.inbox:
                    return None
                self.value = combine(self.value, self.inbox.pop(self.step))
                self.step += 1
                self._send_step()
        return self.result

    @staticmethod
    def partners(me: int, n: int) -> list[int]:
        """The set ranks this rank exchanges with in every round."""
        p = 1
        while p * 2 <= n:
            p *= 2
        if me >= p:
            return [me - p]
        out = [me ^ (1 << j) for j in range(p.bit_length() - 1)]
        if me + p < n:
            out.append(me + p)
        return out


def set_bits(mask: int):
    """The positions of `mask`'s set bits, lowest first (cache bits in a round's or a rank's
    mask)."""
    while mask:
        low = mask & -mask
        mask ^= low
        yield low.bit_length() - 1


# Past this many bits handed out, the steady state's transport rounds carry only the live ones
# (Item.STEADY's slots).
# Below it the rounds carry bits as they are (no mapping on the hot path); 1024
# bits are 16 words of a shared-memory agreement or of an MPI round.
COMPACT_WIDTH = 1024


class TransportRound:
    """One round run as a single collective of the transport (MPI: Agreement in backends/mpi.py).

    Same contract as Round for the engine: `advance()` returns the (AND of bits, OR of flags)
    value once every rank of the set has started its round, else None. There are no messages to
    offer: the transport matches the k-th round of every rank. Whoever holds the engine's drive
    lock polls it, or hands it to the round waiter (`owned_by_waiter`), after which only the
    waiter polls it (an MPI request must not be tested by two threads at once).
    """

    __slots__ = ("request", "result", "owned_by_waiter", "slots")

    def __init__(self, agreement, bits: int, fallback: bool, width: int,
                 slots: tuple | None = None, slot_of: dict | None = None, tag: int = -1):
        self.slots = slots
        if slots is not None:
            if tag >= 0:
                tag = slot_of.get(tag, -1)
            # Carry bit slots[i] at position i (Item.STEADY's compaction).
            packed = 0
            for bit in set_bits(bits):
                i = slot_of.get(bit)
                if i is None:
                    fallback = True      # not live at Item.STEADY: cannot happen (see below)
                else:
                    packed |= 1 << i
            bits = packed
        if bits >> width:
            # A bit the round cannot carry (not known when the set entered the steady state:
            # cannot happen, since new bits need the coordinator). Be safe: fall back.
            bits &= (1 << width) - 1
            fallback = True
        # `tag`: the bit whose tensor the caller put in the agreement's payload (-1: none).
        self.request = agreement.start(bits, fallback, width, tag)
        self.result: tuple[int, bool] | None = None
        self.owned_by_waiter = False

    def poll(self) -> bool:
        """Test the request (the owner's thread only); True once the value is known."""
        if self.result is None and self.request.test():
            common, fallback = self.request.value()
            slots = self.slots
            if slots is not None:
                common = sum(1 << slots[i] for i in set_bits(common))
            self.result = (common, fallback)
        return self.result is not None

    def advance(self) -> tuple[int, bool] | None:
        if self.result is None and not self.owned_by_waiter:
            self.poll()
        return self.result

    def carried(self) -> bool:
        """Once the round is over: whether the agreement's payload now holds the allreduce of
        every bit this round offered (every rank tagged the same bits). The payload stays
        valid until the set's next round starts."""
        return self.request.inline >= 0


@dataclass
class SteadySet:
    """One process set's steady state on one rank."""

    set_id: int
    epoch: int
    ranks: list                                      # set rank -> global rank
    me: int                                          # this rank's set rank
    pending: dict = field(default_factory=dict)      # bit -> Entry
    held: list = field(default_factory=list)         # entries needing full negotiation
    fallback: bool = False
    round_no: int = 0
    round: Round | None = None
    round_bits: int = 0                              # bits offered in the current round
    round_started: float = 0.0
    reported: bool = False                           # told the coordinator we wait (stalls)
    deferred: list = field(default_factory=list)     # evictions announced while steady
    inbox: dict = field(default_factory=dict)        # (round, tag) -> value, arrived early
    # Rounds on the transport instead of the control connections (TransportRound): the set's
    # Agreement, and how many bits its rounds carry (the coordinator's count at Item.STEADY).
    agreement: Any = None
    width: int = 0
    slots: tuple | None = None                       # Item.STEADY's live bits, if compacted
    slot_of: dict | None = None                      # bit -> its position in slots
    # Members that shut down after finishing the round in flight: what it leaves fails then.
    gone: list | None = None

    def wants_round(self) -> bool:
        return self.round is None and (bool(self.pending) or self.fallback)

    @property
    def over_peers(self) -> bool:
        """Whether this set's rounds are messages over the control connections (Round): no
        transport agreement, and members to exchange them with. A one-member set's round ends
        at once; a transport's is a TransportRound."""
        return self.agreement is None and len(self.ranks) > 1

    def start_round(self, send: Callable[[int, Any, tuple], None], now: float,
                    tag: int = -1, payload=None) -> Round:
        """Start round `round_no` offering every pending bit. `tag` >= 0: the caller put that
        bit's tensor in the transport agreement's payload (TransportRound), or passes it here
        as `payload`, a float32 array, for a round over the control connections (combine)."""
        bits = 0
        for bit in self.pending:
            bits |= 1 << bit
        self.round_bits = bits
        self.round_started = now
        k = self.round_no
        if self.agreement is not None:
            rnd = TransportRound(self.agreement, bits, self.fallback, self.width, self.slots,
                                 self.slot_of, tag)
            self.round = rnd
            return rnd
        value = (bits, self.fallback) if payload is None else \
            (bits, self.fallback, tag, {self.me: payload})
        rnd = Round(self.me, len(self.ranks), value,
                    lambda idx, tag, value: send(idx, k, tag, value))
        self.round = rnd
        for (r, tag) in [key for key in self.inbox if key[0] == k]:
            rnd.offer(tag, self.inbox.pop((r, tag)))
        return rnd

    def offer(self, round_no: int, tag, value: tuple) -> None:
        if self.round is not None and round_no == self.round_no:
            self.round.offer(tag, value)
        else:
            self.inbox[(round_no, tag)] = value

    def finish_round(self, common: int) -> list:
        """Entries released by this round's common bits, in ascending bit order."""
        self.round = None
        self.round_no += 1
        out = []
        while common:            # (inline, not set_bits: the express lane runs this per call)
            low = common & -common
            common ^= low
            out.append((low.bit_length() - 1, self.pending.pop(low.bit_length() - 1)))
        return out


class RoundWaiter:
    """A thread that polls the transport rounds nobody else is spinning on.

    Why a thread of its own: the engine's background thread sleeps in select() on sockets and
    cannot wait on an MPI request, and a round may wait long for a slower rank (a whole
    backward pass). Polling backs off to POLL_MAX_S, so a long wait costs little CPU and a
    round that completes is seen within that long. `finish(st, rnd)` runs on this thread for
    each finished round; `current(st, rnd)` says whether a round still matters (one abandoned
    by a fallback, a departed rank or shutdown is dropped, never polled again).
    """

    POLL_MAX_S = 100e-6

    def __init__(self, finish: Callable[[Any, TransportRound], None],
                 current: Callable[[Any, TransportRound], bool], name: str):
        self._finish, self._current = finish, current
        self._cond = threading.Condition()
        self._rounds: list = []
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def watch(self, st, rnd: TransportRound) -> None:
        """From now on only this thread tests `rnd`."""
        rnd.owned_by_waiter = True
        with self._cond:
            self._rounds.append((st, rnd))
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end after stop().

        Why: it is a daemon thread, and one still running when the interpreter finalizes
        aborts the process: freeing a tensor makes it give up the GIL, a daemon thread that
        asks for the GIL back during finalization is ended with pthread_exit, and that unwinds
        through torch's C++ frames into std::terminate ("terminate called without an active
        exception", seen at the end of MPI jobs)."""
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def _run(self) -> None:
        pause = 0.0
        while True:
            with self._cond:
                while not self._rounds and not self._stopped:
                    self._cond.wait()
                    pause = 0.0
                if self._stopped:
                    return
                rounds = list(self._rounds)
            finished, dropped = [], []
            for st, rnd in rounds:
                if not self._current(st, rnd):
                    dropped.append(rnd)
                elif rnd.poll():
                    finished.append((st, rnd))
            if finished or dropped:
                gone = {id(r) for r in dropped} | {id(r) for _, r in finished}
                with self._cond:
                    self._rounds = [x for x in self._rounds if id(x[1]) not in gone]
            for st, rnd in finished:
                self._finish(st, rnd)
            if finished:
                pause = 0.0
            elif not dropped:
                time.sleep(pause)
                pause = min(pause * 2 or 10e-6, self.POLL_MAX_S)
            # Nothing of these rounds stays referenced while this thread waits for the next.
            rounds = finished = dropped = st = rnd = None


def build_responses(cache, set_id: int, bits: list[int], threshold: int,
                    group_fusion: bool) -> list[Response]:
    """The fused responses for released bits: the same on every rank, as the coordinator's.
    Built once per distinct release and kept in the cache (RankCache.built); never mutated."""
    key = (set_id, tuple(bits), threshold, group_fusion)
    built = cache.built.get(key)
    if built is None:
        singles = [cache.expand(set_id, [b], ()) for b in bits]
        built = cache.built[key] = fuse_responses(singles, threshold, group_fusion=group_fusion)
    return built
