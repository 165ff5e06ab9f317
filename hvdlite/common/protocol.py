"""The control plane's message kinds: every frame between a rank's engine and the coordinator
(rank 0) is a tuple whose first item is one of these.

    rank                                          coordinator
     |-- HELLO {rank,size,hostname,pid,...} -------->|     once, at init()
     |<------------------------ TOPOLOGY {...} / FATAL|
     |-- QUERY [Request...], [(set_id, bits)...] --->|     new requests, or cache-bit masks
     |<-------------------- RESPONSES [item, ...] ---|     items tagged with `Item`, in order
     |-- FAILED message / SHUTDOWN ----------------->|
     |<------------------------------- FATAL message |     every pending handle fails
     |<-------------------------- DUMP / HEARTBEAT --|     a stall was seen / once a second
     |-- PACE seconds, count ----------------------->|     straggler report (straggler.py)
     |-- STEADY_LEFT / STEADY_WAIT ----------------->|     steady state (steady.py)

    rank i <-> rank j (direct connections, steady state only): PEER_HELLO, then ROUND frames.

The payloads are `messages.Request` and `messages.Response`. Members are `str` values, so a
member compares equal to its one- or two-letter tag (a peer that sends the bare tag is
understood).
"""
from __future__ import annotations

import enum


class _Tag(str, enum.Enum):
    def __str__(self) -> str:
        return self.value


class Msg(_Tag):
    """First item of every control frame."""

    HELLO = "H"          # rank -> coordinator: ("H", {rank, size, hostname, pid, dynamic,
    #                      process_sets}) joins the job
    TOPOLOGY = "T"       # coordinator -> rank: ("T", {local/cross rank and size, set ids, ...})
    QUERY = "Q"          # rank -> coordinator: ("Q", [Request, ...], [(set_id, bit mask), ...])
    RESPONSES = "R"      # coordinator -> rank: ("R", [item, ...]), items tagged by `Item`
    SHUTDOWN = "S"       # rank -> coordinator: ("S", {set: (epoch, rounds)}[, reason]) this
    #                      rank leaves, having finished `rounds` steady rounds of each steady
    #                      set; `reason`: why, where it crashed ("an uncaught ValueError: ...")
    FAILED = "X"         # rank -> coordinator: ("X", message) a collective failed on this rank
    FATAL = "F"          # coordinator -> rank: ("F", message[, {"hung": [ranks], "dump": why}])
    #                      the job failed; fail everything (hung ranks go to the elastic driver,
    #                      "dump" asks for a flight-recorder dump first)
    DUMP = "D"           # coordinator -> rank: ("D", why) a stall was reported: dump the flight
    #                      recorder and every thread's stack (flight_recorder.py)
    HEARTBEAT = "K"      # coordinator -> rank: ("K",) once a second, so a rank can tell a quiet
    #                      coordinator from a hung rank 0
    TIMELINE = "TL"      # rank -> coordinator: ("TL", *args) timeline control on rank 0
    PACE = "A"           # rank -> coordinator: ("A", seconds, count) its time to submit since
    #                      the last one, answering a HEARTBEAT (straggler report only)
    # The steady state (steady.py documents the protocol):
    STEADY_LEFT = "U"    # rank -> coordinator: ("U", set_id, epoch) fell back to negotiation
    STEADY_WAIT = "W"    # rank -> coordinator: ("W", set_id, epoch, names, waited_s) waits long
    #                      in a round (empty names: no longer), for the stall inspector
    PEER_HELLO = "P"     # rank -> rank: ("P", rank) opens a direct connection
    ROUND = "K"          # rank -> rank: ("K", set_id, epoch, round, step, bits, flag)


class Item(_Tag):
    """Items of a RESPONSES frame, applied in order."""

    RESPONSE = "R"       # ("R", Response): run it (or fail its handles, type ERROR)
    CACHED = "C"         # ("C", set_id, bits, joined): run the cached responses of these bits
    EVICT = "E"          # ("E", set_id, bits): forget these cache bits
    RESEND = "B"         # ("B", set_id, bits): the coordinator forgot these bits; send the
    #                      requests in full
    CYCLE_TIME = "P"     # ("P", ms): autotune's new cycle time
    STEADY = "D"         # ("D", set_id, epoch, width, slots): the set enters the steady state
    #                      here; width > 0: its rounds may run on the transport, carrying that
    #                      many bits; slots (or None): the live cache bits, in the order the
    #                      rounds carry them, once the bits handed out outgrow COMPACT_WIDTH
    TAKE_BACK = "Y"      # ("Y", set_id, names, bits): sent before this rank saw the latest
    #                      "D"; release them the way the set is released now
    GONE = "G"           # ("G", set_id, [rank], epoch, rounds[, reason]): a member shut down
    #                      while the set was steady, after finishing `rounds` rounds of `epoch`
    #                      (or None); `reason` as its SHUTDOWN said


__all__ = ["Msg", "Item"]


# The float32 payload a steady-state round carries beside its bits (steady.py, point 2), in
# elements: 4 KiB. The same on every transport that carries one (backends/mpi.Agreement,
# backends/shm.ShmAgreement), and a constant of the code, not a setting: every rank's round
# must be the same size. Measured on 2 MPI ranks here (one non-blocking allreduce, polled): a
# round of 16 bytes took 1.3-1.5 us, one with this payload 2.2 us, one with 16 KiB 8.6 us
# (MPICH changes algorithm).
INLINE_FLOATS = 1024
# The most payload one message of a round over the control connections (steady.combine)
# carries, in float32 elements: 64 KiB. Those rounds gather every rank's copy of the tensor
# (so every rank can add them in rank order), and the last step's message holds half of
# them, so they carry a tensor of up to 2 x this / N elements: 64 KiB on 2 ranks, 16 KiB on 8.
# (Where N is not a power of two, the message that hands an extra rank the result holds all
# of them: twice this.)
# Measured on 2 gloo ranks without shared memory here (medians of 5 rounds, a noisy machine):
# the round alone took 250-400 us for 4 KiB, 250-400 us for 16 KiB, 330-520 us for 64 KiB,
# and 580 us for 256 KiB, against 1.7-2.4 ms as a round and a gloo call from 16 KiB up. Past
# 64 KiB each message's HMAC and copies grow (~70 us a step at 64 KiB, ~0.5 ms at 256 KiB).
PEER_INLINE_FLOATS = 16384
