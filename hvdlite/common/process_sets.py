"""Process sets: subsets of ranks with their own negotiation and communicator (Horovod's API)."""
from __future__ import annotations

from typing import Callable, Iterable, Optional

# The job's membership: set id -> its global ranks, and this process's global rank. Installed by
# basics (bind), which owns the job's state and imports this module.
_set_ranks: Optional[Callable[[int], list]] = None
_rank: Optional[Callable[[], int]] = None


def bind(set_ranks: Callable[[int], list], rank: Callable[[], int]) -> None:
    """Where ProcessSet asks for its members (basics._set_ranks, basics.rank)."""
    global _set_ranks, _rank
    _set_ranks, _rank = set_ranks, rank


class ProcessSet:
    """A subset of ranks. Pass it as `process_set=` to any collective.

    Static sets go to `init(process_sets=[...])`; dynamic ones to `add_process_set` after
    `init(process_sets="dynamic")`. Like Horovod, collectives still name broadcast roots by
    global rank.
    """

    process_set_id: Optional[int] = None
    ranks: Optional[list] = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if hasattr(ranks_or_comm, "Get_rank") and hasattr(ranks_or_comm, "Get_size"):
            self.mpi_comm = ranks_or_comm
        else:
            self.ranks = _rank_list(ranks_or_comm)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Size of the set, or None if it is not registered."""
        if self.process_set_id is None:
            return None
        return len(_set_ranks(self.process_set_id))

    def rank(self) -> Optional[int]:
        """This process's rank within the set, None if the set is not registered; raises
        ValueError where this process is not a member, as Horovod does (`included()` asks
        without raising)."""
        if self.process_set_id is None:
            return None
        ranks = _set_ranks(self.process_set_id)
        me = _rank()
        if me not in ranks:
            raise ValueError(f"Process is not part of provided process set: rank {me} is not "
                             f"one of its ranks {list(ranks)} (ask included() first)")
        return ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this process is in the set, or None if the set has no ranks yet."""
        if self.ranks is None:
            return None
        return _rank() in self.ranks

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        return (isinstance(other, ProcessSet) and self.process_set_id == other.process_set_id
                and self.ranks == other.ranks)

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self.ranks or ())))


def _rank_list(ranks: Iterable) -> list:
    """Horovod sorts any iterable of ranks (list, range, reversed(...), set, numpy array,
    tensor), so a permuted set equals the sorted one."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise ValueError("ProcessSet should be initialized with a list of process ranks or an "
                         "mpi4py Comm object")
    try:
        items = list(ranks)
        out = [int(r) for r in items]
        bad = [r for r, i in zip(items, out) if float(r) != i]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"ProcessSet ranks must be integers: {exc}") from None
    if bad:
        raise ValueError(f"ProcessSet ranks must be integers, got {bad}")
    if len(set(out)) != len(out):
        raise ValueError(f"ProcessSet ranks must be distinct, got {out}")
    return sorted(out)


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
