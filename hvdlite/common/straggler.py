"""Straggler report: which rank is slow to submit, before it becomes a stall.

In synchronous training every rank waits for the slowest, so step times are equal everywhere and
say nothing about who is slow. What differs is each rank's *time to submit*: from the moment a
rank had the results it waited for (it could go on) to the moment it submitted its next
collective (it had done its compute). Every rank measures its own (`Pace`, from the op layer's
submissions and waits) and sends the sums to the coordinator once a second, with the
heartbeat's answer (`Msg.PACE`); every N seconds the coordinator prints each rank's mean time
relative to the median rank (the median rank = 1.00; 3.00 means three times as long). Turned on
by `hvdlite-run --straggler-report N` or HVDLITE_STRAGGLER_REPORT=N (seconds).

Why on the ranks: the coordinator used to time it from its responses to the next requests,
and in the steady state (steady.py) cached collectives reach neither: a training job's report
rested on its first few steps, or said nothing.
"""
from __future__ import annotations

import statistics

from . import config  # noqa: E402
import sys
from typing import Optional

ENV = "HVDLITE_STRAGGLER_REPORT"
_FLOOR_S = 0.0005   # below half a millisecond, times are noise: keep ratios meaningful


def interval_from_env() -> float:
    value = config.env("STRAGGLER_REPORT")
    try:
        return float(value) if value else 0.0
    except ValueError:
        raise ValueError(f"{ENV}={value!r} is not a number of seconds") from None


class Pace:
    """One rank's own time to submit (lives in its engine; times are time.monotonic()).

    `done()` when the caller has the results it waited for, `submitted()` when it hands in its
    next collective: each gap counts once. Called from the callers' threads; a lost update
    under a race only drops one sample."""

    __slots__ = ("total", "count", "idle_since")

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.idle_since: Optional[float] = None

    def done(self, now: float) -> None:
        self.idle_since = now

    def submitted(self, now: float) -> None:
        since = self.idle_since
        if since is not None:
            self.idle_since = None
            self.total += now - since
            self.count += 1

    def take(self) -> tuple[float, int]:
        """The sums since the last call, and start again."""
        total, count = self.total, self.count
        self.total, self.count = 0.0, 0
        return total, count


class Tracker:
    """Lives in the coordinator's thread; all times are time.monotonic()."""

    def __init__(self, size: int, interval_s: float, hosts: Optional[dict] = None,
                 now: float = 0.0) -> None:
        self.size = size
        self.interval_s = interval_s
        self.hosts = hosts or {}
        self.total = [0.0] * size
        self.count = [0] * size
        self.next_report = now + interval_s

    def add(self, rank: int, total_s: float, count: int) -> None:
        """A rank's Pace sums (Msg.PACE)."""
        if 0 <= rank < self.size and count > 0:
            self.total[rank] += float(total_s)
            self.count[rank] += int(count)

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
