"""Compressors that keep per-tensor state and run their own collectives (torch).

Horovod's `Compressor` is a pair of static methods around one allreduce: right for a cast
(fp16), wrong for the compressors that matter for bandwidth:
- 8-bit quantisation cannot be summed in 8 bits, so it is reduced Bagua-ByteGrad style:
  alltoall of quantised chunks, each rank sums its chunk, allgather of the requantised chunk;
- PowerSGD allreduces two low-rank factors, with a local orthogonalisation in between.
Both keep state per tensor (error-feedback residuals, PowerSGD's warm-started Q), keyed by the
tensor's wire name, which is identical on every rank and stable from step to step.

So a stateful compressor is an *instance* (one per optimizer, created from the class if the
class is passed) with `reduce_async(tensor, name, op, process_set) -> PendingReduce`. The
`PendingReduce` wraps a generator that yields engine handles; `drive_all` advances many of them
together, so the second stage of every tensor is submitted before any of them is waited on and
the engine can fuse them. `compress`/`decompress` stay for API symmetry: `decompress` is the
identity (the result is already decompressed), `compress` refuses with a clear error.
"""
from __future__ import annotations

from typing import Any, Generator, Iterable


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
        from .mpi_ops import synchronize
        self._send(synchronize(self._handle))

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
        from .mpi_ops import Average, Sum, global_process_set
        op = Average if op is None else op
        if op not in (Average, Sum):
            raise ValueError(f"{type(self).__name__} supports op=Average or Sum, not {op}")
        self._check_dtype(tensor, name)
        return PendingReduce(self._reduce(tensor, name, op == Average,
                                          process_set or global_process_set))

    def _check_dtype(self, tensor, name: str) -> None:
        import torch
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


def _set_size(process_set) -> int:
    from ..common import basics
    if process_set is None or process_set.process_set_id == 0:
        return basics.size()
    return process_set.size()


def ring_allreduce_bytes(nbytes: int, n: int) -> float:
    """Bytes one rank sends in a ring allreduce of `nbytes` over n ranks."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


__all__ = ["PendingReduce", "StatefulCompressor", "drive_all", "is_stateful",
           "ring_allreduce_bytes"]
