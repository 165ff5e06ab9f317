"""Compressors that keep per-tensor state and run their own collectives (every frontend).

Horovod's `Compressor` is a pair of static methods around one allreduce: right for a cast
(fp16), wrong for the compressors that matter for bandwidth:
- 8-bit quantisation cannot be summed in 8 bits, so it is reduced Bagua-ByteGrad style:
  alltoall of quantised chunks, each rank sums its chunk, allgather of the requantised chunk;
- PowerSGD allreduces two low-rank factors, with a local orthogonalisation in between.
Both keep state per tensor (error-feedback residuals, PowerSGD's warm-started Q), keyed by the
tensor's wire name, which is identical on every rank and stable from step to step.

So a stateful compressor is an *instance* (one per optimizer, created from the class if the
class is passed) with `reduce_async(tensor, name, op, process_set) -> PendingReduce`. The
`PendingReduce` wraps a generator that yields stages (one collective of the op layer each:
allreduce_stage, allgather_stage, alltoall_stage); `drive_all` advances many of them
together, so the second stage of every tensor is submitted before any of them is waited on and
the engine can fuse them. `compress`/`decompress` stay for API symmetry: `decompress` is the
identity (the result is already decompressed), `compress` refuses with a clear error.
"""
from __future__ import annotations

from typing import Any, Callable, Generator, Iterable

import torch

from . import basics, ops
from .messages import AVERAGE, SUM
from .process_sets import global_process_set


class Stage:
    """One collective of a multi-stage reduction: the op layer's handle and what its result
    becomes (the one output of a single-tensor call)."""

    __slots__ = ("handle", "post")

    def __init__(self, handle: ops.Handle, post: Callable) -> None:
        self.handle, self.post = handle, post

    def wait(self):
        return self.post(self.handle.wait())


def _single(result):
    return result[0]


def allreduce_stage(tensor, name: str, op: int, process_set) -> Stage:
    """`tensor` (contiguous, no autograd) reduced in place."""
    return Stage(ops.allreduce([tensor], names=name, op=op, process_set=process_set,
                               outputs=[tensor]), _single)


def allgather_stage(tensor, name: str, process_set) -> Stage:
    return Stage(ops.allgather([tensor], names=name, process_set=process_set), _single)


def alltoall_stage(tensor, name: str, process_set) -> Stage:
    """Equal parts to every rank; the result is (output, received splits)."""
    return Stage(ops.alltoall(tensor, None, names=name, process_set=process_set), tuple)


class PendingReduce:
    """A multi-stage reduction in flight; `result()` (or calling it) waits for the end."""

    def __init__(self, gen: Generator) -> None:
        self._gen = gen
        self.done = False
        self._value = None
        self._handle = None
        self._send(None, first=True)

    def _send(self, value: Any, first: bool = False) -> None:
        try:
            self._handle = next(self._gen) if first else self._gen.send(value)
        except StopIteration as stop:
            self.done = True
            self._value = stop.value
            self._handle = None

    def advance(self) -> None:
        """Wait for the current stage and submit the next one."""
        if self.done:
            return
        self._send(self._handle.wait())

    def result(self):
        while not self.done:
            self.advance()
        return self._value

    __call__ = result


def drive_all(handles: Iterable) -> None:
    """Advance every `PendingReduce` in `handles` stage by stage until all are done (plain
    integer handles are left alone)."""
    pending = [h for h in handles if isinstance(h, PendingReduce)]
    while pending:
        for h in pending:
            h.advance()
        pending = [h for h in pending if not h.done]


def is_stateful(compression: Any) -> bool:
    """True for compressors (class or instance) that reduce through `reduce_async`."""
    return bool(getattr(compression, "stateful", False))


class StatefulCompressor:
    """Base class of compressors with per-tensor state that reduce by their own collectives."""

    stateful = True

    def __init__(self) -> None:
        self.wire_bytes = 0      # modelled bytes this rank sent (ring/alltoall/allgather)
        self.state: dict[str, dict] = {}

    def reduce_async(self, tensor, name: str, op=None, process_set=None) -> PendingReduce:
        """Start reducing `tensor` (Average or Sum over `process_set`); returns a handle whose
        `result()` is the reduced, decompressed tensor (a new tensor, same shape and dtype)."""
        op = AVERAGE if op is None else op
        if op not in (AVERAGE, SUM):
            raise ValueError(f"{type(self).__name__} supports op=Average or Sum, not {op}")
        self._check_dtype(tensor, name)
        return PendingReduce(self._reduce(tensor, name, op == AVERAGE,
                                          process_set or global_process_set))

    def _check_dtype(self, tensor, name: str) -> None:
        if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"{type(self).__name__} cannot compress tensor '{name}' of dtype "
                            f"{tensor.dtype}: it handles floating-point tensors only. Use "
                            f"Compression.none for this tensor's optimizer (or exclude it).")

    def _reduce(self, tensor, name: str, average: bool, process_set) -> Generator:
        raise NotImplementedError

    def compress(self, tensor):
        raise TypeError(f"{type(self).__name__} reduces through its own collectives; pass it "
                        f"as DistributedOptimizer(compression=...), not to hvd.allreduce")

    @staticmethod
    def decompress(tensor, ctx):
        return tensor

    def reset(self) -> None:
        """Forget residuals and factors (after loading a checkpoint or a resize)."""
        self.state.clear()

    def state_dict(self) -> dict:
        return {"state": {k: dict(v) for k, v in self.state.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.state = {k: dict(v) for k, v in sd.get("state", {}).items()}


def set_size(process_set) -> int:
    """How many ranks reduce: the job's for the global set, else the set's."""
    if process_set is None or process_set.process_set_id == 0:
        return basics.size()
    return process_set.size()


def ring_allreduce_bytes(nbytes: int, n: int) -> float:
    """Bytes one rank sends in a ring allreduce of `nbytes` over n ranks."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


__all__ = ["PendingReduce", "Stage", "StatefulCompressor", "allgather_stage", "allreduce_stage",
           "alltoall_stage", "drive_all", "is_stateful", "ring_allreduce_bytes", "set_size"]
