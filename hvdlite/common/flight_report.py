"""One report from every rank's flight-recorder dump (hvdlite/common/flight_recorder.py).

hvdlite-run prints it when a job ends after a stall, or when it is interrupted; `hvdlite-timeline
--flight DIR` prints it from the dumps left in DIR. It answers, in this order:

1. which ranks answered, and which did not (a hung or stopped rank cannot dump: the report shows
   what the others, and rank 0's coordinator, last saw from it);
2. the first collective on which the ranks diverge: each rank's oldest collective that has not
   finished, compared by name (a different collective, or none at all);
3. for each rank, the line of the user's code its main thread is blocked in, its last
   collectives, and the stack of every thread.

Read by the launcher (runner/hang_report.finish) and by `hvdlite-timeline --flight`
(tools/timeline_summary.py). Imports no framework.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Optional

_SHOW_RECORDS = 6


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
