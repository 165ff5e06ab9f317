"""The launcher's side of the hang report: where the ranks dump, asking them to, and printing the
report (common/flight_report.py builds it from every rank's flight-recorder dump).

hvdlite-run prints it when a job ends after a stall, or when it is interrupted.

Also here: whether a local process is stopped (SIGSTOP, a paused job), which the launchers use to
end a hung worker with SIGKILL, since a stopped process ignores SIGTERM. Imports no framework.
"""
from __future__ import annotations

import os
import signal
import tempfile
import time
from typing import Optional

from ..common import config
from ..common.flight_report import build_report, load_dumps

FLIGHT_DIR_ENV = "HVDLITE_FLIGHT_DIR"


def process_stopped(pid: int) -> bool:
    """True when a local process is stopped (state T: SIGSTOP, SIGTSTP, or a debugger)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(")") + 2:][:1] in ("T", "t")


def catches_signal(pid: int, signum: int) -> bool:
    """True when a local process has a handler for `signum` (SigCgt in /proc): SIGUSR1 goes
    only to ranks whose flight recorder listens, since its default action ends a process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class StoppedWatch:
    """Remembers since when each watched process has been stopped."""

    def __init__(self) -> None:
        self.since: dict[int, float] = {}

    def stopped_for(self, pid: int, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        if process_stopped(pid):
            return now - self.since.setdefault(pid, now)
        self.since.pop(pid, None)
        return 0.0


def stall_shutdown_s(env: dict) -> float:
    """The stall shutdown time the workers run with (the launchers' hang limit); 0 when the
    job waits forever (shutdown time 0, or the stall check disabled, as in Horovod)."""
    environ = {**os.environ, **env}        # what the ranks read their settings from
    if config.truthy(config.env("STALL_CHECK_DISABLE", environ=environ)):
        return 0.0
    try:
        return float(config.env("STALL_SHUTDOWN_TIME_SECONDS", environ=environ) or 600.0)
    except ValueError:          # (check_values stops such a job before it starts)
        return 600.0


def flight_dir_for(env: dict) -> tuple[str, bool]:
    """The job's dump directory (HVDLITE_FLIGHT_DIR from the workers' environment, or a fresh
    one) and whether the launcher created it (and so removes it when nothing was dumped)."""
    path = env.get(FLIGHT_DIR_ENV)
    if path:
        return path, False
    return tempfile.mkdtemp(prefix="hvdlite-flight-"), True


def ask_dumps(pids: list[int], path: str, wait_s: float = 3.0) -> int:
    """SIGUSR1 to each local rank whose flight recorder listens; wait (bounded) for the dumps.
    Returns how many ranks were asked."""
    asked = 0
    for pid in pids:
        if catches_signal(pid, signal.SIGUSR1):
            try:
                os.kill(pid, signal.SIGUSR1)
                asked += 1
            except OSError:
                pass
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline and len(load_dumps(path)) < asked:
        time.sleep(0.1)
    return asked


def finish(path: str, created: bool, size: Optional[int], say) -> None:
    """Print the report when ranks dumped; otherwise remove a directory the launcher made."""
    try:
        report = build_report(path, size)
    except Exception as exc:  # a report must never hide the job's own result
        report = f"hvdlite hang report: could not be built: {exc!r}"
    if report:
        say(f"{report}\nread it again with: hvdlite-timeline --flight {path}")
    elif created:
        import shutil
        shutil.rmtree(path, ignore_errors=True)
