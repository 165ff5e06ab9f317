"""The coordinator: one thread in rank 0's process that every rank (rank 0 included) talks to.

It does Horovod's negotiation for every process set: collects requests by name, validates them
across ranks (negotiation.py), releases cached tensors by a bit-vector AND (response_cache.py), fuses
(fusion.py) and sends one ordered response stream. Because one coordinator orders the responses of
all process sets, every rank executes its collectives in one global order, so overlapping process
sets cannot deadlock. The event-driven loop answers as soon as a tensor is ready on every rank
instead of waiting for the next cycle.

Once a set is quiet and its tensors come back as cache hits, the coordinator hands the set to
the ranks (Item.STEADY, steady.py): they release cached tensors among themselves, and the
coordinator sees the set again only for first sight, changes, errors, joins, stalls ("W") and
shutdowns. Messages are tagged with the sender's last steady epoch per set; one sent before the
sender saw the latest Item.STEADY goes back to it (Item.TAKE_BACK) instead of into the table, so
the two ways of releasing a set never interleave differently on different ranks.

A grouped call is released whole, and its ranks must pass the same members: each member is
counted as it arrives (groups.OpenGroup), and once every rank's part is here, counts or names
that differ fail the whole call on every rank with both sides (_note_group), even where no
member name is common to all ranks (an empty list takes part as one stand-in request,
ops._empty_group).
"""
from .core import Coordinator
from .state import Peer, SetState

__all__ = ["Coordinator", "Peer", "SetState"]
