"""Argument checks that Horovod makes when a collective is enqueued, before anything is sent.

Written once for both frontends (they pass plain Python values). A failure raises ValueError
on the calling rank, as Horovod's enqueue-time checks do (the TensorFlow frontend reports it as
tf.errors.InvalidArgumentError, the class Horovod's kernels return), instead of becoming a
cross-rank error from the coordinator.
"""
from __future__ import annotations

from typing import Optional, Sequence


def alltoall_splits(splits: Optional[Sequence[int]], dim0: int, set_size: int,
                    what: str = "alltoall", dtype: Optional[str] = None) -> Optional[tuple]:
    """The splits to send (None: equal parts), checked against the tensor's first dimension.
    `dtype` is the dtype name of a splits tensor: anything but int32 is refused, never read as
    garbage counts."""
    if splits is not None and dtype is not None and dtype != "int32":
        raise ValueError(f"{what}: splits must be an int32 tensor (or a list of ints), got a "
                         f"{dtype} tensor; cast the splits to int32")
    if splits is None:
        if set_size and dim0 % set_size != 0:
            raise ValueError(
                f"{what}: the first dimension of the tensor ({dim0}) does not divide evenly "
                f"among the {set_size} ranks of the process set; pass splits= (one count per "
                f"rank, summing to {dim0})")
        return None
    out = tuple(int(s) for s in splits)
    if len(out) != set_size:
        raise ValueError(f"{what}: splits has {len(out)} entries {list(out)}, the process set has "
                         f"{set_size} ranks; pass one count per rank")
    if any(s < 0 for s in out):
        raise ValueError(f"{what}: splits {list(out)} has negative entries")
    if sum(out) != dim0:
        raise ValueError(f"{what}: splits {list(out)} sum to {sum(out)}, not to the first "
                         f"dimension of the tensor ({dim0})")
    return out
