"""Shared-memory data path for the ranks of a gloo (or MPI) communicator that share one host.

Why: on one host gloo moves every byte through TCP loopback (about 1.1-1.4 GB/s on this
project's machine, and 0.6-1.6 ms even for 4 KiB), while the ranks could read each other's
memory: MPICH does so and reduces 16 MiB in ~2 ms. torch DDP over gloo pays the TCP cost;
hvdlite need not. gloo keeps everything this path does not cover (alltoall, ranks on several
hosts, dtypes torch cannot reduce elementwise).

How. The ranks map one file of /dev/shm: a header page (one progress counter per rank, each on
its own cache line), one input slot of `slot_bytes` per rank, and one result area of the same
size. A collective runs in chunks of at most one slot:

  1. wait until every peer has finished the previous chunk (it no longer reads my slot or the
     result area);
  2. copy my part of the chunk into my slot; publish; wait for every peer;
  3. (reductions) reduce my 1/N of the chunk, reading that range of every slot, into the
     result area; publish; wait for every peer. (An allreduce reads my own 1/N from my input
     instead, where it lies in one input tensor and is not prescaled, and step 2 skips it:
     no peer reads that range of my slot. 2 ranks, 4-64 MiB: 1.14-1.18 x faster.)
  4. copy the results out (of the result area, or of the peers' slots); publish (nobody waits
     here: step 1 of the next chunk does, usually long after).

A fused allreduce copies its tensors straight into the slot and its results straight out of the
result area (with Average's or a postscale's factor applied while copying), so the engine's
fusion buffer and its two extra passes over memory are not used.

"Publish" raises my counter (every rank runs the same phases in the same order, so the counters
agree) and writes one byte into every peer's FIFO. A waiter re-reads the counters and sleeps in
select() on its own FIFO between checks: a waiting rank leaves the core to the others (4 ranks
on 2 cores stay fast), and no wake-up is lost (a byte written before the select makes it return
at once). Every element is reduced by exactly one rank and copied by the others, so all ranks
get identical bits.

Set-up is collective, beside the gloo process group's: rank 0 creates and maps the file and
posts its path, size and a random token in the job's store; every other rank maps it and checks
the token; each rank creates a FIFO and opens every peer's. One gloo allreduce then tells every rank whether all of them succeeded; if any did not
(ranks on several hosts, containers with separate /dev/shm, /dev/shm full, HVDLITE_SHM=0), the
whole communicator keeps gloo. Space is reserved with posix_fallocate, so a full /dev/shm is a
refusal at set-up, never a SIGBUS later, and the slot shrinks to fit a small /dev/shm (a
container's default is 64 MiB). Files are unlinked as soon as every rank has mapped
them, so a crash leaves nothing behind. Waits are bounded by the transport timeout and check
once a second that the peers' processes are alive, so a dead or stuck peer becomes an error
naming its rank and pid instead of a hang.

Ordering: a peer reads my data after it sees my counter; x86-64 keeps stores in order as other
cores see them, so `auto` enables this path there only (HVDLITE_SHM=1 forces it elsewhere).
"""
from __future__ import annotations

import bisect
import collections
import logging
import mmap
import os
import platform
import secrets
import select
import threading
import time
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from .. import config
from ..threads import local_ranks, usable_cores
from ..messages import MAX, MIN, PRODUCT, SUM
from ..protocol import INLINE_FLOATS    # a round's payload (ShmAgreement)
from ..arith import copy_scaled, reduce_in_order, scale_
from ..flat import unpack
from .base import Agreement, Communicator, ThreadedWork

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# The widest steady-state round (cache bits) the segment's agreement area carries; a wider one
# (a response cache over 4096 entries) runs its rounds over the control connections instead.
AGREE_BITS = 4096
_AGREE_WORDS = 1 + AGREE_BITS // 64            # the fallback word, then the bits
_WORD = (1 << 64) - 1                           # one agreement word's bits
# One round's words: the fallback word, the bits, the tag word, then the payload.
_PARITY_WORDS = _AGREE_WORDS + 1 + INLINE_FLOATS // 2
# Per rank: its round counter on a cache line of its own, then two rounds' words.
_AGREE_STRIDE = (64 + 2 * _PARITY_WORDS * 8 + 63) // 64 * 64
# An allreduce this small is reduced whole by every rank (ShmChannel._allreduce_direct).
DIRECT_BYTES = 64 << 10
# A collective this small may run on the thread that submits it (ShmChannel._submit).
INLINE_BYTES = 1 << 20
# How long that thread spins for its peers before the worker thread takes the collective over;
# also how long each of the worker's waits spins before it sleeps (ShmChannel._wait).
INLINE_POLL_S = 250e-6
# While every rank has a core (the channel spins), a large collective runs in chunks of at most
# this many bytes instead of whole slots: a chunk's copies and its share of the reduction stay
# in the cores' caches, and the peers, working through the same chunks in step, are caught by
# the waits' spin (_wait) instead of a FIFO wake-up each. 2 ranks on this project's 2-core
# machine, blocking hvd.allreduce_ in the same processes, 7 alternating rounds, against whole
# 8 MiB slots with sleeping waits: 16 MiB 1.31-1.40 x faster (2.10-2.20 ms a call against
# 2.68-3.03), 64 MiB 1.29-1.36 x (8.0-8.4 ms against 10.3-11.3); chunks of 1 and 4 MiB did
# 1.21-1.28 x. When ranks outnumber cores the waits sleep, each wake-up costs ~50 us or more,
# and whole slots keep them few. That gain is the machine's, though: on another machine of the
# same kind, whole slots were 1.2 x faster than 2 MiB chunks at 16 MiB (3.5 against 4.3 ms),
# for a reason not pinned down (plain copies between its two cores ran as fast as within
# one). So the channel measures both at set-up (ShmChannel.settle_chunk) unless
# HVDLITE_SHM_CHUNK_MB says which.
SPIN_CHUNK_BYTES = 2 << 20
# The allreduce that settle_chunk times, of a float32 tensor this large, both ways, in
# rounds that alternate which goes first; so many rounds of each (~40 ms at set-up on 2 ranks,
# once a process).
CALIBRATE_BYTES = 8 << 20
CALIBRATE_ROUNDS = 5
# What this process's channels settled on by measuring, by (ranks, slot): later communicators
# of the same shape agree on it instead of measuring again.
_settled: dict[tuple[int, int], int] = {}


# A collective's phases (ShmChannel's collectives): (counter target, what) at each wait.
Waits = Iterator[tuple[int, str]]


def header_bytes(size: int) -> int:
    """Token, then one counter per rank on its own cache line, then each rank's agreement area
    (ShmAgreement); whole pages, so slots stay aligned."""
    return (64 * (size + 1) + _AGREE_STRIDE * size + 4095) // 4096 * 4096
_FNS: dict[int, Callable] = {SUM: torch.add, MIN: torch.minimum, MAX: torch.maximum,
                             PRODUCT: torch.mul}
_REDUCIBLE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64}
_RECHECK_S = 0.2                    # a select() never sleeps longer than this
_LIVENESS_S = 1.0                   # how often a long wait checks that peers are alive


def mode() -> str:
    """'on' or 'off' for this process: HVDLITE_SHM = auto (default) | 1 | 0."""
    choice = config.choice("SHM")
    if choice in ("0", "off", "false", "no"):
        return "off"
    if choice in ("1", "on", "true", "yes"):
        return "on"
    return "on" if platform.machine().lower() in ("x86_64", "amd64") else "off"


def chunk_setting() -> Optional[int]:
    """HVDLITE_SHM_CHUNK_MB: None for `auto` (the default), else bytes per chunk of a large
    collective (0: whole slots)."""
    value = config.choice("SHM_CHUNK_MB")
    if value == "auto":
        return None
    mb = float(value)
    return 0 if mb == 0 else max(4096, int(mb * 1024 * 1024) // 4096 * 4096)


def slot_bytes() -> int:
    mb = config.env_float("SHM_SLOT_MB", 8.0)
    if mb <= 0:
        raise ValueError(f"HVDLITE_SHM_SLOT_MB={mb}: must be > 0")
    return max(4096, int(mb * 1024 * 1024) // 4096 * 4096)


class ShmError(RuntimeError):
    """A shared-memory collective could not finish (timeout, dead peer)."""


class _Work(ThreadedWork):
    """Pending shared-memory collective: `wait()` blocks until the channel ran it.

    Completion is a flag and a lock held until then (as engine.Handle's): a threading.Event
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


class ShmAgreement(Agreement):
    """The steady state's rounds (steady.py) through the segment: what Agreement is on MPI.

    Why: over the control connections a round costs a message each way between the ranks'
    background threads, woken by TCP loopback (~0.5 ms of a 4 KiB allreduce's 0.66 ms on 2
    ranks), while the ranks share memory and can read each other's bits.

    A round is (AND of bits, OR of fallback flags). Rank r's area holds its round counter and
    two rounds' words (the fallback flag, the bits as 64-bit words, a tag word and a payload
    of INLINE_FLOATS float32 elements); round k uses the words of parity k % 2. start() writes
    the words, then raises the counter (x86-64 keeps stores in order, as the data path
    assumes); test() is true once every counter reached k, and value() combines the words.
    Every rank starts the rounds of a set in the same order (as MPI matches them by call
    order), so a peer's counter is k or k + 1 while this rank is in round k: no rank can start
    round k + 2, and overwrite round k's words, before every rank has started k + 1, after
    reading round k. One thread at a time starts and tests rounds (the engine's contract for
    TransportRound).

    The payload carries the small allreduces a round releases, as MPI's rounds do
    (backends/mpi.Agreement says why): a rank whose round offers only small float32 tensors
    writes them to its payload, one after another in ascending bit order, and tags the round
    (tag word = the number of bits offered << 32 | the lowest bit + 1). When every rank's tag
    word is the same, its bit words too (compared only for more than one bit: one bit is
    its tag), and no rank asked for the fallback, every rank sums the ranks' payloads in rank
    order (so the bits agree everywhere) and the round was the whole allreduce of each tensor.
    The payloads of round k stay readable until round k + 2 starts, which needs every rank to
    have started k + 1: the engine finishes carried tensors before it starts the set's next
    round.
    """

    max_width = AGREE_BITS

    def __init__(self, seg: mmap.mmap, rank: int, size: int, offset: int):
        stride = _AGREE_STRIDE // 8
        # Words read and written one at a time as Python ints: numpy's calls cost more than
        # the few words of a round (64 bits or fewer for most models).
        self._mv = memoryview(seg)[offset:offset + size * _AGREE_STRIDE].cast("Q")
        self._ctrs = [r * stride for r in range(size)]
        self._words = [r * stride + 8 for r in range(size)]    # parity p: + p * _PARITY_WORDS
        self._rank = rank
        self._round = 0
        # Each rank's payload, per parity, as float32 tensors over the segment (dropped at close,
        # so the mapping can close), and the sum a carried round's result is made in.
        self._payloads = [[torch.frombuffer(
            seg, dtype=torch.float32, count=INLINE_FLOATS,
            offset=offset + 8 * (self._words[r] + p * _PARITY_WORDS + _AGREE_WORDS + 1))
            for p in (0, 1)] for r in range(size)]
        self._sum = torch.empty(INLINE_FLOATS, dtype=torch.float32)

    def payload_for(self, width: int) -> torch.Tensor:
        """Where the next round's tensor goes (this rank's payload of that round's parity)."""
        return self._payloads[self._rank][(self._round + 1) & 1]

    def start(self, bits: int, fallback: bool, width: int,
              tag: int = -1) -> "ShmAgreementRequest":
        """Start a round offering `bits`; `tag` >= 0, the lowest of `bits`: this rank's payload
        (payload_for) holds the tensors of every bit offered, in ascending bit order."""
        if width > AGREE_BITS:
            raise ValueError(f"a round of {width} bits exceeds the agreement's {AGREE_BITS}")
        n = (max(width, 1) + 63) // 64
        k = self._round = self._round + 1
        mv, base = self._mv, self._words[self._rank] + (k & 1) * _PARITY_WORDS
        mv[base] = 1 if fallback else 0
        for j in range(n):
            mv[base + 1 + j] = (bits >> (64 * j)) & _WORD
        if tag < 0 or fallback or bits & -bits != 1 << tag:
            tag = -1
            mv[base + _AGREE_WORDS] = 0
        else:
            mv[base + _AGREE_WORDS] = bits.bit_count() << 32 | tag + 1
        mv[self._ctrs[self._rank]] = k         # after the words (see the class docstring)
        return ShmAgreementRequest(self, k, n, tag)

    def close(self) -> None:
        """Release the views of the segment, so its mapping can close."""
        self._payloads = []
        self._mv.release()


class ShmAgreementRequest:
    """One round in flight: `test()` polls, `value()` decodes it (see ShmAgreement)."""

    __slots__ = ("agreement", "k", "n", "tag", "inline")

    def __init__(self, agreement: ShmAgreement, k: int, n: int, tag: int = -1):
        self.agreement, self.k, self.n, self.tag, self.inline = agreement, k, n, tag, -1

    def test(self) -> bool:
        mv, k = self.agreement._mv, self.k
        for c in self.agreement._ctrs:
            if mv[c] < k:
                return False
        return True

    def value(self) -> tuple[int, bool]:
        ag, n = self.agreement, self.n
        mv, off = ag._mv, (self.k & 1) * _PARITY_WORDS
        if self.tag >= 0:
            mine = ag._words[ag._rank] + off
            t = mv[mine + _AGREE_WORDS]
            several = t >> 32 > 1
            for base in ag._words:
                if mv[base + off + _AGREE_WORDS] != t or mv[base + off] != 0:
                    break
                if several and base + off != mine and any(
                        mv[base + off + 1 + j] != mv[mine + 1 + j] for j in range(n)):
                    break
            else:
                # Every rank tagged the same bits, with no fallback: the same test on every
                # rank, over the same words.
                self.inline = self.tag
                bits = 0
                for j in range(n):
                    bits |= mv[mine + 1 + j] << (64 * j)
                return bits, False
        bits, fallback = 0, False
        for j in range(n):
            word = _WORD
            for base in ag._words:
                word &= mv[base + off + 1 + j]
            bits |= word << (64 * j)
        for base in ag._words:
            fallback = fallback or mv[base + off] != 0
        return bits, fallback

    def payload(self) -> torch.Tensor:
        """The carried allreduces (once `inline` >= 0): the ranks' payloads summed in rank
        order, the same bits on every rank."""
        ag, p = self.agreement, self.k & 1
        return reduce_in_order(torch.add, [ag._payloads[r][p] for r in range(len(ag._words))],
                               ag._sum)


class ShmChannel:
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
        asked = chunk_setting()
        key = (self.size, self.slot)
        known = _settled.get(key, -1)
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
            chunk = _settled[key] = self._measure_chunk()
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

    # ------------------------------------------------------------------ collectives
    # Each is a generator: it yields (counter target, what) where it must wait for every peer,
    # and the thread running it waits (_run: sleeping; _run_inline: spinning).
    def _allreduce(self, ins: list, outs: list, fn: Callable, pre: float, post: float) -> Waits:
        """Fused allreduce of the flat tensors `ins` into `outs` (see allreduce_tensors)."""
        counts = [t.numel() for t in ins]
        n, size, rank = sum(counts), self.size, self.rank
        if n == 0:
            return
        dtype = ins[0].dtype
        item = ins[0].element_size()
        per = max(size, self.chunk // item)         # elements per chunk
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        if n * item <= min(DIRECT_BYTES, self.slot):
            yield from self._allreduce_direct(ins, outs, fn, pre, post, counts, offsets,
                                              dtype, item)
            return
        for lo in range(0, n, per):
            m = min(per, n - lo)
            a, b = rank * m // size, (rank + 1) * m // size      # the part this rank reduces
            # This rank's own part is read from its inputs, not from its slot, where nothing
            # else reads it (the peers read only their own parts of every slot): one copy of
            # 1/size of the chunk less, when it is not prescaled. Where that part spans several
            # inputs (a fused allreduce), it is reduced input by input: 100 tensors of 4-256
            # KiB through 8 MiB slots on 2 ranks, 3.8-3.9 ms a call against 4.9 copying it all.
            # Not where those inputs are small (OWN_PIECE_BYTES): a reduction per input costs
            # ~7 us of Python, more than copying a small input into the slot and reducing the
            # part in one call.
            own = pre == 1.0 and b > a and \
                (b - a) * item >= OWN_PIECE_BYTES * _count(offsets, lo + a, lo + b)
            yield self._end, "allreduce"      # peers finished the previous chunk
            mine = self._view(rank, m * item, dtype)
            if own:
                for x, y in ((lo, lo + a), (lo + b, lo + m)):
                    if y > x:
                        _gather(mine[x - lo:y - lo], ins, offsets, x, y)
            elif m == n:
                torch.cat(ins, out=mine) if len(ins) > 1 else mine.copy_(ins[0])
            else:
                _gather(mine, ins, offsets, lo, lo + m)
            if not own:
                scale_(mine, pre)
            yield self._publish(), "allreduce (inputs)"
            res = self._view(-1, m * item, dtype)
            if b > a:
                slots = [self._view(r, m * item, dtype) for r in range(size)]
                if not own:
                    reduce_in_order(fn, [v[a:b] for v in slots], res[a:b])
                else:
                    for i, p, q in _pieces(offsets, lo + a, lo + b):
                        parts = [v[p - lo:q - lo] for v in slots]
                        parts[rank] = ins[i][p - offsets[i]:q - offsets[i]]
                        reduce_in_order(fn, parts, res[p - lo:q - lo])
            yield self._publish(), "allreduce (reduction)"
            _scatter(res[:m], outs, offsets, lo, lo + m, post)
            self._end_chunk()

    def _allreduce_direct(self, ins: list, outs: list, fn: Callable, pre: float, post: float,
                          counts: list, offsets: list, dtype: torch.dtype,
                          item: int) -> Waits:
        """A small allreduce in one chunk, where every rank reduces all of it into its own
        outputs: one wait for the peers instead of two (the result area's phase), which is most
        of a small collective's time. Every rank adds the slots in the same order, so all get
        identical bits."""
        n, size, rank = offsets[-1], self.size, self.rank
        yield self._end, "allreduce"          # peers finished the previous chunk
        mine = self._view(rank, n * item, dtype)
        torch.cat(ins, out=mine) if len(ins) > 1 else mine.copy_(ins[0])
        scale_(mine, pre)
        yield self._publish(), "allreduce (inputs)"
        one = len(outs) == 1 and outs[0] is not None
        dst = outs[0] if one else torch.empty(n, dtype=dtype)
        reduce_in_order(fn, [self._view(r, n * item, dtype) for r in range(size)], dst)
        self._end_chunk()
        scale_(dst, post)
        if not one:
            unpack(dst, outs, counts)

    def _reducescatter(self, output: torch.Tensor, flat: torch.Tensor, fn: Callable) -> Waits:
        size, rank = self.size, self.rank
        n = output.numel()
        if n == 0:
            return
        item = flat.element_size()
        parts = flat.view(size, n)
        per = max(1, self.chunk // (item * size))   # elements per part per chunk
        for lo in range(0, n, per):
            m = min(per, n - lo)
            yield self._end, "reducescatter"      # peers finished the previous chunk
            self._view(rank, size * m * item, flat.dtype).view(size, m).copy_(parts[:, lo:lo + m])
            yield self._publish(), "reducescatter (inputs)"
            out = output[lo:lo + m]
            first = True
            for r in [rank] + [r for r in range(size) if r != rank]:
                mine = self._view(r, size * m * item, flat.dtype).view(size, m)[rank]
                if first:
                    out.copy_(mine)
                    first = False
                else:
                    fn(out, mine, out=out)
            self._end_chunk()

    def _allgather(self, output: torch.Tensor, flat: torch.Tensor) -> Waits:
        n, size, rank = flat.numel(), self.size, self.rank
        if n == 0:
            return
        rows = output.view(size, n)
        for lo in range(0, n, self.chunk):
            m = min(self.chunk, n - lo)
            yield self._end, "allgather"      # peers finished the previous chunk
            self._slots[rank][:m].copy_(flat[lo:lo + m])
            yield self._publish(), "allgather (inputs)"
            for r in range(size):
                rows[r, lo:lo + m].copy_(flat[lo:lo + m] if r == rank else self._slots[r][:m])
            self._end_chunk()

    def _broadcast(self, flat: torch.Tensor, root: int) -> Waits:
        n, rank = flat.numel(), self.rank
        for lo in range(0, n, self.chunk):
            m = min(self.chunk, n - lo)
            yield self._end, "broadcast"      # peers finished the previous chunk
            if rank == root:
                self._slots[rank][:m].copy_(flat[lo:lo + m])
            yield self._publish(), "broadcast (root's data)"
            if rank != root:
                flat[lo:lo + m].copy_(self._slots[root][:m])
            self._end_chunk()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat bytes (no copy; collectives.as_bytes, which a
    backend does not import, does the same for the engine)."""
    return t.view(-1).view(torch.uint8)


# A fused allreduce's own part is reduced input by input (ShmChannel._allreduce) only where its
# inputs there are at least this large on average; smaller ones are copied into the slot and
# the part reduced in one call.
OWN_PIECE_BYTES = 64 << 10


def _count(offsets: list[int], lo: int, hi: int) -> int:
    """How many of the consecutive tensors starting at `offsets` the flat range [lo, hi)
    touches."""
    return bisect.bisect_left(offsets, hi) - bisect.bisect_right(offsets, lo) + 1


def _parts(tensors: list, offsets: list[int], lo: int, hi: int) -> tuple[list, list]:
    """The indices of the tensors the flat range [lo, hi) touches, and views of their parts in
    it: the tensors themselves where the range holds them whole (no view to make)."""
    idx, views = [], []
    for i, p, q in _pieces(offsets, lo, hi):
        t = tensors[i]
        idx.append(i)
        if t is None:
            views.append(None)
        elif p == offsets[i] and q == offsets[i + 1]:
            views.append(t)
        else:
            views.append(t[p - offsets[i]:q - offsets[i]])
    return idx, views


def _gather(dst: torch.Tensor, ins: list, offsets: list[int], lo: int, hi: int) -> None:
    """dst = the flat range [lo, hi) of the consecutive `ins`, in one copy (torch.cat) where it
    spans several: a Python-level copy per tensor cost ~3 us each."""
    views = _parts(ins, offsets, lo, hi)[1]
    if len(views) == 1:
        dst.copy_(views[0])
    else:
        torch.cat(views, out=dst)


def _scatter(src: torch.Tensor, outs: list, offsets: list[int], lo: int, hi: int,
             post: float) -> None:
    """Copy `src`, the flat range [lo, hi) of the consecutive outputs `outs` (None: dropped),
    into them, times `post`: through flat.unpack's multi-tensor copies for floats, one copy
    per part otherwise. `src` (the shared result area, which the peers still read) is never
    written; unpack scales integers in its buffer, so those go part by part."""
    idx, views = _parts(outs, offsets, lo, hi)
    if post == 1.0 or src.is_floating_point():
        unpack(src, views, [min(hi, offsets[i + 1]) - max(lo, offsets[i]) for i in idx], post)
        return
    at = 0
    for i, v in zip(idx, views):
        n = min(hi, offsets[i + 1]) - max(lo, offsets[i])
        if v is not None:
            copy_scaled(v, src[at:at + n], post)
        at += n


def _pieces(offsets: list[int], lo: int, hi: int):
    """(tensor index, start, end) of the parts of consecutive tensors (starting at `offsets`)
    that fall in the flat range [lo, hi)."""
    i = bisect.bisect_right(offsets, lo) - 1
    while i < len(offsets) - 1 and offsets[i] < hi:
        a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
        if b > a:
            yield i, a, b
        i += 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


class ShmRouted(Communicator):
    """The routing a transport with a shared-memory channel shares: allreduce, reducescatter,
    allgather and broadcast go through `self.shm` when it takes the tensors (CPU, a dtype torch
    reduces elementwise, at least `shm_min_bytes`), otherwise to the transport's own
    `_allreduce`, `_reducescatter`, `_allgather` and `_broadcast`. gloo and MPI both use it, so
    the rules live in one place."""

    shm: Optional[ShmChannel] = None
    # Collectives of fewer bytes go to the transport even where the channel could take them: 0
    # for gloo (the channel beats its TCP at every size), MPI's LARGE_MB while its ranks
    # spin (MPICH's own shared memory wins below that size, the channel above it).
    shm_min_bytes: int = 0
    # A fused allreduce of two tensors or more takes the channel from this many bytes on, even
    # below shm_min_bytes (0: not below it). MPI sets it while its ranks spin: the channel
    # copies every member into its slot and out in a few multi-tensor calls, where MPI reduces
    # the large members one call each and the small ones through the engine's fusion buffer
    # (backends/mpi.FUSED_MIN_BYTES has the figures).
    shm_fused_min_bytes: int = 0

    @property
    def fuses_in_place(self) -> bool:
        """Whether a fused allreduce needs no fusion buffer here (allreduce_tensors: the channel
        copies each member into its segment and the results out itself), whatever its size."""
        return self.shm is not None and self.shm_min_bytes == 0

    def _takes(self, tensor: torch.Tensor, reduce: bool) -> bool:
        return (self.shm is not None and self.shm.handles(tensor, reduce)
                and tensor.numel() * tensor.element_size() >= self.shm_min_bytes)

    def allreduce(self, tensor: torch.Tensor, op: int):
        if self._takes(tensor, reduce=True):
            return self.shm.allreduce(tensor, op)
        return self._allreduce(tensor, op)

    def allreduce_tensors(self, inputs: list, outputs: list, op: int, prescale: float,
                          postscale: float):
        """A fused allreduce without the engine's fusion buffer, through shared memory; None
        when that path cannot take these tensors (the engine then packs and calls allreduce,
        or reduces the large members in place: collectives.Executor)."""
        if self.shm is None:
            return None
        # The size first: under MPI most fused batches are below shm_min_bytes, and the sum
        # costs a third of checking every member and output (~0.2 us each: 100 members, 14
        # against 42 us). The rule depends only on the response (sizes and count, the same on
        # every rank), so every rank routes alike; outputs that are not contiguous, which can
        # differ between ranks, reach here already staged (collectives.Executor.allreduce).
        if self.shm_min_bytes:
            nbytes = sum(t.numel() * t.element_size() for t in inputs)
            if nbytes < self.shm_min_bytes and not (
                    len(inputs) > 1 and self.shm_fused_min_bytes
                    and nbytes >= self.shm_fused_min_bytes):
                return None
        if not all(self.shm.handles(t, reduce=True) for t in inputs) or \
                not all(o is None or self.shm.handles(o, reduce=True) for o in outputs):
            return None
        return self.shm.allreduce_tensors(inputs, outputs, op, prescale, postscale)

    def reducescatter(self, output: torch.Tensor, tensor: torch.Tensor, op: int):
        if self._takes(tensor, reduce=True) and self.shm.handles(output, reduce=True):
            return self.shm.reducescatter(output, tensor, op)
        return self._reducescatter(output, tensor, op)

    def allgather(self, output: torch.Tensor, tensor: torch.Tensor):
        if self._takes(output, reduce=False) and self.shm.handles(tensor, reduce=False):
            return self.shm.allgather(output, tensor)
        return self._allgather(output, tensor)

    def broadcast(self, tensor: torch.Tensor, root: int):
        if self._takes(tensor, reduce=False):
            return self.shm.broadcast(tensor, root)
        return self._broadcast(tensor, root)

    def close_shm(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None


def _fit_slot(wanted: int, size: int) -> int:
    """The slot size that fits /dev/shm: at most a quarter of its free space for the whole
    segment (so several communicators and other programs fit beside it)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    free = st.f_bavail * st.f_frsize
    fit = (free // 4 - header_bytes(size)) // (size + 1) // 4096 * 4096
    return min(wanted, fit)


MIN_SLOT = 64 * 1024


def connect(store, rank: int, size: int, timeout_s: float,
            agree: Callable[[bool], bool]) -> Optional[ShmChannel]:
    """Collective over the communicator's ranks: a ShmChannel, or None on every rank when any
    rank cannot share memory with all the others (or HVDLITE_SHM=0).

    `store` is a c10d store private to this communicator; `agree(ok)` must return True only
    when `ok` is True on every rank (the caller runs one allreduce on its transport). Every rank
    must call this, even with the path turned off, so the agreement pairs up.
    """
    wanted = mode() == "on" and size > 1
    base = os.path.join(SHM_DIR, f"hvdlite-{os.getpid()}-{secrets.token_hex(6)}")
    seg_path, fifo_path = base + ".seg", base + ".fifo"
    seg: Optional[mmap.mmap] = None
    fifo_r = -1
    pids: dict[int, int] = {}
    fifo_w: dict[int, int] = {}
    why = "" if wanted else "HVDLITE_SHM=0"
    slot = 0
    try:
        if rank == 0:
            entry = "-"
            if wanted:
                slot = _fit_slot(slot_bytes(), size)
                if slot < min(slot_bytes(), MIN_SLOT):
                    why = f"{SHM_DIR} is missing or nearly full"
                else:
                    try:
                        fd = os.open(seg_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                        try:
                            os.posix_fallocate(fd, 0, header_bytes(size) + (size + 1) * slot)
                            seg = mmap.mmap(fd, header_bytes(size) + (size + 1) * slot)
                        finally:
                            os.close(fd)
                        token = secrets.randbits(62)
                        np.ndarray((1,), dtype=np.int64, buffer=seg)[0] = token
                        entry = f"{seg_path}|{slot}|{token}"
                    except OSError as exc:
                        why = f"rank 0 could not create {seg_path} ({exc})"
            store.set("seg", entry)
        entry = store.get("seg").decode()
        if not why and entry == "-":
            why = "rank 0 has no shared-memory segment"
        if not why and wanted:
            try:
                if rank != 0:
                    path, slot_s, token_s = entry.split("|")
                    slot = int(slot_s)
                    fd = os.open(path, os.O_RDWR)
                    try:
                        seg = mmap.mmap(fd, header_bytes(size) + (size + 1) * slot)
                    finally:
                        os.close(fd)
                    if int(np.ndarray((1,), dtype=np.int64, buffer=seg)[0]) != int(token_s):
                        why = "the segment holds another token: another host?"
                if not why:
                    os.mkfifo(fifo_path, 0o600)
                    # Read end first (a writer's open fails until it exists); our own write end
                    # too, so the FIFO never reads EOF when peers close theirs.
                    fifo_r = os.open(fifo_path, os.O_RDONLY | os.O_NONBLOCK)
                    fifo_w[rank] = os.open(fifo_path, os.O_WRONLY | os.O_NONBLOCK)
            except (OSError, ValueError) as exc:
                why = f"rank {rank} cannot map rank 0's segment ({exc}): another host?"
        store.set(f"fifo/{rank}", "-" if why else f"{fifo_path}|{os.getpid()}|{_pid_ns()}")
        if not why:
            for r in range(size):
                if r == rank:
                    continue
                peer = store.get(f"fifo/{r}").decode()
                if peer == "-":
                    why = f"rank {r} cannot share memory"
                    break
                p_fifo, p_pid, p_ns = peer.split("|", 2)
                # A pid means something here only in the same pid namespace (containers may
                # share /dev/shm but not pids); 0 = cannot check, the timeout still bounds it.
                pids[r] = int(p_pid) if p_ns == _pid_ns() else 0
                try:
                    fifo_w[r] = os.open(p_fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError as exc:
                    why = f"rank {r}'s FIFO is not reachable ({exc})"
                    break
        ok = agree(not why)
    finally:
        for path in (seg_path, fifo_path):    # everyone mapped (or gave up): nothing to leak
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    if ok and not why:
        own_w = fifo_w.pop(rank)             # held open, never written: no EOF on our FIFO
        # Spin only while every rank of this host has a core of its own: a spinning rank
        # would otherwise take the core from the one it waits for. Decided together (every
        # rank is here, since `ok` was agreed), as it also decides where the steady state's
        # rounds run (GlooCommunicator.agreement), and every rank of a set must run them alike
        # (a rank pinned to fewer cores says no).
        spin = agree(local_ranks(size) <= usable_cores())
        channel = ShmChannel(rank, size, timeout_s, slot, seg, pids, fifo_r, fifo_w, own_w,
                             INLINE_POLL_S if spin else 0.0)
        try:
            channel.settle_chunk()
        except BaseException:
            channel.close()
            raise
        return channel
    if wanted:
        log.info("shared-memory data path off for this communicator (%s); gloo carries it",
                 why or "another rank could not share memory with all the others")
    if seg is not None:
        try:
            seg.close()
        except (BufferError, ValueError):
            pass
    for f in [fifo_r, *fifo_w.values()]:
        if f >= 0:
            try:
                os.close(f)
            except OSError:
                pass
    return None
