"""Stall inspector: name, per missing rank, the tensors it has not submitted — and what it is
waiting on instead, which is what a name or order mismatch looks like.
"""
from __future__ import annotations

import logging

from .config import Settings

log = logging.getLogger("hvdlite")
_SHOW = 6


class StallInspector:
    def __init__(self, settings: Settings):
        self.warning_s = settings.stall_warning_s
        self.shutdown_s = settings.stall_shutdown_s
        if 0 < self.shutdown_s < self.warning_s:
            log.warning("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (%s) is below the stall warning time "
                        "(%s); stalled jobs will not be shut down.", self.shutdown_s,
                        self.warning_s)
            self.shutdown_s = 0
        self.last_warning = 0.0
        self.missing: list[int] = []
        self.waiting_for: dict[int, list[str]] = {}
        self.oldest = 0.0

    def check(self, sets: dict, now: float) -> str | None:
        """Log a warning for stalls older than the warning time; return a fatal message when a
        stall is older than the shutdown time."""
        report: dict[int, list[str]] = {}        # missing global rank -> names
        submitted: dict[int, list[str]] = {}     # global rank -> names it waits on
        oldest = 0.0
        for s in sets.values():
            for name, reqs in s.table.items():
                age = now - s.first_seen.get(name, now)
                if age < self.warning_s:
                    continue
                oldest = max(oldest, age)
                for idx in range(len(s.ranks)):
                    g = s.ranks[idx]
                    if idx in reqs:
                        submitted.setdefault(g, []).append(name)
                    elif idx not in s.joined:
                        report.setdefault(g, []).append(name)
            for bit, seen in s.bit_seen.items():
                age = now - seen
                if age < self.warning_s:
                    continue
                entry = s.cache.lookup_bit(bit)
                name = entry.template.names[0] if entry else f"<cached #{bit}>"
                oldest = max(oldest, age)
                for idx, bits in enumerate(s.pending_bits):
                    g = s.ranks[idx]
                    if bits >> bit & 1:
                        submitted.setdefault(g, []).append(name)
                    elif idx not in s.joined:
                        report.setdefault(g, []).append(name)
        # Ranks missing from a stall at least warning-time old, and what the others wait for
        # (read by the coordinator to name a hung rank and by the flight-recorder report).
        self.missing = sorted(report)
        self.waiting_for = {g: list(names) for g, names in report.items()}
        self.oldest = oldest
        if not report:
            return None
        lines = []
        for g in sorted(report):
            names = report[g]
            more = f" and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
            line = f"  rank {g} has not submitted: {names[:_SHOW]}{more}"
            own = [n for n in submitted.get(g, []) if n not in names]
            if own:
                line += f"; it is waiting on {own[:_SHOW]} instead (a name or order mismatch?)"
            lines.append(line)
        text = (f"One or more tensors were submitted to be reduced, gathered or broadcast by a "
                f"subset of ranks and have waited for the remaining ranks for {oldest:.0f} s.\n"
                + "\n".join(lines))
        if self.shutdown_s > 0 and oldest >= self.shutdown_s:
            return (text + f"\nStalled for more than {self.shutdown_s:.0f} s "
                    f"(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS): shutting the job down.")
        if now - self.last_warning >= self.warning_s:
            self.last_warning = now
            if self.shutdown_s > 0:
                what = (f"The job is shut down once the stall reaches {self.shutdown_s:.0f} s "
                        f"(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS).")
            else:
                what = ("The job goes on waiting; set HOROVOD_STALL_SHUTDOWN_TIME_SECONDS to "
                        "fail it instead.")
            log.warning("%s\n%s", text, what)
        return None
