"""Straggler report: which rank is slow to submit, before it becomes a stall.

In synchronous training every rank waits for the slowest, so step times are equal everywhere and
say nothing about who is slow. What differs is each rank's *time to submit*: from the moment the
coordinator sent a rank its last responses (the rank could go on) to the moment that rank's next
requests arrived (it had done its compute and asked again). The coordinator measures it for every
rank over the same collectives, and every N seconds prints each rank's mean time relative to the
median rank (the median rank = 1.00; 3.00 means three times as long). Turned on by
`hvdlite-run --straggler-report N` or HVDLITE_STRAGGLER_REPORT=N (seconds).
"""
from __future__ import annotations

import statistics

from . import config  # noqa: E402
import sys
from typing import Iterable, Optional

ENV = "HVDLITE_STRAGGLER_REPORT"
_FLOOR_S = 0.0005   # below half a millisecond, times are noise: keep ratios meaningful


def interval_from_env() -> float:
    value = config.env("STRAGGLER_REPORT")
    try:
        return float(value) if value else 0.0
    except ValueError:
        raise ValueError(f"{ENV}={value!r} is not a number of seconds") from None


class Tracker:
    """Lives in the coordinator's thread; all times are time.monotonic()."""

    def __init__(self, size: int, interval_s: float, hosts: Optional[dict] = None,
                 now: float = 0.0) -> None:
        self.size = size
        self.interval_s = interval_s
        self.hosts = hosts or {}
        self.released_at: dict[int, float] = {}
        self.total = [0.0] * size
        self.count = [0] * size
        self.next_report = now + interval_s

    def released(self, ranks: Iterable[int], now: float) -> None:
        for r in ranks:
            self.released_at[r] = now

    def submitted(self, rank: int, now: float) -> None:
        since = self.released_at.pop(rank, None)
        if since is not None and 0 <= rank < self.size:
            self.total[rank] += now - since
            self.count[rank] += 1

    def relative(self) -> Optional[list[float]]:
        """Each rank's mean time to submit over the median rank's, or None without data."""
        if not all(self.count):
            return None
        means = [max(t / c, _FLOOR_S) for t, c in zip(self.total, self.count)]
        median = statistics.median_low(means)
        return [m / median for m in means]

    def maybe_report(self, now: float, stream=None) -> Optional[str]:
        if now < self.next_report:
            return None
        self.next_report = now + self.interval_s
        rel = self.relative()
        counts = min(self.count) if self.count else 0
        self.total = [0.0] * self.size
        self.count = [0] * self.size
        if rel is None:
            return None
        slowest = max(range(self.size), key=lambda r: rel[r])
        parts = [f"rank {r} {v:.2f}" for r, v in enumerate(rel)]
        host = self.hosts.get(slowest)
        text = (f"[hvdlite] straggler report (last {self.interval_s:g} s, >= {counts} "
                f"submissions per rank; time to submit relative to the median rank = 1.00): "
                f"{', '.join(parts)}; slowest: rank {slowest}"
                + (f" on host {host}" if host else ""))
        print(text, file=stream or sys.stderr, flush=True)
        return text
