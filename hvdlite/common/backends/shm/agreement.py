"""The steady state's rounds through the segment (ShmAgreement): what Agreement is on MPI.
"""
from __future__ import annotations

import logging
import mmap

import torch

from ...protocol import INLINE_FLOATS    # a round's payload (ShmAgreement)
from ...arith import reduce_in_order
from ..base import Agreement
from .settings import (AGREE_BITS, _AGREE_WORDS, _WORD, _PARITY_WORDS, _AGREE_STRIDE)

log = logging.getLogger("hvdlite.common.backends.shm")


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
