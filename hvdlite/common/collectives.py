"""Each collective, written once: run one (possibly fused) response on a process set's communicator.

Frontends never get here directly. Each collective is a generator: it copies into its buffer,
launches the transport call and yields the pending work; whoever drives it (the engine's finisher
thread) waits for that work and resumes it to scale and copy out. So the engine's background
thread launches one collective and goes back to negotiating the next while the transport runs.
A collective of several calls in a row (a fused allreduce on MPI: _allreduce_in_place) yields
IN_ORDER first and makes them on a communicator that only the finisher launches on.
Inputs may live on any device; transports that want CPU buffers get them through fusion buffers.
"""
from __future__ import annotations

import ctypes
import math
import threading
from typing import Optional

import numpy as np
import torch

from . import adasum as _adasum
from .messages import (ADASUM, ALLGATHER, ALLREDUCE, ALLTOALL, AVERAGE, BROADCAST,
                       REDUCESCATTER, SUM, Response)
from .arith import scale_
from .flat import pack, unpack

DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
          "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float64": torch.float64, "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class FusionBuffer:
    """Persistent byte buffers per device, reused every step.

    Several fused collectives can be in flight at once, so buffers are lent out and returned;
    a few idle ones are kept, so steady-state training allocates nothing.
    """

    KEEP = 4

    def __init__(self):
        self._free: dict[str, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, device: str = "cpu") -> torch.Tensor:
        """A buffer of at least `nbytes` on `device` ("cpu", "cuda:N", or "pinned": page-locked
        host memory, which a GPU copies to and from by DMA); give it back with release()."""
        with self._lock:
            free = self._free.setdefault(device, [])
            fits = [i for i, b in enumerate(free) if b.numel() >= nbytes]
            if fits:
                # By index: list.remove would compare tensors with ==, elementwise.
                return free.pop(min(fits, key=lambda i: free[i].numel()))
        size = (max(nbytes, 1 << 16) + 63) // 64 * 64
        if device == "cpu":
            return host_buffer(size)
        if device == "pinned":
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return torch.empty(size, dtype=torch.uint8, device=device)

    def release(self, buf: torch.Tensor, device: Optional[str] = None) -> None:
        """Give back a buffer from acquire(); `device`: the one it was acquired for, where
        the buffer's own device does not tell ("pinned" is on the CPU)."""
        with self._lock:
            key = device or ("cpu" if buf.is_cpu else str(buf.device))
            free = self._free.setdefault(key, [])
            free.append(buf)
            if len(free) > self.KEEP:
                free.pop(min(range(len(free)), key=lambda i: free[i].numel()))


def host_buffer(nbytes: int) -> torch.Tensor:
    """A CPU fusion buffer on transparent huge pages where the kernel offers them.

    Why: MPI moves data between ranks through shared memory, and with 4 KiB pages the copies
    spend their time on TLB misses: a 16 MiB MPICH allreduce on 2 ranks took 2.6 ms from a
    torch-allocated buffer and 1.8 ms from one on huge pages (same process, same bytes). numpy
    asks the kernel for huge pages (madvise) on every allocation of 4 MiB or more; torch's CPU
    allocator does not. A shared anonymous mapping (mmap.mmap(-1, n)) would not do: shared memory
    follows the kernel's separate shmem THP setting, usually off. The buffer is 64-byte aligned
    like torch's own, so any dtype may be viewed on it.
    """
    raw = torch.from_numpy(np.empty(nbytes + 64, dtype=np.uint8))
    start = (-raw.data_ptr()) % 64
    return raw[start:start + nbytes]


def _staged_outputs(outputs: list):
    """None when every output is contiguous (or None); else (the outputs with a contiguous
    stand-in for each that is not, the indices of those), for Executor.allreduce."""
    if len(outputs) == 1:                  # (a lone tensor's check, without a generator)
        if outputs[0] is None or outputs[0].is_contiguous():
            return None
    elif all(o is None or o.is_contiguous() for o in outputs):
        return None
    out, at = list(outputs), []
    for i, o in enumerate(outputs):
        if o is not None and not o.is_contiguous():
            out[i] = torch.empty(o.shape, dtype=o.dtype, device=o.device)
            at.append(i)
    return out, at


def _unstage(outputs: list, staged) -> None:
    """Copy the stand-ins of _staged_outputs back into the outputs they stood in for."""
    if staged is not None:
        for i in staged[1]:
            outputs[i].copy_(staged[0][i])


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    # (get_device(): -1 on the CPU; comparing .device objects builds two of them, ~1 us.)
    return (a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                       and a.dtype == b.dtype and a.get_device() == b.get_device()))


def _fill(src: torch.Tensor, out: torch.Tensor, prescale: float) -> None:
    """Put `src`, prescaled, in `out`, where it is reduced in place. In-place calls hand the
    same storage in as two tensor objects: comparing objects copied a 64 MiB gradient onto
    itself before every transfer."""
    if not _same_memory(src, out):
        out.copy_(src)
    scale_(out, prescale)


def _staged_gpu(comm, inputs: list) -> Optional[str]:
    """The GPU ("cuda:N") whose tensors `comm`, a host transport, is given, else None."""
    if comm.device != "cpu":
        return None
    for t in inputs:
        if t is not None and t.is_cuda:
            return str(t.device)
    return None


def _buffer_kind(comm, tensors: list) -> str:
    """Where a fused collective's buffer goes: page-locked host memory when a host transport is
    given GPU tensors (each member's copy to and from it is then a DMA, without the driver's
    bounce buffer for pageable memory), else the communicator's device."""
    return "pinned" if _staged_gpu(comm, tensors) is not None else comm.device


def _on(comm, t: torch.Tensor) -> bool:
    # (t.device builds a torch.device object, ~0.5 us: the flags first. comm.device is "cpu"
    # or "cuda:N": a prefix test, where splitting it on every call cost a list each time.)
    return comm.device.startswith("cuda" if t.is_cuda else "cpu" if t.is_cpu
                                  else t.device.type)


class _InOrder:
    """Work that is already complete: yielded by a collective that must be resumed (and launch
    its calls) on the engine's finisher thread. It has no is_completed(), so the background
    thread never polls it inline and always hands it on."""

    __slots__ = ()

    def wait(self) -> None:
        pass


IN_ORDER = _InOrder()


def _out_factor(req, size: int) -> float:
    """What a finished allreduce's (or reducescatter's) sum is multiplied by: its postscale,
    and 1/size for an average; `req`: a Request or a Response."""
    return req.postscale / size if req.reduce_op == AVERAGE else req.postscale


class Executor:
    """Runs responses for one rank; holds the fusion buffer and the timeline."""

    def __init__(self, timeline=None):
        self.fusion = FusionBuffer()
        self.timeline = timeline
        # Members of fused allreduces reduced in place (_allreduce_in_place): tests check
        # that the path ran.
        self.in_place_members = 0
        # ...of which chained inside the transport, several members as one piece of work.
        self.in_place_sequences = 0
        # GPU allreduces staged through pinned host memory (_fused_staged).
        self.staged_allreduces = 0
        # HOROVOD_ENABLE_ASYNC_COMPLETION (gpu_done): set by the engine from its settings.
        self.async_completion = False
        self._gpu_streams: dict = {}

    def gpu_stream(self, device: torch.device):
        """The engine's own CUDA stream on `device` (run's on_stream), made on first use."""
        stream = self._gpu_streams.get(device.index)
        if stream is None:
            stream = self._gpu_streams[device.index] = torch.cuda.Stream(device)
        return stream

    def _tl(self, names, label):
        if self.timeline is not None and self.timeline.enabled:
            self.timeline.activity_end(names)
            self.timeline.activity(names, label)

    def _reduce_into(self, comm, src: torch.Tensor, out: torch.Tensor, op: int, prescale: float,
                     post: float, names=None):
        """Allreduce `src` in `out` (contiguous, on `comm`'s device), prescaled, then
        postscaled: a lone tensor, or a member of a fused response that skips the fusion
        buffer. `names`: the timeline's ALLREDUCE phase starts at the transport call."""
        _fill(src, out, prescale)
        if names is not None:
            self._tl(names, "ALLREDUCE")
        yield comm.allreduce(out, op)
        scale_(out, post)

    # ------------------------------------------------------------------ allreduce
    @staticmethod
    def carries(req) -> bool:
        """Whether a steady round's payload may carry this allreduce's data: float32, by sum or
        average (a payload is summed; inline_in also needs the tensor contiguous and small
        enough)."""
        return req.dtype == "float32" and req.reduce_op in (SUM, AVERAGE)

    @staticmethod
    def inline_in(payload: torch.Tensor, req, src: torch.Tensor, offset: int = 0) -> bool:
        """Put `src`, prescaled, in a steady round's payload (backends/mpi.Agreement) from
        element `offset` on, when the round may carry its allreduce: float32, sum or average,
        contiguous, small enough. False: it may not, and nothing was written.

        The copies in and out are a memmove between the two tensors' memory: slicing, viewing
        and copying with torch cost 3.4 us per 4 KiB here, a memmove 0.4 us, where the whole
        allreduce takes ~10."""
        n = src.numel()
        if not Executor.carries(req) or offset + n > payload.numel() or not src.is_contiguous():
            return False
        ctypes.memmove(payload.data_ptr() + 4 * offset, src.data_ptr(), 4 * n)
        if req.prescale != 1.0:
            payload[offset:offset + n].mul_(req.prescale)
        return True

    @staticmethod
    def inline_pack(payload: torch.Tensor, entries: list) -> bool:
        """Put the entries' tensors in a steady round's payload one after another (inline_in);
        False where one may not go there (what was written is then never read)."""
        offset = 0
        for e in entries:
            if not Executor.inline_in(payload, e.request, e.tensor, offset):
                return False
            offset += e.tensor.numel()
        return True

    @staticmethod
    def inline_array(entries: list, total: int) -> np.ndarray | None:
        """The entries' tensors (`total` elements), prescaled, as the payload of a round over
        the control connections (steady.combine), where they may go there (inline_pack); else
        None."""
        buf = torch.empty(total, dtype=torch.float32)
        return buf.numpy() if Executor.inline_pack(buf, entries) else None

    @staticmethod
    def inline_out_all(payload, entries: list, size: int) -> None:
        """A carried round's payload holds the sum of every rank's `inline_in`, the entries'
        tensors one after another: finish each allreduce into its output as allreduce() would
        (postscale, and 1/size for an average). `payload`: a tensor, or the float32 array a
        round over the control connections summed.

        Where the entries share one scale factor (a grouped call: the same op and postscale),
        the payload is scaled once, in place, and the outputs are only copied: scaling a
        one-element output cost ~2 us here, a quarter of finishing a grouped call of two
        metrics. The same multiplication of the same floats either way, so the same bits."""
        factors = [_out_factor(e.request, size) for e in entries]
        if len(entries) > 1 and factors[0] != 1.0 and factors.count(factors[0]) == len(factors):
            # Through NumPy, as scale_ multiplies a small CPU tensor (the same float32 product);
            # the payload is the round's own buffer, so no version counter to bump.
            array = payload if isinstance(payload, np.ndarray) else payload.numpy()
            array[:sum(e.output.numel() for e in entries)] *= factors[0]
            factors = [1.0] * len(entries)
        if isinstance(payload, np.ndarray):
            payload = torch.from_numpy(payload)
        offset = 0
        for e, factor in zip(entries, factors):
            out = e.output
            n = out.numel()
            if out.is_contiguous():
                ctypes.memmove(out.data_ptr(), payload.data_ptr() + 4 * offset, 4 * n)
            else:
                out.copy_(payload[offset:offset + n].view(out.shape))
            scale_(out, factor)              # (returns at once for 1.0)
            offset += n

    def allreduce(self, comm, resp: Response, inputs: list, outputs: list) -> None:
        dtype = DTYPES[resp.dtype]
        op = SUM if resp.reduce_op == AVERAGE else resp.reduce_op
        post = _out_factor(resp, comm.size)
        names = resp.names
        if comm.size == 1 and all(o is not None and _on(comm, o) for o in outputs):
            # One rank: a reduction of one value is that value. Fusing would copy every tensor
            # into a buffer and back (~3.6 ms for 12.8 MiB here) to send nothing.
            self._tl(names, "ALLREDUCE")
            for src, out in zip(inputs, outputs):
                if not _same_memory(src, out):
                    out.copy_(src)
                scale_(out, resp.prescale)
                scale_(out, post)
            return
        direct = comm.allreduce_tensors
        lone = len(inputs) == 1
        # An output that is not contiguous is reduced into a contiguous stand-in and copied
        # back, on the two routes below that reduce in the outputs' own memory: contiguity is
        # this rank's own, and every rank must route the response alike and make the same
        # transport calls. (A lone one passed on as it was went to the channel's fallback on
        # one rank only, and both waited until the transport's timeout; over gloo's TCP and
        # MPI both ranks got a wrong sum.)
        staged = _staged_outputs(outputs) if direct is not None or lone else None
        outs = outputs if staged is None else staged[0]
        if direct is not None:
            # The transport copies the tensors in and the results out itself (gloo's shared-
            # memory path): no fusion buffer, no copy of an input onto its output. (Under MPI
            # a rank routed apart would call MPI while the others waited on the channel.)
            work = direct(inputs, outs, op, resp.prescale, post)
            if work is not None:
                self._tl(names, "ALLREDUCE")
                yield work
                _unstage(outputs, staged)
                return
        if lone and (outs[0] is None or _on(comm, outs[0])):
            # A lone tensor, reduced in its output; a joined rank's zeros (no output) in
            # themselves, so that it makes the very call the other ranks make: sent to the
            # fusion path instead, it went to MPI's `in_order` communicator from 64 KiB on
            # while the others called on `comm`, and both waited forever.
            out = inputs[0] if outs[0] is None else outs[0]
            yield from self._reduce_into(comm, inputs[0], out, op, resp.prescale, post, names)
            _unstage(outputs, staged)
            return
        itemsize = torch.empty((), dtype=dtype).element_size()
        counts = [math.prod(s) for s in resp.shapes]
        in_order = comm.in_order
        if in_order is not None:
            big = [i for i, n in enumerate(counts) if n * itemsize >= comm.inplace_min_bytes]
            if big:
                yield from self._allreduce_in_place(in_order, resp, inputs, outputs, op, post,
                                                    counts, big, dtype, itemsize)
                return
        yield from self._fused(comm, resp, inputs, outputs, op, post, counts, dtype, itemsize)

    def _fused(self, comm, resp, inputs, outputs, op, post, counts, dtype, itemsize):
        """Allreduce `inputs` through one fusion buffer: copy in, one call, copy out."""
        nbytes = sum(counts) * itemsize
        gpu = _staged_gpu(comm, inputs)
        if gpu is not None:
            yield from self._fused_staged(comm, resp, inputs, outputs, op, post, counts, dtype,
                                          nbytes, gpu)
            return
        raw = self.fusion.acquire(nbytes, comm.device)
        try:
            yield from self._allreduce_fused(comm, resp, inputs, outputs, op, post, counts,
                                             raw[:nbytes].view(dtype))
        finally:
            self.fusion.release(raw)

    def _allreduce_in_place(self, comm, resp, inputs, outputs, op, post, counts, big, dtype,
                            itemsize):
        """A fused response on a transport whose calls cost less than copies (MPI on one host):
        the members listed in `big` are reduced in place in their outputs, one call each, and
        the rest together through the fusion buffer, all on `comm`, the global set's
        `in_order` communicator (backends/mpi.py says why only that set has one).

        Why: for 100 tensors of 4-256 KiB, copying 13 MB into the buffer and back took 3.5 ms
        of a 9 ms fused allreduce on 2 ranks, while the same tensors reduced one by one took
        raw MPI 4.0 ms in all. Which members go which way depends only on the response (shapes
        and dtype, the same on every rank), so every rank makes the same calls in the same
        order. The calls are launched one after another by whoever resumes this generator: it
        first yields IN_ORDER, so the engine hands it to its finisher thread, the one thread
        that launches on `in_order`.
        """
        yield IN_ORDER
        wanted = set(big)
        rest = [i for i in range(len(counts)) if i not in wanted]
        if len(rest) > 1:
            yield from self._fused(comm, resp, [inputs[i] for i in rest],
                                   [outputs[i] for i in rest], op, post,
                                   [counts[i] for i in rest], dtype, itemsize)
        elif rest:
            big = rest + big
        self._tl(resp.names, "ALLREDUCE")
        self.in_place_members += len(big)
        sequence = comm.allreduce_sequence
        direct = [i for i in big if outputs[i] is None
                  or (outputs[i].is_contiguous() and _on(comm, outputs[i]))]
        # The chained calls only where every member is reduced in its own memory: the calls
        # then go in the order of `big`, as the one-by-one calls below would, and the order
        # of calls is all the ranks must share (a rank whose output is not contiguous would
        # otherwise call on its other members first).
        if sequence is not None and len(direct) > 1 and len(direct) == len(big):
            # Every member reduced in its own memory (a joined rank's zeros in place, then
            # dropped), the calls chained inside the transport (backends/mpi._Sequence): one
            # step of this generator instead of one per member. The work starts when first
            # tested, so the inputs are copied in after it is made.
            targets = [inputs[i] if outputs[i] is None else outputs[i] for i in direct]
            work = sequence(targets, op)
            if work is not None:
                self.in_place_sequences += 1
                for i, out in zip(direct, targets):
                    _fill(inputs[i], out, resp.prescale)
                yield work
                for out in targets:
                    scale_(out, post)
                big = []                           # (direct was all of them)
        for i in big:
            src, out = inputs[i], outputs[i]
            if out is None:                        # a joined rank's zeros: reduced, then dropped
                yield from self._reduce_into(comm, src, src, op, resp.prescale, post)
            elif out.is_contiguous() and _on(comm, out):
                yield from self._reduce_into(comm, src, out, op, resp.prescale, post)
            else:                                  # reduced in a contiguous copy, copied back
                work = torch.empty(src.shape, dtype=src.dtype, device=comm.device)
                yield from self._reduce_into(comm, src, work, op, resp.prescale, post)
                out.copy_(work)

    def _fused_staged(self, comm, resp, inputs, outputs, op, post, counts, dtype, nbytes, gpu):
        """GPU tensors on a host transport (ranks sharing a GPU, or no NCCL): fused on the GPU,
        moved to page-locked host memory in one copy, reduced there, and back in one copy.

        Why: packing each gradient straight into a pageable host buffer made one blocking copy
        per member, each through the driver's own bounce buffer; with two ranks sharing an
        H100 the step ran at 1.37 x DDP on gloo, which stages a whole bucket at once through
        pinned memory. The GPU work runs on this thread's stream of `gpu`, which is
        synchronized before the results are handed over (the caller's stream never waits on
        ours)."""
        names = resp.names
        self.staged_allreduces += 1
        # A lone tensor goes straight between its own memory and the host buffer; several are
        # packed on the GPU first, so each direction is one copy.
        lone = len(inputs) == 1 and inputs[0].is_cuda
        host_raw = self.fusion.acquire(nbytes, "pinned")
        dev_raw = None if lone else self.fusion.acquire(nbytes, gpu)
        try:
            host = host_raw[:nbytes].view(dtype)
            self._tl(names, "MEMCPY_IN_FUSION_BUFFER")
            if lone:
                host.copy_(inputs[0].reshape(-1))
                scale_(host, resp.prescale)
            else:
                dev = dev_raw[:nbytes].view(dtype)
                pack(dev, inputs, counts)
                scale_(dev, resp.prescale)
                host.copy_(dev)                 # waits for the stream: the bytes are home
            self._tl(names, "ALLREDUCE")
            yield comm.allreduce(host, op)
            self._tl(names, "MEMCPY_OUT_FUSION_BUFFER")
            if not lone:
                dev.copy_(host, non_blocking=True)
                unpack(dev, outputs, counts, post)
            elif outputs[0] is not None:
                outputs[0].copy_(host.view(outputs[0].shape), non_blocking=True)
                scale_(outputs[0], post)
            torch.cuda.current_stream(gpu).synchronize()
        finally:
            if dev_raw is not None:
                self.fusion.release(dev_raw)
            self.fusion.release(host_raw, "pinned")

    def _allreduce_fused(self, comm, resp, inputs, outputs, op, post, counts, buf):
        names = resp.names
        self._tl(names, "MEMCPY_IN_FUSION_BUFFER")
        pack(buf, inputs, counts)
        scale_(buf, resp.prescale)
        self._tl(names, "ALLREDUCE")
        yield comm.allreduce(buf, op)
        self._tl(names, "MEMCPY_OUT_FUSION_BUFFER")
        unpack(buf, outputs, counts, post)

    # ------------------------------------------------------------------ adasum
    def adasum(self, comm, resp: Response, inputs: list, outputs: list):
        """Allreduce with op=Adasum. The transport has no send/recv for Horovod's VHDD, so every
        rank allgathers every rank's (fused, prescaled) buffer in one call and runs the same
        deterministic pairwise tree on it (adasum.py): identical results everywhere, at the cost
        of moving and holding size x the buffer instead of ~2x. Fine for a handful of ranks."""
        dtype = DTYPES[resp.dtype]
        if not _adasum.is_power_of_two(comm.size):
            raise NotImplementedError(_adasum.NON_POWER_OF_TWO)
        itemsize = torch.empty((), dtype=dtype).element_size()
        counts = [math.prod(s) for s in resp.shapes]
        nbytes = sum(counts) * itemsize
        raw = self.fusion.acquire(nbytes * (comm.size + 1), comm.device)
        try:
            send = raw[:nbytes].view(dtype)
            recv = raw[nbytes:nbytes * (comm.size + 1)]
            self._tl(resp.names, "MEMCPY_IN_FUSION_BUFFER")
            pack(send, inputs, counts)
            scale_(send, resp.prescale)
            self._tl(resp.names, "ADASUM_ALLGATHER")
            yield comm.allgather(recv, raw[:nbytes])
            self._tl(resp.names, "ADASUM_TREE_REDUCE")
            rows = recv.view(dtype).view(comm.size, sum(counts))
            result = _adasum.tree_reduce(rows, counts)
            scale_(result, resp.postscale)
            self._tl(resp.names, "MEMCPY_OUT_FUSION_BUFFER")
            unpack(result, outputs, counts)
        finally:
            self.fusion.release(raw)

    # ------------------------------------------------------------------ reducescatter
    @staticmethod
    def split_rows(dim0: int, size: int) -> list[int]:
        """Horovod's split of the first dimension: the first dim0 % size ranks get one row more."""
        return [dim0 // size + (1 if i < dim0 % size else 0) for i in range(size)]

    def reducescatter(self, comm, resp: Response, inputs: list) -> list[torch.Tensor]:
        dtype = DTYPES[resp.dtype]
        size = comm.size
        op = SUM if resp.reduce_op == AVERAGE else resp.reduce_op
        post = _out_factor(resp, size)
        rows = [self.split_rows(s[0], size) if s else [0] * size for s in resp.shapes]
        row_elems = [math.prod(s[1:]) for s in resp.shapes]
        seg = [sum(rows[t][r] * row_elems[t] for t in range(len(inputs))) for r in range(size)]
        seg_max = max(seg) if seg else 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        kind = _buffer_kind(comm, inputs)
        raw = self.fusion.acquire(seg_max * (size + 1) * itemsize, kind)
        try:
            return (yield from self._reducescatter(comm, resp, inputs, op, post, rows, row_elems,
                                                   seg_max, raw[:seg_max * (size + 1) * itemsize]
                                                   .view(dtype)))
        finally:
            self.fusion.release(raw, kind)

    def _reducescatter(self, comm, resp, inputs, op, post, rows, row_elems, seg_max, buf):
        size, me = comm.size, comm.rank
        send, recv = buf[:seg_max * size], buf[seg_max * size:]
        self._tl(resp.names, "MEMCPY_IN_FUSION_BUFFER")
        send.zero_()
        for t, src in enumerate(inputs):
            flat = src.reshape(-1)
            start_row = 0
            for r in range(size):
                off = r * seg_max + sum(rows[u][r] * row_elems[u] for u in range(t))
                n = rows[t][r] * row_elems[t]
                send[off:off + n].copy_(flat[start_row * row_elems[t]:start_row * row_elems[t] + n])
                start_row += rows[t][r]
        scale_(send, resp.prescale)
        self._tl(resp.names, "REDUCESCATTER")
        yield comm.reducescatter(recv, send, op)
        scale_(recv, post)
        self._tl(resp.names, "MEMCPY_OUT_FUSION_BUFFER")
        outs, off = [], 0
        for t, src in enumerate(inputs):
            n = rows[t][me] * row_elems[t]
            shape = (rows[t][me],) + tuple(resp.shapes[t][1:])
            outs.append(recv[off:off + n].reshape(shape).to(src.device, copy=True))
            off += n
        return outs

    # ------------------------------------------------------------------ allgather
    def allgather(self, comm, resp: Response, inputs: list) -> list[torch.Tensor]:
        dtype = DTYPES[resp.dtype]
        size = comm.size
        itemsize = torch.empty((), dtype=dtype).element_size()
        row_bytes = [math.prod(s[1:]) * itemsize for s in resp.shapes]
        dims = resp.rank_dims
        outs = [torch.empty((sum(dims[t]),) + tuple(resp.shapes[t][1:]), dtype=dtype,
                            device=inputs[t].device) for t in range(len(inputs))]
        if (len(inputs) == 1 and len(set(dims[0])) == 1 and _on(comm, inputs[0])):
            self._tl(resp.names, "ALLGATHER")
            yield comm.allgather(as_bytes(outs[0]), as_bytes(inputs[0].contiguous()))
            return outs
        contrib = [sum(dims[t][r] * row_bytes[t] for t in range(len(inputs))) for r in range(size)]
        seg = max(contrib)
        kind = _buffer_kind(comm, inputs)
        raw = self.fusion.acquire(seg * (size + 1), kind)
        try:
            yield from self._allgather_fused(comm, resp, inputs, outs, row_bytes, seg,
                                             raw[:seg * (size + 1)])
        finally:
            self.fusion.release(raw, kind)
        return outs

    def _allgather_fused(self, comm, resp, inputs, outs, row_bytes, seg, buf):
        size, dims = comm.size, resp.rank_dims
        send, recv = buf[:seg], buf[seg:]
        self._tl(resp.names, "MEMCPY_IN_FUSION_BUFFER")
        off = 0
        for src in inputs:
            b = as_bytes(src.contiguous())
            send[off:off + b.numel()].copy_(b)
            off += b.numel()
        self._tl(resp.names, "ALLGATHER")
        yield comm.allgather(recv, send)
        self._tl(resp.names, "MEMCPY_OUT_FUSION_BUFFER")
        for t, out in enumerate(outs):
            ob = as_bytes(out)
            out_off = 0
            for r in range(size):
                in_off = r * seg + sum(dims[u][r] * row_bytes[u] for u in range(t))
                n = dims[t][r] * row_bytes[t]
                ob[out_off:out_off + n].copy_(recv[in_off:in_off + n])
                out_off += n

    # ------------------------------------------------------------------ broadcast
    def broadcast(self, comm, resp: Response, inputs: list, outputs: list) -> None:
        root = resp.root_rank
        if len(inputs) == 1 and _on(comm, outputs[0]):
            out = outputs[0]
            if comm.rank == root and not _same_memory(inputs[0], out):
                out.copy_(inputs[0])
            self._tl(resp.names, "BROADCAST")
            yield comm.broadcast(as_bytes(out), root)
            return
        sizes = [as_bytes(o).numel() for o in outputs]
        kind = _buffer_kind(comm, outputs)
        raw = self.fusion.acquire(sum(sizes), kind)
        try:
            yield from self._broadcast_fused(comm, resp, inputs, outputs, sizes,
                                             raw[:sum(sizes)])
        finally:
            self.fusion.release(raw, kind)

    def _broadcast_fused(self, comm, resp, inputs, outputs, sizes, buf):
        root = resp.root_rank
        if comm.rank == root:
            self._tl(resp.names, "MEMCPY_IN_FUSION_BUFFER")
            off = 0
            for src, n in zip(inputs, sizes):
                buf[off:off + n].copy_(as_bytes(src.contiguous()))
                off += n
        self._tl(resp.names, "BROADCAST")
        yield comm.broadcast(buf, root)
        self._tl(resp.names, "MEMCPY_OUT_FUSION_BUFFER")
        off = 0
        for out, n in zip(outputs, sizes):
            as_bytes(out).copy_(buf[off:off + n])
            off += n

    # ------------------------------------------------------------------ alltoall
    def alltoall(self, comm, resp: Response, src: torch.Tensor):
        dtype = DTYPES[resp.dtype]
        matrix = resp.splits[0]
        me = comm.rank
        itemsize = torch.empty((), dtype=dtype).element_size()
        row = math.prod(resp.shapes[0][1:]) * itemsize
        send_rows = matrix[me]
        recv_rows = [matrix[j][me] for j in range(comm.size)]
        out = torch.empty((sum(recv_rows),) + tuple(src.shape[1:]), dtype=dtype,
                          device=comm.device)
        inp = src.contiguous()
        if not _on(comm, inp):
            inp = inp.to(comm.device)
        self._tl(resp.names, "ALLTOALL")
        yield comm.alltoall(as_bytes(out), as_bytes(inp), [r * row for r in recv_rows],
                            [r * row for r in send_rows])
        return out.to(src.device), torch.tensor(recv_rows, dtype=torch.int32)


def run(executor: Executor, comm, resp: Response, entries: list):
    """Generator executing `resp` on `comm`: yields each pending transport work; when exhausted,
    every entry's result is stored (entries[i] may be None when this rank has joined and
    contributes zeros). A response on a GPU communicator (NCCL) runs its GPU work on the
    engine's own stream of that GPU (on_stream says why)."""
    if resp.device >= 0 and comm.device.startswith("cuda"):
        return on_stream(_run(executor, comm, resp, entries),
                         executor.gpu_stream(torch.device(comm.device)))
    return _run(executor, comm, resp, entries)


def on_stream(gen, stream):
    """Drive the generator `gen` with `stream` current on whichever thread resumes it (the
    background thread starts a collective, the finisher resumes it after each transport wait).

    Why: the engine's threads otherwise queue their GPU work (packing gradients into a fusion
    buffer, the copies out, the scaling) on the GPU's default stream, which is the training
    loop's too; the autograd thread runs ahead of the GPU, so by the time a bucket of gradients
    was negotiated the rest of the backward pass was already queued there, and the bucket's
    packing, and its NCCL call behind it, ran only after the whole backward pass: no overlap.
    On a stream of its own the packing waits only for its gradients (their ready events), as
    DDP's copies into its buckets do."""
    value = None
    while True:
        with torch.cuda.stream(stream):
            try:
                work = gen.send(value)
            except StopIteration as stop:
                return stop.value
        value = yield work


def _run(executor: Executor, comm, resp: Response, entries: list):
    t = resp.type
    for e in entries:
        if e is not None and e.ready_event is not None:
            torch.cuda.current_stream(e.tensor.device).wait_event(e.ready_event)
    inputs = [e.tensor if e is not None else None for e in entries]
    if t == ALLREDUCE:
        dtype = DTYPES[resp.dtype]
        outputs = [e.output if e is not None else None for e in entries]
        if any(i is None for i in inputs):
            # A joined rank contributes zeros of the agreed shape, on the communicator's
            # device: NCCL takes only tensors on its own GPU (host zeros failed the others'
            # GPU allreduce); a host transport, staged GPU tensors included, takes host ones.
            inputs = [i if i is not None else torch.zeros(s, dtype=dtype, device=comm.device)
                      for i, s in zip(inputs, resp.shapes)]
        if resp.reduce_op == ADASUM:
            yield from executor.adasum(comm, resp, inputs, outputs)   # Adasum hook
        else:
            yield from executor.allreduce(comm, resp, inputs, outputs)
        for e in entries:
            if e is not None:
                e.result = e.output
    elif t == ALLGATHER:
        outs = yield from executor.allgather(comm, resp, inputs)
        for e, o in zip(entries, outs):
            e.result = o
    elif t == BROADCAST:
        outputs = [e.output for e in entries]
        yield from executor.broadcast(comm, resp, inputs, outputs)
        for e in entries:
            e.result = e.output
    elif t == REDUCESCATTER:
        outs = yield from executor.reducescatter(comm, resp, inputs)
        for e, o in zip(entries, outs):
            e.result = o
    elif t == ALLTOALL:
        out, splits = yield from executor.alltoall(comm, resp, inputs[0])
        entries[0].result = out
        entries[0].extra = splits
    else:
        raise ValueError(f"unknown collective type {t}")
    if resp.device >= 0:
        for e in entries:
            if e is not None and e.tensor is not None and e.tensor.is_cuda:
                gpu_done(executor, entries, e.tensor.device)
                break


def gpu_done(executor: Executor, entries: list, device: torch.device) -> None:
    """Make a GPU collective's results safe to hand over.

    What ran after the transport's work (a fused response's copies out of its buffer, an
    average's scaling, a widened dtype's copy back) is only queued on this thread's stream,
    which the caller's stream does not wait for. By default (Horovod's) block until it has run,
    so a completed handle means the result is there, on whichever stream the caller reads it.
    (Without this, two ranks on NCCL read their fused allreduces' outputs before the copies out
    had run: stale values.) With async completion (HOROVOD_ENABLE_ASYNC_COMPLETION=1), record
    an event instead, which Handle.wait makes the caller's current stream wait for: no thread
    blocks on the GPU, and the caller's next kernels queue behind the result as DDP's do; the
    inputs are then marked as used on this stream, so that the allocator does not give their
    memory to a caller's stream before the copies that read them have run. In both modes the
    handle's wait() marks the results as used on the caller's stream (await_gpu)."""
    stream = torch.cuda.current_stream(device)
    done = None
    if executor.async_completion:
        done = torch.cuda.Event()
        done.record(stream)
    else:
        stream.synchronize()
    for e in entries:
        if e is not None:
            if done is not None and e.tensor is not None and e.tensor.is_cuda:
                e.tensor.record_stream(stream)
            e.gpu_done = (done, device)
            if e.handle is not None:
                e.handle.gpu_pending = True


def await_gpu(entries: list) -> None:
    """Hand GPU results to the waiting thread (gpu_done): with async completion, make its
    current stream wait for each response's results; in both modes, mark the results the
    engine made on its own stream (allgather, reducescatter, alltoall outputs) as used on the
    caller's, so that the allocator does not give their memory back to the engine's stream
    before the caller's reads of them have run."""
    seen: set = set()
    for e in entries:
        done = e.gpu_done
        if done is None:
            continue
        event, device = done
        caller = torch.cuda.current_stream(device)
        if event is not None and id(event) not in seen:
            seen.add(id(event))
            caller.wait_event(event)
        result = e.result[0] if isinstance(e.result, tuple) else e.result
        if isinstance(result, torch.Tensor) and result.is_cuda:
            result.record_stream(caller)
