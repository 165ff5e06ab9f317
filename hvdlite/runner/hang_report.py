"""One report from every rank's flight-recorder dump (hvdlite/common/flight_recorder.py).

hvdlite-run prints it when a job ends after a stall, or when it is interrupted; `hvdlite-timeline
--flight DIR` prints it from the dumps left in DIR. It answers, in this order:

1. which ranks answered, and which did not (a hung or stopped rank cannot dump: the report shows
   what the others, and rank 0's coordinator, last saw from it);
2. the first collective on which the ranks diverge: each rank's oldest collective that has not
   finished, compared by name (a different collective, or none at all);
3. for each rank, the line of the user's code its main thread is blocked in, its last
   collectives, and the stack of every thread.

Also here: whether a local process is stopped (SIGSTOP, a paused job), which the launchers use to
end a hung worker with SIGKILL, since a stopped process ignores SIGTERM. Imports no framework.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import tempfile
import time
from typing import Optional

from ..common import config

FLIGHT_DIR_ENV = "HVDLITE_FLIGHT_DIR"
_SHOW_RECORDS = 6


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


def load_dumps(path: str) -> dict[int, dict]:
    dumps = {}
    for name in glob.glob(os.path.join(path, "flight.rank*.json")):
        try:
            with open(name) as f:
                data = json.load(f)
            dumps[int(data["rank"])] = data
        except (OSError, ValueError, KeyError):
            continue
    return dumps


def _describe(rec: Optional[dict]) -> str:
    if rec is None:
        return "no collective in progress"
    shape = "x".join(map(str, rec.get("shape") or [])) or "scalar"
    return (f"{rec['op']} {rec['name']!r} ({rec.get('dtype')} [{shape}], process set "
            f"{rec.get('process_set')}, {rec['state']})")


def _pending(dump: dict) -> list[dict]:
    """The records of collectives still in progress (enqueued or started): not those that
    finished, failed ones included (a mismatch that failed long before was named as the
    collective every rank waited on)."""
    return [r for r in dump.get("records", []) if r.get("state") not in ("done", "failed")]


def _user_line(dump: dict) -> str:
    for t in dump.get("threads", []):
        if t.get("main"):
            f = t.get("user_frame")
            if f:
                return f"{f['file']}:{f['line']} in {f['function']}: {f['code']}"
            return "(no frame of the user's code on the main thread)"
    return "(no main thread in the dump)"


def divergence(dumps: dict[int, dict]) -> Optional[str]:
    """The first collective the ranks do not agree on, or None when they all wait on the same."""
    if not dumps:
        return None
    first = {r: (_pending(d)[0] if _pending(d) else None) for r, d in sorted(dumps.items())}
    names = {r: (rec["name"] if rec else None) for r, rec in first.items()}
    if len(set(names.values())) == 1:
        only = next(iter(first.values()))
        if only is None:
            return None
        return f"every rank that answered waits on the same collective: {_describe(only)}"
    parts = [f"rank {r}: {_describe(rec)}" for r, rec in first.items()]
    return "the ranks diverge at their first unfinished collective:\n    " + "\n    ".join(parts)


def build_report(path: str, size: Optional[int] = None) -> Optional[str]:
    """The hang report from the dumps in `path`, or None when there are none."""
    dumps = load_dumps(path)
    if not dumps:
        return None
    size = size or max(d.get("size", 1) for d in dumps.values())
    silent = [r for r in range(size) if r not in dumps]
    lines = [f"hvdlite hang report: {len(dumps)} of {size} ranks answered "
             f"(flight-recorder dumps in {path})"]
    view = next((d["coordinator"] for d in dumps.values() if isinstance(d.get("coordinator"),
                                                                          dict)), {})
    for r in silent:
        seen = view.get(str(r), {})
        what = "it is hung, stopped or unreachable"
        if seen:
            age = seen.get("last_submitted_age_s")
            last = seen.get("last_submitted") or []
            what += (f"; host {seen.get('host')}, pid {seen.get('pid')}; the coordinator last "
                     f"heard from it {age if age is not None else '?'} s before the dump: "
                     f"{last[:3]}")
            if seen.get("missing_from_stall"):
                what += f"; the others wait for it to submit {seen['missing_from_stall'][:4]}"
        lines.append(f"  rank {r} did not answer: {what}")
    div = divergence(dumps)
    if div:
        lines.append("  " + div)
    for r, d in sorted(dumps.items()):
        lines.append(f"  rank {r} (host {d.get('host')}, pid {d.get('pid')}, dumped on "
                     f"{d.get('reason')}): blocked in {_user_line(d)}")
        recs = d.get("records", [])[-_SHOW_RECORDS:]
        for rec in recs:
            lines.append(f"      #{rec.get('seq')} {_describe(rec)}")
        for t in d.get("threads", []):
            stack = t.get("stack", [])
            lines.append(f"    thread {t.get('thread')}:")
            for f in stack[-8:]:
                lines.append(f"      {f['file']}:{f['line']} in {f['function']}: {f['code']}")
    return "\n".join(lines)


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
