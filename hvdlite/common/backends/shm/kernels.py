"""The collectives' kernels: each a generator of phases over the slots and the result area,
run by the channel's threads (channel.py).
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from ...arith import copy_scaled, reduce_in_order, scale_
from ...flat import unpack
from .settings import (DIRECT_BYTES, Waits)

log = logging.getLogger("hvdlite.common.backends.shm")


class ShmKernels:
    """Part of channel.ShmChannel: the collectives themselves."""

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
