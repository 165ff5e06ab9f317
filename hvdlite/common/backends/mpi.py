"""MPI transport: mpi4py over the MPICH (or Open MPI) wheel from PyPI, no system MPI needed.

On one host MPICH moves data through shared memory: ~6 µs for 4 KiB and several GB/s, against
gloo's TCP loopback. Calls are non-blocking (I* collectives); the engine's finisher thread waits
for them, so MPI must run with MPI_THREAD_MULTIPLE (mpi4py asks for it by default).
"""
from __future__ import annotations

import math
import os
import socket
import time

import numpy as np
import torch

from .. import config
from ..threads import local_ranks as _local_ranks, usable_cores
from ..messages import MAX, MIN, PRODUCT, SUM
from ..protocol import INLINE_FLOATS
from ..rendezvous import Identity
from ..steady import set_bits
from . import shm
from .base import Agreement as _AgreementBase, PollableWork

# mpi4py.MPI, loaded by `_load()` on first need. Importing it initializes MPI, which a gloo job
# never needs: it cost every rank ~70 ms at start (a singleton MPI_Init; with Open MPI a
# singleton also starts a helper process), so only an MPI job, init(comm=...) or the build
# queries (mpi_built, mpi_threads_supported) load it.
MPI = None
_loaded = False

# Reductions MPI has no type for run in float32 and are cast back.
_WIDEN = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _load():
    """mpi4py.MPI, imported (and MPI initialized) the first time; None without mpi4py."""
    global MPI, _loaded
    if not _loaded:
        try:
            from mpi4py import MPI as module
        except ImportError:  # the caller turns this into a clear message
            module = None
        MPI, _loaded = module, True
    return MPI


def available() -> bool:
    return _load() is not None


_OPS: dict = {}


def _ops() -> dict:
    """hvdlite's reduce ops -> MPI's (built once: a dict per call cost ~1 us)."""
    if not _OPS:
        _OPS.update({SUM: MPI.SUM, MIN: MPI.MIN, MAX: MPI.MAX, PRODUCT: MPI.PROD})
    return _OPS


def _op(op: int, dtype: torch.dtype):
    """The MPI op that reduces `dtype` by `op`: MPI's own, but for the minimum and maximum of
    floating-point data one of hvdlite's (_float_min_max)."""
    if (op == MIN or op == MAX) and dtype.is_floating_point:
        return _float_min_max(op)
    return _ops()[op]


_FLOAT_OPS: dict = {}


def _float_min_max(op: int):
    """An MPI op for the minimum or maximum of float32 / float64 data in which a NaN anywhere
    gives NaN on every rank, as torch.minimum / maximum and hvdlite's gloo and shared-memory
    paths give.

    Why: MPICH's MPI_MIN / MPI_MAX compare with `<`, so whether a NaN survives depends on the
    order the operands meet in, which differs between ranks: with a NaN on rank 0 and 1.0 on
    rank 1, rank 0 got 1.0 and rank 1 NaN, and the ranks went apart silently (a NaN check on
    the loss then took different branches). One NumPy pass over each piece MPI hands it, in
    place. (+0 against -0 may still come out either way, and a NaN's sign bit: both compare
    equal, so no branch depends on it.)"""
    made = _FLOAT_OPS.get(op)
    if made is not None:
        return made
    pick = np.maximum if op == MAX else np.minimum
    kinds = {4: np.float32, 8: np.float64}

    def reduce(inbuf, inoutbuf, datatype) -> None:
        kind = kinds[datatype.Get_size()]
        b = np.frombuffer(inoutbuf, dtype=kind)
        pick(np.frombuffer(inbuf, dtype=kind), b, out=b)

    made = _FLOAT_OPS[op] = MPI.Op.Create(reduce, commute=True)
    return made


def wait_mode(local_ranks: int | None = None) -> str:
    """'spin' or 'yield': how waits for MPI requests use the core.

    MPICH's Wait busy-polls: the lowest latency while every rank owns a core, but when ranks
    outnumber cores the spinning ranks take the core from the ones they wait for (4 ranks on 2
    cores ran the training step 1.4-1.6x slower than DDP). 'yield' polls with Test() and gives
    the core away between polls. HVDLITE_MPI_WAIT (or HOROVOD_MPI_WAIT) = spin | yield | auto;
    auto (the default) yields when this host runs more ranks than this process may use cores.
    """
    choice = config.choice("MPI_WAIT")
    if choice in ("spin", "yield"):
        return choice
    if local_ranks is None:
        local_ranks = _local_ranks(MPI.COMM_WORLD.Get_size() if _load() is not None else 1)
    return "yield" if local_ranks > usable_cores() else "spin"


INLINE_POLL_S = 250e-6


class MPITimeout(RuntimeError):
    """An MPI request did not complete within the transport timeout."""


class MPIAbandoned(RuntimeError):
    """A wait for an MPI request given up: the job had failed (MPICommunicator.abandon)."""


class _Waiter:
    """How this communicator's requests are waited for: spinning or yielding the core
    (wait_mode), and never longer than the transport timeout, or than the job's life.

    Why not MPI's Wait: it has no timeout, so a peer that never makes the matching call (a
    stuck or dead rank, or a bug that sends the ranks to different calls) held every rank in it
    forever, silently; a wrong call order in the join path once did exactly that. Spinning
    polls Test() and, every 256 polls (a few microseconds), checks the clock and gives up the
    GIL and the core (os.sched_yield), as MPICH's own Wait would poll its progress engine.
    `abandoned` (MPICommunicator.abandon) ends a wait at that check too."""

    __slots__ = ("yielding", "timeout_s", "rank", "abandoned")

    def __init__(self, yielding: bool, timeout_s: float, rank: int):
        self.yielding, self.timeout_s, self.rank = yielding, timeout_s, rank
        self.abandoned = False

    def block(self, req, what: str) -> None:
        if req.Test():
            return
        deadline = time.monotonic() + self.timeout_s
        if self.yielding:
            # Sleep a little longer each time (up to 200 us), so the core goes to the rank
            # being waited for; never spin for long.
            pause = 10e-6
            while not req.Test():
                if time.monotonic() >= deadline or self.abandoned:
                    self._expired(what)
                time.sleep(pause)
                pause = min(pause * 2, 200e-6)
            return
        polls = 0
        while not req.Test():
            polls += 1
            if polls & 255 == 0:
                if time.monotonic() >= deadline or self.abandoned:
                    self._expired(what)
                os.sched_yield()

    def _expired(self, what: str) -> None:
        if self.abandoned:
            raise MPIAbandoned(f"MPI {what} given up on rank {self.rank}: the job had failed "
                               f"(the error raised before this), so no rank would complete it")
        raise MPITimeout(
            f"MPI {what} did not complete within {self.timeout_s:.0f} s on rank {self.rank}: "
            f"another rank is stuck, has died, or made a different collective call (see the "
            f"other ranks' errors); raise the transport timeout, HOROVOD_GLOO_TIMEOUT_SECONDS, "
            f"if the ranks are only slow")


class _Request(PollableWork):
    """A pending MPI request; optionally copies a widened result back."""

    __slots__ = ("req", "what", "waiter", "wide", "out")

    def __init__(self, req, what: str, waiter: _Waiter, wide: torch.Tensor | None = None,
                 out: torch.Tensor | None = None):
        self.req, self.what, self.waiter, self.wide, self.out = req, what, waiter, wide, out

    def wait(self) -> None:
        self.waiter.block(self.req, self.what)
        if self.wide is not None:
            self.out.copy_(self.wide)

    def is_completed(self) -> bool:
        return bool(self.req.Test())


def _array(t: torch.Tensor):
    return t.numpy()


class _Sequence(PollableWork):
    """In-place allreduces of several tensors on one communicator, each launched as the one
    before it completes: one piece of work for the engine (MPICommunicator.allreduce_sequence),
    whose first call starts at its first test() or wait(), so the caller may fill the tensors
    after making it.

    Why: a fused response's members of INPLACE_MIN_BYTES or more are reduced in place, one MPI
    call each (collectives.Executor._allreduce_in_place). Resumed through the engine's
    generator once per member, each call cost ~20 us of Python beside its MPI time: 100
    tensors of 4-256 KiB took 4.8 ms on 2 ranks against raw mpi4py's 3.0 ms one by one. Here
    the next call starts from the test or wait that saw the last one end. (Launching them all
    at once was slower still: 3.8-4.4 ms raw, MPICH tracking 72 requests.)"""

    __slots__ = ("comm", "arrays", "op", "waiter", "i", "req")

    def __init__(self, comm, arrays: list, op, waiter: _Waiter):
        self.comm, self.arrays, self.op, self.waiter = comm, arrays, op, waiter
        self.i = -1                        # started by the first test or wait
        self.req = None

    def _next(self) -> bool:
        """The current call has completed: launch the next; False once none is left."""
        self.i += 1
        if self.i == len(self.arrays):
            return False
        self.req = self.comm.Iallreduce(MPI.IN_PLACE, self.arrays[self.i], self.op)
        return True

    def is_completed(self) -> bool:
        if self.i < 0:
            self._next()
        while self.i < len(self.arrays) and self.req.Test():
            if not self._next():
                return True
        return self.i >= len(self.arrays)

    def wait(self) -> None:
        if self.i < 0:
            self._next()
        while self.i < len(self.arrays):
            self.waiter.block(self.req, f"allreduce (member {self.i + 1} of "
                                        f"{len(self.arrays)} reduced in place)")
            self._next()


def _free(comm) -> None:
    """Free a communicator (None: nothing); at shutdown MPI may already be finalized."""
    if comm is not None:
        try:
            comm.Free()
        except Exception:
            pass


class Agreement(_AgreementBase):
    """The steady state's rounds (steady.py) as one small MPI allreduce each, which can also
    carry the data of the small float32 allreduces it releases (the round's payload).

    Why a round on MPI: a round only combines every rank's (ready bits, fallback flag). Over the
    control connections that costs a message each way between Python threads (~100 us on 2
    cores, and the ranks leave the round up to a one-way latency apart), while MPI does it
    through shared memory in a few us and lets every rank leave at almost the same moment. The
    rounds run on a duplicate of the set's communicator, so they never interleave with its data
    collectives: MPI matches each communicator's collectives in call order, and every rank
    starts rounds in round order and collectives in release order.

    Why a payload: a blocking allreduce of a small cached tensor (the express lane,
    engine.Engine._express) cost a round and then the data collective, two MPI calls and the
    Python around each; so did a grouped call of a few metrics, which also paid for a fusion
    buffer. A rank whose round offers only small float32 allreduces (sum or average, at most
    INLINE_FLOATS elements together) puts their tensors in the payload, one after another in
    ascending bit order, and tags the round. When every rank of the set offered the same bits
    and tagged, the payload's sum holds each tensor's allreduce at the same offset on every
    rank, and every rank takes them from there instead of launching a collective; otherwise
    the payload is ignored and the bits are released as before. Every rank sees the same
    sums, so every rank decides alike.

    The round is one float32 SUM over ``[flag per bit (width), fallback, tag, tag**2, payload]``:
    a bit is common when its flags sum to the set's size (an AND), the fallback is asked when
    its sum is above 0 (an OR). A tagging rank's tag is the number c of bits it offers, and
    every rank tagged c when the tags sum to size*c and their squares to size*c**2 (equality
    holds only when all are equal; an untagged rank adds 0). The payload is then carried when
    each of this rank's c bits is common: every rank has those c bits and offers c, so every
    rank offers exactly them and finds its own bits common too (and where one rank does not,
    by the same argument no rank does). The sums are exact integers in float32 while
    size*c**2 < 2**24; a round of more bits than that never tags (`_max_tagged`).
    """

    def __init__(self, comm):
        _load()
        self.comm = comm.Dup()
        self.size = comm.Get_size()
        self.width = -1
        # The most bits a tagged round may offer, so that its tags' sums stay exact.
        self._max_tagged = math.isqrt(((1 << 24) - 1) // max(self.size, 1))
        # Where MPI has persistent collectives (MPI 4: MPICH 4, Open MPI 5), a round restarts
        # one request built for its buffer: Start() skips the argument handling of a new
        # Iallreduce, ~1 us of a ~3 us round here. Every rank decides alike (one MPI library
        # per job), as it must: MPI never matches a persistent collective with another kind.
        self._persistent = hasattr(self.comm, "Allreduce_init")
        self._round = None
        self._busy = False                 # the persistent round is started and not seen done

    def _layout(self, width: int) -> None:
        """(Re)build the round buffer for `width` bits; reused by every round of that width
        (one round at a time per set), written through memoryviews (numpy's slice assignment
        costs ~1 us a round)."""
        self._free_round()
        self.width = width
        self.head = max(width, 1) + 3
        self._buf = np.zeros(self.head + INLINE_FLOATS, dtype=np.float32)
        self._f = memoryview(self._buf)
        self._bytes = self._f.cast("B")
        self._zero = bytes(4 * self.head)
        # Where a tagged round's tensor goes, and its result comes back (a view: no copy).
        self.payload = torch.from_numpy(self._buf[self.head:])
        if self._persistent:
            try:
                self._round = self.comm.Allreduce_init(MPI.IN_PLACE, self._buf, MPI.SUM)
            except (NotImplementedError, MPI.Exception):
                # An MPI before version 4 (mpi4py has the call, the library lacks it): every
                # rank runs the same library, so every rank falls back alike.
                self._persistent = False

    def _free_round(self) -> None:
        # A round still in flight was abandoned (a member left): its request stays, and
        # `_busy` with it, so the next start() says the rounds no longer pair up.
        if self._round is not None and not self._busy:
            try:
                self._round.Free()
            except Exception:          # at shutdown MPI may already be finalized
                pass
        self._round = None

    def payload_for(self, width: int) -> torch.Tensor:
        """Where the tensors of a tagged round of `width` bits go (the payload)."""
        if width != self.width:
            self._layout(width)
        return self.payload

    def start(self, bits: int, fallback: bool, width: int, tag: int = -1) -> "AgreementRequest":
        """Start a round offering `bits`; `tag` >= 0, the lowest of `bits`: the payload holds
        the tensors of every bit offered, in ascending bit order (the caller wrote them to
        `payload` first)."""
        if width != self.width:
            self._layout(width)
        f = self._f
        self._bytes[:4 * self.head] = self._zero
        count = 1
        if bits & (bits - 1) == 0:              # none, or one bit: the express lane's round
            if bits:
                f[bits.bit_length() - 1] = 1.0
        elif bits.bit_count() <= 8:             # a few: one flag each beats numpy's calls
            count = bits.bit_count()
            for b in set_bits(bits):
                f[b] = 1.0
        else:
            nbytes = (width + 7) // 8
            self._buf[:width] = np.unpackbits(
                np.frombuffer(bits.to_bytes(nbytes, "little"), dtype=np.uint8),
                bitorder="little")[:width]
            count = bits.bit_count()
        head = self.head
        if fallback:
            f[head - 3] = 1.0
        if tag >= 0 and not fallback and bits & -bits == 1 << tag \
                and count <= self._max_tagged:
            f[head - 2] = float(count)
            f[head - 1] = float(count * count)
        else:
            tag = -1
        if self._round is None:
            return AgreementRequest(self.comm.Iallreduce(MPI.IN_PLACE, self._buf, MPI.SUM),
                                    self, tag, bits, count)
        if self._busy:
            # The last round never ended (abandoned when a member left or the set went away):
            # its request cannot start again, and no later round could pair up anyway.
            raise RuntimeError("a steady-state round on this MPI communicator started while "
                               "the previous one had not finished; the set's rounds no longer "
                               "pair up across ranks")
        self._busy = True
        self._round.Start()
        return AgreementRequest(self._round, self, tag, bits, count)

    def close(self) -> None:
        self._free_round()
        _free(self.comm)
        self.comm = None


class AgreementRequest:
    """One round in flight: `test()` polls (one thread at a time), `value()` decodes it, and
    `inline` is then the lowest bit of a round whose payload holds the allreduce of every bit
    it offered, on every rank (else -1)."""

    __slots__ = ("req", "agreement", "tag", "inline", "bits", "count")

    def __init__(self, req, agreement: Agreement, tag: int, bits: int = 0, count: int = 1):
        self.req, self.agreement, self.tag, self.inline = req, agreement, tag, -1
        self.bits, self.count = bits, count

    def test(self) -> bool:
        if self.req.Test():
            self.agreement._busy = False
            return True
        return False

    def value(self) -> tuple[int, bool]:
        ag = self.agreement
        f, head, n, tag = ag._f, ag.head, ag.size, self.tag
        if tag >= 0:
            c = self.count
            if f[head - 2] == n * c and f[head - 1] == n * c * c and f[head - 3] == 0:
                # Every rank tagged a round of c bits, and none asked for the fallback (a rank
                # that asks for it never tags). When this rank's c bits are all common, every
                # rank offered exactly them (the class docstring of Agreement): the test
                # depends only on sums every rank shares, so every rank carries, or none does.
                bits = self.bits
                if f[tag] == n and (c == 1 or all(f[b] == n for b in set_bits(bits))):
                    self.inline = tag
                    return bits, False
        common = np.packbits(ag._buf[:ag.width] == n, bitorder="little").tobytes()
        return int.from_bytes(common, "little"), f[head - 3] > 0

    def payload(self) -> torch.Tensor:
        """The carried allreduces (once `inline` >= 0): MPI summed them in place."""
        return self.agreement.payload


# While every rank has a core (MPI waits spin), allreduces, reducescatters, allgathers and
# broadcasts of at least LARGE_MB MiB go through hvdlite's shared-memory channel
# (backends/shm.py) when the ranks share a host, and smaller ones through MPI, which also keeps
# the steady state's rounds. MPICH's own shared memory is faster for small collectives (a few
# us for 4 KiB, where the channel's Python costs tens); the channel wins from a few MiB on, and
# by far once a collective outgrows the cache. hvd.allreduce_ on 2 ranks of this project's
# 2-core machine, the same processes switching between the two paths, 7 alternating rounds,
# MPI against the channel: with warm caches 1 MiB 163 / 121 us, 4 MiB 0.55 / 0.41 ms, 16 MiB
# 4.0 / 2.1 ms, 64 MiB 33.1 / 8.0 ms; with the caches flushed before each call (as after a
# backward pass) 1 MiB 0.32 / 0.33 ms, 4 MiB 0.97 / 0.96, 8 MiB 1.93 / 1.50, 16 MiB 4.5 / 2.6,
# 32 MiB 16.6 / 4.5. They first set 8 MiB: below it the channel gained nothing cold, and the
# CNN of benchmarks/train_step.py, whose one flat buffer holds 4.4 MB, stepped at 0.78-0.80 x
# DDP with it through the channel against 0.76-0.77 through MPI (three alternating runs of
# `mpiexec -n 2 python benchmarks/train_step.py --models cnn`). Broadcasts of 1-64 MiB gained
# 1.2-1.8 x through the channel, allgathers 1.0-1.3 x.
# Those figures came from the same processes switching between the two paths, which
# understates MPICH: its large-message path needs ~15-20 calls of one size to reach its steady
# speed, and falls back after the channel ran in between (16 MiB on another machine of this
# kind: 7.2 ms for the first call, 2.2 from the 17th on; 4.5 ms again after five calls through
# the channel). Timed in steady state there, each path in processes of its own (2 ranks, the
# median of the last 10 of 30 calls), MPI against the channel: 8 MiB 1.1-1.3 / 1.6 ms, 16 MiB
# 2.2-2.6 / 3.1-3.4, 24 MiB 4.0-4.3 / 4.8-5.1, 32 MiB 11.8-12.7 / 6.4-6.5, 48 MiB 19.8-21.6 /
# 11.2-11.5: MPICH falls off between 24 and 32 MiB, and the channel wins from there on by far,
# as it did on the first machine. (A measurement at set-up, tried instead of a fixed size,
# caught MPICH before its steady state and sent 8 and 16 MiB to the channel, 1.3-1.4 x slower
# there; measuring the steady state would take ~0.3 s of every MPI job's start.) Hence 32 MiB.
LARGE_MB = 32.0

# A fused allreduce of two tensors or more, of at least this many bytes in all, goes through
# hvdlite's shared-memory channel even while the ranks spin (shm.ShmRouted.allreduce_tensors):
# it copies every member into its slot and the results out in a few multi-tensor calls, where
# MPI took one call per large member and the fusion buffer's copies for the small ones. Timed
# on 2 ranks in the same processes, the two routes alternating 8 rounds (median time from the
# response's start to its end, MPI / channel): 100 tensors of 4-256 KiB (12.8 MiB) 4.2 / 3.0
# ms, 100 of 1-64 KiB (3.2 MiB) 1.48 / 1.11, 20 of 4-256 KiB 0.82 / 0.67, 10 0.36 / 0.25, 4
# 0.17 / 0.12, 2 (0.33 MiB) 0.092 / 0.073 ms; below ~128 KiB neither won (2 of 8 KiB, 8 of
# 8 KiB, 100 of 1 KiB: 0.87-1.16). A single tensor stays with MPI below LARGE_MB.
FUSED_MIN_BYTES = 256 << 10

# A fused allreduce's members of at least this many bytes are reduced in place, one MPI call
# each (collectives.Executor._allreduce_in_place), instead of through the fusion buffer: MPI's
# per-call cost on one host (~15 us with the Python around it) is below what copying 64 KiB
# into the buffer and back costs (~17 us with both ranks copying at once).
INPLACE_MIN_BYTES = 64 << 10


def large_bytes() -> int:
    """HVDLITE_MPI_SHM_MIN_MB as bytes: from this size on, collectives of ranks that spin go
    through hvdlite's shared-memory channel instead of MPI (0 turns that off)."""
    mb = config.env_float("MPI_SHM_MIN_MB", LARGE_MB)
    if not mb >= 0:
        raise ValueError(f"HVDLITE_MPI_SHM_MIN_MB={mb}: must be >= 0 (0 keeps MPI for all)")
    return int(mb * (1 << 20))


class MPICommunicator(shm.ShmRouted):
    """Non-blocking MPI collectives; when ranks outnumber cores, hvdlite's shared-memory channel
    carries what it can (shm.ShmRouted) and MPI the rest."""

    device = "cpu"
    inplace_min_bytes = INPLACE_MIN_BYTES

    def __init__(self, comm, in_order: bool = False, rounds: bool = True, store=None,
                 timeout_s: float = 60.0):
        _load()  # the caller may hand in its own mpi4py communicator
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "the MPI transport needs MPI_THREAD_MULTIPLE, but this MPI provides thread "
                f"level {MPI.Query_thread()}; unset HOROVOD_MPI_THREADS_DISABLE or use gloo "
                "(HOROVOD_CPU_OPERATIONS=gloo).")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.yielding = wait_mode() == "yield"
        self.waiter = _Waiter(self.yielding, timeout_s, self.rank)
        # The engine may poll a small collective for this long before handing it to its
        # finisher thread (Engine._poll_inline): MPI's shared-memory latency is a few us, far
        # below a thread hand-off. Not when ranks outnumber cores: polling would take the core.
        self.inline_poll_s = 0.0 if self.yielding else INLINE_POLL_S
        # `rounds`: the steady state's rounds run on a duplicate of `comm` (Agreement).
        # `in_order`: another duplicate, on which only the engine's finisher thread launches
        # collectives, one after another in the order the ranks released them; so a collective
        # made of several calls (collectives.Executor._allreduce_in_place) never interleaves
        # with the calls the background thread launches on `comm` meanwhile: MPI matches each
        # communicator's collectives in call order, which two threads would not keep. One
        # communicator of a job has it (the global set's for CPU tensors: select.py): the
        # finisher serves every communicator from one queue, in each rank's own release order,
        # so calls that two communicators left to it could wait on each other across ranks (A's
        # first on one rank, B's first on another). Not where waits yield the core: each call
        # would then cost a sleep between polls (4 ranks on 2 cores ran the training step 4-5 %
        # slower so), and one fused call pays it once. The ranks agree on it (wait modes are
        # chosen per host), since every rank must make the same calls.
        self.agreement = Agreement(comm) if rounds else None
        self.in_order = None
        if in_order and comm.allreduce(not self.yielding, op=MPI.LAND):
            self.in_order = MPICommunicator(comm.Dup(), rounds=False, timeout_s=timeout_s)
        # When ranks outnumber cores (any rank yields), MPICH still busy-polls inside its own
        # progress engine, and every rank's spin takes the core from the rank it waits for.
        # hvdlite's shared-memory channel sleeps in select() on a FIFO instead, so the data of
        # allreduce, reducescatter, allgather and broadcast goes through it (4 ranks on 2 cores:
        # the MLP step went from 0.83 to 0.70 x DDP's). The steady state's rounds then go over
        # the control connections, whose waits also sleep (CNN 0.92 -> 0.88 x DDP's against
        # rounds on MPI). `store` (the set's own prefix of the job's store) carries the set-up;
        # the ranks agree over MPI.
        # Spinning ranks keep MPI for everything below LARGE_MB and the steady state's rounds
        # on MPI; the channel carries the larger collectives (LARGE_MB says why). The ranks
        # agree on the size, as every rank must route a collective alike: the largest any
        # rank asks for, or none (MPI for all) if any rank sets 0.
        if store is not None and rounds and self.size > 1:
            asked = comm.allgather((self.yielding, large_bytes()))
            anyone_yields = any(y for y, _ in asked)
            from_bytes = 0 if any(b == 0 for _, b in asked) else max(b for _, b in asked)
            if anyone_yields or from_bytes > 0:
                self.shm = shm.connect(store, self.rank, self.size, timeout_s,
                                       self._all_agree)
            if self.shm is not None and not anyone_yields:
                self.shm_min_bytes = from_bytes
                self.shm_fused_min_bytes = min(FUSED_MIN_BYTES, from_bytes)
            elif self.shm is not None and self.agreement is not None:
                self.agreement.close()
                self.agreement = None

    def _all_agree(self, ok: bool) -> bool:
        """True on every rank when `ok` is True on every rank (one MPI allreduce)."""
        return bool(self.comm.allreduce(bool(ok), op=MPI.LAND))

    @classmethod
    def for_ranks(cls, world, ranks: list[int], in_order: bool = False, store=None,
                  timeout_s: float = 60.0) -> "MPICommunicator":
        """A communicator over `ranks` of the job's world; collective over those ranks only."""
        if len(ranks) == world.Get_size():
            return cls(world.Dup(), in_order, store=store, timeout_s=timeout_s)
        group = world.Get_group().Incl(list(ranks))
        return cls(world.Create_group(group), in_order, store=store, timeout_s=timeout_s)

    def allreduce_sequence(self, tensors: list, op: int):
        """In-place allreduces of contiguous CPU `tensors` on this communicator, one after
        another (_Sequence says why), as one piece of work; None where a dtype needs widening
        (those go one by one through _allreduce) or shared memory carries the data."""
        if self.fuses_in_place or any(t.dtype in _WIDEN for t in tensors):
            return None
        return _Sequence(self.comm, [_array(t) for t in tensors], _op(op, tensors[0].dtype),
                         self.waiter)

    def _allreduce(self, tensor: torch.Tensor, op: int):
        wide = _WIDEN.get(tensor.dtype)
        work = tensor.to(wide) if wide is not None else tensor
        req = self.comm.Iallreduce(MPI.IN_PLACE, _array(work), _op(op, work.dtype))
        return _Request(req, "allreduce", self.waiter, work if wide is not None else None,
                        tensor)

    def _reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int):
        wide = _WIDEN.get(output.dtype)
        out = output.to(wide) if wide is not None else output
        src = tensor.to(wide) if wide is not None else tensor
        req = self.comm.Ireduce_scatter_block(_array(src), _array(out), _op(op, src.dtype))
        return _Request(req, "reducescatter", self.waiter, out if wide is not None else None,
                        output)

    def _allgather(self, output: torch.Tensor, tensor: torch.Tensor):
        return _Request(self.comm.Iallgather(_array(tensor), _array(output)), "allgather",
                        self.waiter)

    def _broadcast(self, tensor: torch.Tensor, root: int):
        return _Request(self.comm.Ibcast(_array(tensor), root=root), "broadcast",
                        self.waiter)

    def alltoall(self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]):
        in_displs = [sum(in_splits[:i]) for i in range(len(in_splits))]
        out_displs = [sum(out_splits[:i]) for i in range(len(out_splits))]
        req = self.comm.Ialltoallv([_array(tensor), list(in_splits), in_displs, MPI.BYTE],
                                   [_array(output), list(out_splits), out_displs, MPI.BYTE])
        return _Request(req, "alltoall", self.waiter)

    def abandon(self) -> None:
        """The job has failed: end every wait for this communicator's requests at its next
        check (a few microseconds) instead of at the transport timeout.

        Why: a collective one rank left half done (it failed there) is never completed by the
        others; their finisher threads waited for it until the timeout, and shutdown waited
        for them, so every rank of a failed job took 10 s longer to exit. The requests are
        left as they are: MPI cannot cancel a collective, and the process is on its way out."""
        self.waiter.abandoned = True
        if self.in_order is not None:
            self.in_order.abandon()

    def close(self) -> None:
        self.close_shm()
        if self.agreement is not None:
            self.agreement.close()
        if self.in_order is not None:
            self.in_order.close()
        _free(self.comm)
        self.comm = None


# ---------------------------------------------------------------------- job set-up over MPI
_LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def launched_by_mpi() -> bool:
    """True when mpirun/mpiexec started this process (MPICH hydra, Open MPI, PMIx, MVAPICH)."""
    return any(v in os.environ for v in _LAUNCH_VARS)


def started_by_mpi() -> bool:
    """Launched by mpirun and able to talk MPI: ranks then meet over MPI."""
    return launched_by_mpi() and available()


def threads_supported() -> bool:
    mpi = _load()
    return mpi is not None and mpi.Query_thread() >= mpi.THREAD_MULTIPLE


def world(comm=None):
    """The communicator the job runs on: COMM_WORLD, an mpi4py communicator passed to
    init(comm=...), or a list of COMM_WORLD ranks (Horovod's init(comm=[...]))."""
    _load()
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, (list, tuple)):
        ranks = sorted(int(r) for r in comm)
        w = MPI.COMM_WORLD
        sub = w.Create_group(w.Get_group().Incl(ranks))
        if sub == MPI.COMM_NULL:
            raise ValueError(f"init(comm={ranks}): rank {w.Get_rank()} of COMM_WORLD is not in "
                             f"the list; only listed ranks may call init().")
        return sub
    if hasattr(comm, "Get_rank") and hasattr(comm, "Get_size"):
        return comm
    raise ValueError("init(comm=...) takes an mpi4py communicator or a list of ranks")


def identity(comm):
    hostname = (config.raw("HVDLITE_HOSTNAME") or config.raw("HOROVOD_HOSTNAME")
                or socket.gethostname())
    return Identity(comm.Get_rank(), comm.Get_size(), None, None, False, "MPI", hostname)


def job_key(comm) -> bytes:
    """Rank 0 draws the job's control-channel key and hands it to every rank over MPI."""
    return comm.bcast(os.urandom(32) if comm.Get_rank() == 0 else None, root=0)


def share_store(comm, timeout_s: float):
    """A c10d store for gloo/NCCL communicators in an MPI-launched job: rank 0 serves it,
    every rank learns where over MPI."""
    import datetime

    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    if comm.Get_size() == 1:
        return dist.HashStore()
    if comm.Get_rank() == 0:
        store = dist.TCPStore("0.0.0.0", 0, None, True, timeout=timeout, wait_for_workers=False)
        share_address(comm, store.port)
        return store
    host, port = share_address(comm, None)
    return dist.TCPStore(host, port, None, False, timeout=timeout)


def share_address(comm, port: int | None) -> tuple[str, int]:
    """Rank 0's coordinator address, given to every rank over MPI."""
    hosts = comm.allgather(socket.gethostname())
    if comm.Get_rank() == 0:
        explicit = config.raw("HVDLITE_COORDINATOR_ADDR")
        if explicit:
            host = explicit
        elif len(set(hosts)) == 1:
            host = "127.0.0.1"
        else:
            host = socket.gethostbyname(socket.gethostname())
        address = (host, port)
    else:
        address = None
    return comm.bcast(address, root=0)
