"""A grouped call as the coordinator sees it arrive: which members each rank has submitted so
far, and the verdict once every rank's part is here (controller.Coordinator._note_group).

Why: a grouped call is released whole, so a member that only some ranks submit is never
ready, and its ranks waited for each other until the stall shutdown (600 s by default), whose
report then named a healthy rank as hung. construct_response catches ranks whose groups differ
in size only where a member name is common to all of them; here the counts and the names are
compared per call, so a call with no name in common (an empty list on one rank, a model whose
parameter names carry a wrapper's prefix on some ranks only) fails too, on every rank, with a
message that names both sides.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .negotiation import group_count_error, group_names_error


@dataclass
class OpenGroup:
    """One grouped call not yet released."""

    calls: dict = field(default_factory=dict)   # set rank -> (its count, {member name: None})
    complete: int = 0                           # ranks whose members are all here
    counted: bool = False                       # the ranks' counts were compared
    named: bool = False                         # the ranks' names were compared

    def add(self, rank: int, size: int, name: str) -> bool:
        """Count member `name` of set rank `rank`'s call of `size` members (0: an empty list's
        stand-in, one request); False if it was counted already."""
        call = self.calls.get(rank)
        if call is None:
            call = self.calls[rank] = (size, {})
        if name in call[1]:
            return False
        call[1][name] = None
        if len(call[1]) == max(call[0], 1):
            self.complete += 1
        return True

    def _first(self, rank: int) -> tuple:
        """(set rank `rank`'s count, the first of its members here)."""
        n, names = self.calls[rank]
        return n, next(iter(names))

    def verdict(self, ranks: list, joined: set, rtype: int, group: str) -> Optional[str]:
        """The error that fails the call, once it is certain; None while it may be well formed.
        `ranks`: the set's global ranks; `joined`: set ranks that joined (they submit nothing).

        The counts are compared once every rank's first member is here: not before, since a
        rank that got its error would go on to its next call of the group, whose members a
        late rank's, failed as they arrive, could not be told from (errors go out by name). A
        rank's members arrive together (one submission), so all of them are here then. The
        names are compared once every rank's members are all here."""
        calls = self.calls
        if not self.counted:
            missing = (len(calls) < len(ranks)) if not joined else \
                any(j not in calls and j not in joined for j in range(len(ranks)))
            if missing:
                return None
            self.counted = True
            a = min(calls)
            b = next((j for j in sorted(calls) if calls[j][0] != calls[a][0]), None)
            if b is not None:
                return group_count_error(rtype, group, ranks[a], self._first(a), ranks[b],
                                         self._first(b))
        if self.named or self.complete < len(calls):
            return None
        self.named = True
        a = min(calls)
        names = calls[a][1]
        b = next((j for j in sorted(calls) if calls[j][1].keys() != names.keys()), None)
        if b is None:
            return None
        other = calls[b][1]
        return group_names_error(rtype, group, ranks[a], next(n for n in names if n not in other),
                                 ranks[b], next(n for n in other if n not in names))
