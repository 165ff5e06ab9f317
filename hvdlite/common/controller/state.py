"""The coordinator's state of one process set, and of one rank's connection."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..response_cache import CoordinatorCache
from ..wire import Channel

# Warn once per set when this many tensors the cache evicted for room came back: its capacity
# is below what a step submits (steps then never reach the steady state).
THRASH_WARN_RETURNS = 32


@dataclass
class SetState:
    """Negotiation state of one process set."""

    id: int
    ranks: list                                   # set rank -> global rank
    cache: CoordinatorCache
    table: dict = field(default_factory=dict)     # name -> {set rank: Request}
    first_seen: dict = field(default_factory=dict)
    pending_bits: list = field(default_factory=list)
    bit_seen: dict = field(default_factory=dict)  # bit -> first time a rank hit it
    joined: set = field(default_factory=set)
    last_joined: int = -1
    groups: dict = field(default_factory=dict)    # group -> [Response] released together
    gone: set = field(default_factory=set)        # set ranks that shut down
    epoch: int = 0                                # steady-state epochs handed out (Item.STEADY)
    steady: bool = False                          # the ranks release cached tensors themselves
    unsteady: set = field(default_factory=set)    # set ranks that fell back (Msg.STEADY_LEFT)
    waiting: dict = field(default_factory=dict)   # set rank -> (since, names) waiting in a round
    all_hits: bool = False                        # this round released only cache hits
    thrash_warned: bool = False                   # warned that the cache is too small
    # Groups whose ranks disagreed on their members (_fail_group): group -> (error, {set rank:
    # how many of its members' requests are still to be failed}).
    failed_groups: dict = field(default_factory=dict)
    # Grouped calls not yet released: group -> groups.OpenGroup (_note_group).
    open_groups: dict = field(default_factory=dict)

    def __post_init__(self):
        self.index = {g: i for i, g in enumerate(self.ranks)}
        self.pending_bits = [0] * len(self.ranks)


@dataclass
class Peer:
    channel: Channel
    rank: int = -1
    hostname: str = ""
    pid: int = 0
    hello: dict | None = None
