"""The wire protocol as a schema: every kind of frame hvdlite sends, one table per channel.

Every control frame is a tuple whose first item is a kind's tag. Each kind below states its tag,
the channel it travels on and what it carries; tags are unique within a kind's table (`enum.unique`
turns a repeated tag into an import error instead of a silent alias), and tests/test_structure.py
checks that every frame the code sends is one of these kinds.

Channels:

    rank -> coordinator (rank 0), coordinator -> rank       `Msg`, over wire.Channel
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
    the items of one RESPONSES frame: `Item`.
    elastic worker <-> hvdlite-run driver (rendezvous.py, runner/control.py,
    runner/elastic_driver.py): `ToDriver` and `ToWorker`.

The payloads are `messages.Request` and `messages.Response`. Members are `str` values, so a
member compares equal to its one- or two-letter tag (a peer that sends the bare tag is
understood).
"""
from __future__ import annotations

import enum

# The channels a kind travels on (its `channel`).
TO_COORDINATOR = "rank -> coordinator"
TO_RANK = "coordinator -> rank"
PEER = "rank <-> rank"
RESPONSE_ITEM = "item of a RESPONSES frame"
WORKER_TO_DRIVER = "elastic worker -> driver"
DRIVER_TO_WORKER = "driver -> elastic worker"


class _Kind(str, enum.Enum):
    """A frame kind: its tag (the value), the channel it travels on and what it carries."""

    def __new__(cls, tag: str, channel: str, doc: str):
        obj = str.__new__(cls, tag)
        obj._value_ = tag
        obj.channel = channel
        obj.doc = doc
        return obj

    def __str__(self) -> str:
        return self.value


@enum.unique
class Msg(_Kind):
    """First item of every frame between a rank's engine and the coordinator, or between ranks."""

    HELLO = ("H", TO_COORDINATOR,
             '("H", {rank, size, hostname, pid, dynamic, process_sets}): joins the job')
    TOPOLOGY = ("T", TO_RANK, '("T", {local/cross rank and size, set ids, ...}): the answer '
                "to HELLO")
    QUERY = ("Q", TO_COORDINATOR, '("Q", [Request, ...], [(set_id, bit mask), ...], epochs): '
             "new requests, or cache-bit masks of requests seen before")
    RESPONSES = ("R", TO_RANK, '("R", [item, ...]): what to run, items tagged by `Item`')
    SHUTDOWN = ("S", TO_COORDINATOR,
                '("S", {set: (epoch, rounds)}[, reason]): this rank leaves, having finished '
                "`rounds` steady rounds of each steady set; `reason`: why, where it crashed "
                '("an uncaught ValueError: ...")')
    FAILED = ("X", TO_COORDINATOR, '("X", message): a collective failed on this rank')
    FATAL = ("F", TO_RANK, '("F", message[, {"hung": [ranks], "dump": why}]): the job failed; '
             'fail everything (hung ranks go to the elastic driver, "dump" asks for a '
             "flight-recorder dump first)")
    DUMP = ("D", TO_RANK, '("D", why): a stall was reported: dump the flight recorder and '
            "every thread's stack (flight_recorder.py)")
    HEARTBEAT = ("K", TO_RANK, '("K",): once a second, so a rank can tell a quiet coordinator '
                 "from a hung rank 0")
    TIMELINE = ("TL", TO_COORDINATOR, '("TL", *args): timeline control on rank 0')
    PACE = ("A", TO_COORDINATOR, '("A", seconds, count): its time to submit since the last '
            "one, answering a HEARTBEAT (straggler report only)")
    STEADY_LEFT = ("U", TO_COORDINATOR, '("U", set_id, epoch): the set fell back to '
                   "negotiation on this rank (steady.py)")
    STEADY_WAIT = ("W", TO_COORDINATOR, '("W", set_id, epoch, names, waited_s): this rank '
                   "waits long in a steady round (empty names: no longer), for the stall "
                   "inspector")
    PEER_HELLO = ("P", PEER, '("P", rank): opens a direct connection between two ranks')
    ROUND = ("O", PEER, '("O", set_id, epoch, round, step, bits, flag[, payload]): one '
             "message of a steady-state round over the direct connections (steady.py)")


@enum.unique
class Item(_Kind):
    """Items of a RESPONSES frame, applied in order."""

    RESPONSE = ("R", RESPONSE_ITEM, '("R", Response): run it (or fail its handles, type ERROR)')
    CACHED = ("C", RESPONSE_ITEM, '("C", set_id, bits, joined): run the cached responses of '
              "these bits")
    EVICT = ("E", RESPONSE_ITEM, '("E", set_id, bits): forget these cache bits')
    RESEND = ("B", RESPONSE_ITEM, '("B", set_id, bits): the coordinator forgot these bits; '
              "send the requests in full")
    CYCLE_TIME = ("P", RESPONSE_ITEM, '("P", ms): autotune\'s new cycle time')
    STEADY = ("D", RESPONSE_ITEM,
              '("D", set_id, epoch, width, slots): the set enters the steady state here; '
              "width > 0: its rounds may run on the transport, carrying that many bits; slots "
              "(or None): the live cache bits, in the order the rounds carry them, once the "
              "bits handed out outgrow COMPACT_WIDTH")
    TAKE_BACK = ("Y", RESPONSE_ITEM, '("Y", set_id, names, bits): sent before this rank saw '
                 "the set's latest Item.STEADY; release them the way the set is released now")
    GONE = ("G", RESPONSE_ITEM, '("G", set_id, [rank], epoch, rounds[, reason]): a member shut '
            "down while the set was steady, after finishing `rounds` rounds of `epoch` (or "
            "None); `reason` as its SHUTDOWN said")


@enum.unique
class ToDriver(_Kind):
    """Frames an elastic worker sends the hvdlite-run driver (rendezvous.DriverLink)."""

    HELLO = ("HELLO", WORKER_TO_DRIVER, '("HELLO", worker_id, spawn_id, pid, ...): the first '
             "frame of a control connection")
    JOIN = ("J", WORKER_TO_DRIVER, '("J", round, suspects): place this worker in the next '
            "round; `suspects` are peers it saw fail")
    CHECKPOINT = ("C", WORKER_TO_DRIVER, '("C", commit_count, path): a complete checkpoint '
                  "exists (hvdlite.torch.checkpoint), so a round with no member holding the last "
                  "commit may resume from it")


@enum.unique
class ToWorker(_Kind):
    """Frames the hvdlite-run driver sends an elastic worker (runner/elastic_driver.py)."""

    WELCOME = ("WELCOME", DRIVER_TO_WORKER, '("WELCOME",): the handshake succeeded')
    ASSIGN = ("A", DRIVER_TO_WORKER, '("A", assignment): the answer to JOIN: this worker\'s '
              "rank, size and rendezvous in the new round")
    REMOVED = ("X", DRIVER_TO_WORKER, '("X", why): this worker leaves the job')
    ABORTED = ("R", DRIVER_TO_WORKER, '("R", round, why): the round was aborted')
    HOSTS_UPDATED = ("U", DRIVER_TO_WORKER, '("U", serial, flags): the host set changed '
                     "(hosts added or removed)")


# Every table of the schema, for tools and the structure test.
KINDS: tuple = (Msg, Item, ToDriver, ToWorker)
# The first items a frame may start with (wire.Channel refuses to send anything else). Item is
# not among them: items travel inside a RESPONSES frame, never as frames of their own.
FRAME_TAGS: frozenset = frozenset(k.value for table in (Msg, ToDriver, ToWorker) for k in table)

__all__ = ["Msg", "Item", "ToDriver", "ToWorker", "KINDS", "FRAME_TAGS"]


# The float32 payload a steady-state round carries beside its bits (steady.py, point 2), in
# elements: 4 KiB. The same on every transport that carries one (backends/mpi.Agreement,
# backends/shm.ShmAgreement), and a constant of the code, not a setting: every rank's round
# must be the same size. Why this size: a round stays about as cheap as one without a payload,
# and past it MPICH changes algorithm (benchmarks/HISTORY.md, "round payloads").
INLINE_FLOATS = 1024
# The most payload one message of a round over the control connections (steady.combine)
# carries, in float32 elements: 64 KiB. Those rounds gather every rank's copy of the tensor
# (so every rank can add them in rank order), and the last step's message holds half of
# them, so they carry a tensor of up to 2 x this / N elements: 64 KiB on 2 ranks, 16 KiB on 8.
# (Where N is not a power of two, the message that hands an extra rank the result holds all
# of them: twice this.) Why 64 KiB: up to it a round that carries the tensor costs little more
# than the round alone, and far less than a round and a gloo call; past it each message's HMAC
# and copies grow (benchmarks/HISTORY.md, "round payloads").
PEER_INLINE_FLOATS = 16384
