"""`hvdlite-timeline FILE`: where the time went, from a timeline written with HOROVOD_TIMELINE.

The timeline (timeline.py) is a Chrome trace written by rank 0: one "process" per tensor, with
NEGOTIATE_<OP> (and one tick per rank as it submitted the tensor) on the coordinator, then the
operation as rank 0 ran it, with QUEUE, MEMCPY_IN_FUSION_BUFFER, the transport call and
MEMCPY_OUT_FUSION_BUFFER nested inside. This tool folds those events into five phases per tensor:

    negotiation  NEGOTIATE_*: from the first rank's request to the last one's (waiting for ranks)
    queue        negotiated but not yet running: from the end of negotiation to the operation's
                 start on rank 0, plus QUEUE and any time inside the operation outside a phase
    memcpy_in    MEMCPY_IN_FUSION_BUFFER (copies into the fusion buffer, prescaling)
    transport    the collective itself (ALLREDUCE, ALLGATHER, BROADCAST, ..., ADASUM_*)
    memcpy_out   MEMCPY_OUT_FUSION_BUFFER (copies out, postscaling)

and prints totals per phase (summed over tensors, and as wall time during which any tensor was
in that phase: fused tensors share their phases), the tensors that took longest, which rank was
the last to submit in the negotiations, and what was still running when the file ended. A file
from a crashed job (no closing `]`, maybe half a line at the end) is read up to its last complete
event. Cached tensors skip negotiation, so in steady state their NEGOTIATE phase is absent.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import sys
from dataclasses import dataclass, field

from ..common.flight_report import build_report, load_dumps

PHASES = ("negotiation", "queue", "memcpy_in", "transport", "memcpy_out")
ITEMSIZE = {"uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2,
            "bfloat16": 2, "float32": 4, "float64": 8, "bool": 1}


def phase_of(label: str) -> str:
    if label.startswith("NEGOTIATE"):
        return "negotiation"
    if label in ("QUEUE", "WAIT_FOR_DATA", "WAIT_FOR_OTHER_TENSOR_DATA"):
        return "queue"
    if label.startswith("MEMCPY_IN"):
        return "memcpy_in"
    if label.startswith("MEMCPY_OUT"):
        return "memcpy_out"
    return "transport"


# ---------------------------------------------------------------------- reading
def read_events(path: str) -> tuple[list[dict], bool]:
    """The trace's events and whether the file was complete. Tolerates a missing closing `]`
    and a partly written last event (a crashed or killed job)."""
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        text = f.read()
    stripped = text.strip()
    try:
        data = json.loads(stripped)
        if isinstance(data, dict):
            data = data.get("traceEvents", [])
        return [e for e in data if isinstance(e, dict)], True
    except json.JSONDecodeError:
        pass
    decoder = json.JSONDecoder()
    pos = stripped.find("[")
    if pos < 0:
        raise ValueError(f"{path} is not a Chrome trace (no '[' found)")
    if stripped.lstrip().startswith("{") and '"traceEvents"' in stripped[:200]:
        pos = stripped.find("[", stripped.find('"traceEvents"'))
    pos += 1
    events = []
    n = len(stripped)
    while pos < n:
        while pos < n and stripped[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or stripped[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(stripped, pos)
        except json.JSONDecodeError:
            break  # the half-written tail of a crashed job
        if isinstance(obj, dict):
            events.append(obj)
    return events, False


# ---------------------------------------------------------------------- folding
@dataclass
class TensorStats:
    name: str
    phases: dict = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    ops: int = 0
    negotiations: int = 0
    op_label: str = ""
    dtype: str = ""
    shape: str = ""

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    @property
    def nbytes(self) -> int | None:
        try:
            shape = ast.literal_eval(self.shape) if self.shape else None
        except (ValueError, SyntaxError):
            return None
        if not isinstance(shape, tuple) or self.dtype not in ITEMSIZE:
            return None
        return math.prod(shape) * ITEMSIZE[self.dtype]


@dataclass
class _Open:
    label: str
    start: float
    is_op: bool
    children: float = 0.0
    ticks: list = field(default_factory=list)


@dataclass
class Summary:
    path: str
    complete: bool
    events: int
    span_us: float
    tensors: dict
    wall: dict                      # phase -> union of intervals (µs)
    last_rank: dict                 # rank -> [times last, µs waited on it]
    negotiations: int
    cycles: int
    still_open: list                # (tensor, label, phase, open µs)


def _union(intervals: list) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(path: str) -> Summary:
    events, complete = read_events(path)
    names: dict = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e.get("pid")] = str(e.get("args", {}).get("name", e.get("pid")))
    tensors: dict[str, TensorStats] = {}
    stacks: dict = {}
    neg_end: dict = {}              # pid -> ts of its last negotiation end (queue starts)
    intervals = {p: [] for p in PHASES}
    last_rank: dict = {}
    negotiations = cycles = 0
    first_ts, last_ts = math.inf, -math.inf

    def stats(pid) -> TensorStats:
        name = names.get(pid, f"pid {pid}")
        if name not in tensors:
            tensors[name] = TensorStats(name)
        return tensors[name]

    def add(pid, phase, a, b):
        if b > a:
            stats(pid).phases[phase] += b - a
            intervals[phase].append((a, b))

    for e in events:
        ph, ts = e.get("ph"), e.get("ts")
        if ph not in ("B", "E", "X", "i", "I") or not isinstance(ts, (int, float)):
            continue
        first_ts, last_ts = min(first_ts, ts), max(last_ts, ts)
        if ph in ("i", "I"):
            if e.get("name") == "CYCLE_START":
                cycles += 1
            continue
        pid = e.get("pid")
        stack = stacks.setdefault((pid, e.get("tid", 0)), [])
        if ph == "X":
            if stack and stack[-1].label.startswith("NEGOTIATE"):
                stack[-1].ticks.append((ts, e.get("name")))
            continue
        if ph == "B":
            label = str(e.get("name", ""))
            args = e.get("args") or {}
            is_op = "dtype" in args
            if is_op:
                st = stats(pid)
                st.ops += 1
                st.op_label = label
                st.dtype = str(args.get("dtype", ""))
                st.shape = str(args.get("shape", ""))
                if pid in neg_end:  # negotiated, waiting to run
                    add(pid, "queue", neg_end.pop(pid), ts)
            stack.append(_Open(label, ts, is_op))
            continue
        # ph == "E"
        if not stack:
            continue
        top = stack.pop()
        dur = ts - top.start
        if top.is_op:
            # Time inside the operation that no phase accounts for counts as queueing.
            rest = dur - top.children
            if rest > 0:
                stats(pid).phases["queue"] += rest
                intervals["queue"].append((ts - rest, ts))
        else:
            phase = phase_of(top.label)
            add(pid, phase, top.start, ts)
            if phase == "negotiation":
                stats(pid).negotiations += 1
                negotiations += 1
                neg_end[pid] = ts
                if top.ticks:
                    last_ts_tick, who = max(top.ticks, key=lambda t: t[0])
                    waited = last_ts_tick - min(t[0] for t in top.ticks)
                    entry = last_rank.setdefault(str(who), [0, 0.0])
                    entry[0] += 1
                    entry[1] += waited
        if stack:
            stack[-1].children += dur

    still_open = []
    end = last_ts if last_ts > -math.inf else 0.0
    for (pid, _), stack in stacks.items():
        if stack:  # report the innermost open phase, timed from when it began
            item = stack[-1]
            phase = "queue" if item.is_op else phase_of(item.label)
            still_open.append((names.get(pid, f"pid {pid}"), item.label, phase, end - item.start))
    span = (last_ts - first_ts) if last_ts >= first_ts else 0.0
    return Summary(path=path, complete=complete, events=len(events), span_us=span,
                   tensors=tensors, wall={p: _union(v) for p, v in intervals.items()},
                   last_rank=last_rank, negotiations=negotiations, cycles=cycles,
                   still_open=still_open)


# ---------------------------------------------------------------------- printing
def _ms(us: float) -> str:
    return f"{us / 1000:.3f}"


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _hint(s: Summary, totals: dict) -> str:
    grand = sum(totals.values())
    if grand <= 0:
        return "No timed phases in this file."
    phase = max(totals, key=totals.get)
    share = 100 * totals[phase] / grand
    why = {
        "negotiation": "ranks submit the same tensors at different times; the table of last "
                       "ranks names the rank the others wait for (slow data loading, uneven "
                       "work or a straggler)",
        "queue": "negotiated tensors wait to start on rank 0: earlier collectives ahead of them "
                 "or a long cycle time (HOROVOD_CYCLE_TIME)",
        "memcpy_in": "copying into fusion buffers: many small tensors, or prescaling",
        "transport": "the collectives themselves: bandwidth or latency bound; fewer, larger "
                     "fused calls (HOROVOD_FUSION_THRESHOLD) help latency-bound jobs",
        "memcpy_out": "copying out of fusion buffers: many small tensors, or postscaling",
    }[phase]
    return f"Most time is {phase} ({share:.0f}% of tensor time): {why}."


def render(s: Summary, top: int = 10) -> str:
    lines = []
    state = "complete" if s.complete else "TRUNCATED (no closing ']'; read up to the last " \
                                          "complete event)"
    lines.append(f"Timeline {s.path}: {s.events} events, {len(s.tensors)} tensors, "
                 f"span {_ms(s.span_us)} ms, file {state}")
    ops = sum(t.ops for t in s.tensors.values())
    lines.append(f"{ops} operations, {s.negotiations} negotiations"
                 + (f", {s.cycles} cycles marked" if s.cycles else ""))
    totals = {p: sum(t.phases[p] for t in s.tensors.values()) for p in PHASES}
    grand = sum(totals.values())
    lines.append("")
    lines.append("Time by phase (tensor ms: summed over tensors; wall ms: time any tensor was in "
                 "the phase)")
    lines.append(f"  {'phase':<12} {'tensor ms':>12} {'share':>7} {'wall ms':>12}")
    for p in PHASES:
        share = 100 * totals[p] / grand if grand > 0 else 0.0
        lines.append(f"  {p:<12} {_ms(totals[p]):>12} {share:>6.1f}% {_ms(s.wall[p]):>12}")
    lines.append(f"  {'total':<12} {_ms(grand):>12} {100.0 if grand else 0.0:>6.1f}%")
    lines.append("")
    ranked = sorted(s.tensors.values(), key=lambda t: t.total, reverse=True)[:top]
    lines.append(f"Top {len(ranked)} tensors by time (ms)")
    width = max([len("tensor")] + [len(t.name) for t in ranked])
    header = f"  {'tensor':<{width}} {'op':<14} {'size':>10} {'ops':>5} {'total':>10} " + \
        " ".join(f"{p:>11}" for p in PHASES)
    lines.append(header)
    for t in ranked:
        lines.append(f"  {t.name:<{width}} {t.op_label or '-':<14} {_size(t.nbytes):>10} "
                     f"{t.ops:>5} {_ms(t.total):>10} "
                     + " ".join(f"{_ms(t.phases[p]):>11}" for p in PHASES))
    if s.last_rank:
        lines.append("")
        lines.append("Last rank to submit, per negotiation (the one the others waited for)")
        for rank, (count, waited) in sorted(s.last_rank.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  rank {rank}: last in {count} of {s.negotiations} negotiations, "
                         f"{_ms(waited)} ms after the first rank in total")
    if s.still_open:
        lines.append("")
        lines.append("Still open when the file ended (in flight, or the job stopped here)")
        for name, label, phase, us in sorted(s.still_open, key=lambda x: -x[3])[:top]:
            lines.append(f"  {name}: {label} ({phase}) for {_ms(us)} ms")
    lines.append("")
    lines.append(_hint(s, totals))
    return "\n".join(lines)


def to_json(s: Summary) -> dict:
    return {
        "path": s.path, "complete": s.complete, "events": s.events, "span_ms": s.span_us / 1000,
        "negotiations": s.negotiations, "cycles": s.cycles,
        "phases_ms": {p: sum(t.phases[p] for t in s.tensors.values()) / 1000 for p in PHASES},
        "wall_ms": {p: v / 1000 for p, v in s.wall.items()},
        "tensors": {t.name: {"op": t.op_label, "dtype": t.dtype, "shape": t.shape,
                             "bytes": t.nbytes, "ops": t.ops, "negotiations": t.negotiations,
                             "total_ms": t.total / 1000,
                             "phases_ms": {p: v / 1000 for p, v in t.phases.items()}}
                    for t in s.tensors.values()},
        "last_rank": {r: {"count": c, "waited_ms": w / 1000} for r, (c, w) in
                      s.last_rank.items()},
        "still_open": [{"tensor": n, "label": lab, "phase": p, "ms": us / 1000}
                       for n, lab, p, us in s.still_open],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hvdlite-timeline",
        description="Summarise an hvdlite/Horovod timeline (HOROVOD_TIMELINE): time per phase "
                    "and per tensor, the ranks others waited for, and what was still running.")
    parser.add_argument("file", nargs="?",
                        help="the timeline JSON file (a truncated one is fine)")
    parser.add_argument("--top", type=int, default=10, help="tensors to list (default 10)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--flight", metavar="DIR",
                        help="print the hang report from the flight-recorder dumps in DIR "
                             "(flight.rank*.json, written on a stall, SIGUSR1 or Ctrl-C)")
    args = parser.parse_args(argv)
    if args.flight:
        if args.json:
            print(json.dumps(load_dumps(args.flight), indent=2, default=str))
            return 0
        report = build_report(args.flight)
        if report is None:
            print(f"hvdlite-timeline: no flight-recorder dumps in {args.flight}", file=sys.stderr)
            return 2
        print(report)
        return 0
    if not args.file:
        parser.error("a timeline file (or --flight DIR) is required")
    try:
        s = summarize(args.file)
    except (OSError, ValueError) as exc:
        print(f"hvdlite-timeline: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(s), indent=2))
    else:
        print(render(s, max(args.top, 0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
