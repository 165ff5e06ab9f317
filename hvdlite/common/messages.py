"""The engine protocol's messages: what a rank asks for (Request) and what the coordinator decides (Response).

Tensors are matched across ranks by name, as in Horovod: every rank must submit the same names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Reduce ops: Horovod's numbering (horovod/common/basics.py), shared by every frontend.
AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT = 0, 1, 2, 3, 4, 5
REDUCE_OP_NAMES = {AVERAGE: "Average", SUM: "Sum", ADASUM: "Adasum", MIN: "Min", MAX: "Max",
                   PRODUCT: "Product"}



def handle_average_backwards_compatibility(op, average):
    """Horovod's deprecated `average=` flag, mapped onto `op` (default Average)."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of "
                             "them.")
        return op
    if average is not None:
        import warnings
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in "
                      "v0.21.0", DeprecationWarning)
        return AVERAGE if average else SUM
    return AVERAGE


# Request / response types. (Horovod's ADASUM request type, 4, is not used: Adasum travels as
# ALLREDUCE with reduce_op=ADASUM.) The control frames that carry them: `protocol.Msg`.
ALLREDUCE, ALLGATHER, BROADCAST, JOIN = 0, 1, 2, 3
ALLTOALL, BARRIER, REDUCESCATTER = 5, 6, 7
ADD_PROCESS_SET, REMOVE_PROCESS_SET, ERROR = 8, 9, 10
TYPE_NAMES = {ALLREDUCE: "ALLREDUCE", ALLGATHER: "ALLGATHER", BROADCAST: "BROADCAST", JOIN: "JOIN",
              ALLTOALL: "ALLTOALL", BARRIER: "BARRIER",
              REDUCESCATTER: "REDUCESCATTER", ADD_PROCESS_SET: "ADD_PROCESS_SET",
              REMOVE_PROCESS_SET: "REMOVE_PROCESS_SET", ERROR: "ERROR"}

# Types whose responses the coordinator may cache (steady-state training repeats them).
CACHEABLE_TYPES = frozenset({ALLREDUCE, ALLGATHER, BROADCAST, REDUCESCATTER, BARRIER})
# Types that may be fused into one transport call.
FUSABLE_TYPES = frozenset({ALLREDUCE, ALLGATHER, BROADCAST, REDUCESCATTER})
# Types that reduce: they need identical shapes on every rank and a reduce op.
REDUCING_TYPES = frozenset({ALLREDUCE, REDUCESCATTER})

ITEMSIZE = {"uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2,
            "bfloat16": 2, "float32": 4, "float64": 8, "bool": 1}


@dataclass(slots=True)
class Request:
    """One rank's wish to run a collective on one named tensor."""

    rank: int                      # global rank of the sender
    name: str
    type: int
    dtype: str = "float32"
    shape: tuple = ()
    reduce_op: int = SUM
    prescale: float = 1.0
    postscale: float = 1.0
    root_rank: int = -1            # broadcast root, a global rank (Horovod semantics)
    device: int = -1               # -1 CPU, else CUDA device index
    process_set_id: int = 0
    group: str | None = None       # grouped ops: tensors of one group are released together
    group_size: int = 0
    splits: tuple | None = None    # alltoall: rows sent to each rank of the set
    cacheable: bool = True         # False for auto-named requests (names change every call)
    extra: Any = None              # add/remove process set payload
    invalid: str | None = None     # this rank's own argument error (checked before sending): the
                                   # coordinator fails the collective on every rank, so no peer
                                   # waits for a tensor this rank will never send

    def signature(self) -> tuple:
        """What must stay equal for a cached response to be reused.

        The group too: a cached member of a group is released only with its whole group, so
        the same name submitted in another group, or alone, is a different collective."""
        return (self.type, self.dtype, self.shape, self.reduce_op, self.prescale, self.postscale,
                self.root_rank, self.device, self.process_set_id, self.group, self.group_size)

    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE.get(self.dtype, 1)


@dataclass(slots=True)
class Response:
    """The coordinator's decision, identical on every rank of the process set."""

    type: int
    names: list
    process_set_id: int = 0
    dtype: str = "float32"
    shapes: list = field(default_factory=list)      # per tensor, the (common) shape
    reduce_op: int = SUM
    prescale: float = 1.0
    postscale: float = 1.0
    root_rank: int = -1            # broadcast root as a rank within the process set
    device: int = -1
    error: str | None = None
    gone: bool = False               # ERROR: a member left (not a disagreement between ranks)
    rank_dims: list | None = None    # allgather: per tensor, first dim of every set rank
    splits: list | None = None       # alltoall: per tensor, matrix [sender][receiver] of rows
    cache_bits: list | None = None   # per tensor: cache bit or -1
    joined: tuple = ()               # set ranks that had joined: they contribute zeros
    last_joined_rank: int = -1
    group: str | None = None
    extra: Any = None

    def tensor_nbytes(self, i: int) -> int:
        shape = self.shapes[i]
        n = math.prod(shape) * ITEMSIZE.get(self.dtype, 1)
        if self.type == ALLGATHER and self.rank_dims is not None:
            row = math.prod(shape[1:]) * ITEMSIZE.get(self.dtype, 1) if shape else 0
            return row * sum(self.rank_dims[i])
        return n

    def nbytes(self) -> int:
        return sum(self.tensor_nbytes(i) for i in range(len(self.names)))
