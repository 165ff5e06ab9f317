"""The stall watch: heartbeats, the stall inspector's warnings, and the message that names a
hung rank.
"""
from __future__ import annotations

import logging

from ..protocol import Msg

log = logging.getLogger("hvdlite.common.controller")


class StallWatch:
    """Part of controller.core.Coordinator: stall watch (this module's docstring)."""

    # ------------------------------------------------------------------ stalls
    def _check_stalls(self, now: float) -> None:
        if self.settings.stall_check_disable:
            return
        fatal = self.stall.check(self.sets, now)
        if self.stall.missing and not self._dump_asked:
            # A stall is reported: every rank dumps its flight recorder and stacks now, while
            # the picture is fresh (flight_recorder.py); the hung rank cannot, and the
            # coordinator's own view of it goes into rank 0's dump.
            self._dump_asked = True
            for peer in list(self.peers.values()):
                try:
                    peer.channel.send((Msg.DUMP, "stall reported"))
                except OSError:
                    pass
        if fatal and self._still_starting(list(self.stall.missing)):
            fatal = None
        if fatal:
            hung = list(self.stall.missing)
            out: dict = {}
            self._stop_with(self._hang_message(hung, now) + "\n" + fatal, out,
                            {"hung": hung, "dump": "stall shutdown"})

    def _still_starting(self, hung: list) -> bool:
        """Ranks that have sent no collective yet, before any collective was released, are still
        starting (the steady state sends the coordinator nothing, so a hung rank's silence alone
        does not tell): a worker that joins an elastic job imports what its first steps need
        (torch's optimizers pull in torch._dynamo) and can take longer than a short stall
        shutdown time on a busy host. They get the start timeout (HVDLITE_START_TIMEOUT)
        instead; a rank hung after its first collective does not."""
        if self._released_any:
            return False   # a collective was released: every rank of it had started
        grace = max(self.settings.start_timeout_s, self.settings.stall_shutdown_s)
        return bool(hung) and all(self._last_seen.get(g) is None for g in hung) \
            and self.stall.oldest < grace

    def _heartbeat(self) -> None:
        """Once a second: lets every rank tell a quiet coordinator from a hung one (a stopped
        rank 0 stops its coordinator too; see Engine._check_coordinator)."""
        for peer in list(self.peers.values()):
            try:
                peer.channel.send((Msg.HEARTBEAT,))
            except OSError:
                pass

    def _describe_last(self, rank: int, now: float) -> str:
        seen = self._last_seen.get(rank)
        if seen is None:
            return "it has not sent the coordinator any collective yet"
        names = self._names_of(seen[1], seen[2])
        shown = ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")
        return f"the last collectives it submitted were {shown or '(none)'}, {now - seen[0]:.1f} s ago"

    def _names_of(self, requests, hits) -> list:
        names = [r.name for r in requests]
        for set_id, mask in hits:
            s = self.sets.get(set_id)
            if s is not None:
                names += self._bit_names(s, mask)
        return names

    def _hang_message(self, hung: list, now: float) -> str:
        """One line per hung rank: who, where, what it last did, what the others wait for."""
        lines = []
        for g in hung:
            peer = self.peers.get(g)
            where = f"host {peer.hostname}, pid {peer.pid}" if peer else "connection lost"
            waiting = self.stall.waiting_for.get(g, [])
            others = sorted(r for r in self.peers if r not in hung)
            lines.append(
                f"rank {g} ({where}) stopped making progress (hung): ranks {others} have waited "
                f"{self.stall.oldest:.0f} s for it to submit {waiting[:4]}; "
                f"{self._describe_last(g, now)}.")
        return "\n".join(lines)
