"""Pipeline schedules as data, checked and simulated before anything runs.

A schedule is one list of actions per stage: F(i) (forward of micro-batch i) and B(i) (its
backward). `lower` turns a stage's actions into the messages it receives and sends around each
computation; `simulate` replays every stage's program against the rule the runtime obeys (a send
never blocks, a receive waits for the matching send, messages pair by name) and either proves the
schedule completes, with its makespan, bubble and peak in-flight micro-batches, or names the
messages the stuck stages would wait for. Built-in schedules: GPipe (all forwards, then all
backwards in reverse) and 1F1B (PipeDream-Flush: p-s-1 warm-up forwards, then alternate).
A custom schedule is a list per stage of "F0", "B0", ... strings or (kind, micro-batch) pairs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union


class ScheduleError(ValueError):
    """The schedule is malformed or would deadlock."""


@dataclass(frozen=True, order=True)
class Action:
    kind: str      # "F" or "B"
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


@dataclass(frozen=True, order=True)
class Msg:
    """A message of one micro-batch between two stages: kind "F" carries activations from src to
    dst (src < dst), kind "B" carries their gradients back (src > dst)."""
    kind: str
    src: int
    dst: int
    mb: int

    def describe(self) -> str:
        what = "activations" if self.kind == "F" else "gradients"
        return f"{what} of micro-batch {self.mb} from stage {self.src} to stage {self.dst}"


def bubble_formula(p: int, m: int) -> float:
    """GPipe's idle fraction of wall-clock time, (p-1)/(m+p-1), for equal stage times."""
    return (p - 1) / (m + p - 1)


# ---------------------------------------------------------------------- built-in schedules
def gpipe(p: int, m: int) -> list[list[Action]]:
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]
            for _ in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    out = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warm, m)]
        out.append(acts)
    return out


def forward_only(p: int, m: int) -> list[list[Action]]:
    return [[Action("F", i) for i in range(m)] for _ in range(p)]


BUILTIN = {"gpipe": gpipe, "1f1b": one_f_one_b}


def _parse_action(a, s: int, j: int) -> Action:
    if isinstance(a, Action):
        return a
    if isinstance(a, str) and len(a) >= 2 and a[0].upper() in "FB" and a[1:].isdigit():
        return Action(a[0].upper(), int(a[1:]))
    if isinstance(a, (tuple, list)) and len(a) == 2 and str(a[0]).upper() in ("F", "B") \
            and isinstance(a[1], int):
        return Action(str(a[0]).upper(), a[1])
    raise ScheduleError(f"stage {s}, action {j}: {a!r} is not an action; write 'F3' / 'B3' or "
                        f"('F', 3)")


def build(schedule: Union[str, Sequence], p: int, m: int) -> list[list[Action]]:
    """The per-stage action lists of a built-in schedule name or a custom one."""
    if isinstance(schedule, str):
        fn = BUILTIN.get(schedule.lower())
        if fn is None:
            raise ScheduleError(f"schedule={schedule!r}: use 'gpipe', '1f1b', or a list of "
                                f"per-stage action lists")
        return fn(p, m)
    stages = list(schedule)
    if len(stages) != p:
        raise ScheduleError(f"the custom schedule has {len(stages)} stage lists but the pipeline "
                            f"has {p} stages")
    return [[_parse_action(a, s, j) for j, a in enumerate(acts)] for s, acts in enumerate(stages)]


# ---------------------------------------------------------------------- lowering
def lower(actions: Sequence[Action], stage: int, edges: Iterable[tuple[int, int]]
          ) -> list[tuple]:
    """The program of one stage: ('recv', Msg) / ('compute', Action) / ('send', Msg) in order.
    `edges` are the (src, dst) stage pairs that exchange activations (adjacent stages and skip
    connections)."""
    ins = sorted(a for a, b in edges if b == stage)
    outs = sorted(b for a, b in edges if a == stage)
    ops: list[tuple] = []
    for act in actions:
        i = act.mb
        if act.kind == "F":
            ops += [("recv", Msg("F", a, stage, i)) for a in ins]
            ops.append(("compute", act))
            ops += [("send", Msg("F", stage, b, i)) for b in outs]
        else:
            ops += [("recv", Msg("B", b, stage, i)) for b in outs]
            ops.append(("compute", act))
            ops += [("send", Msg("B", stage, a, i)) for a in ins]
    return ops


# ---------------------------------------------------------------------- checking
def validate(actions: Sequence[Sequence[Action]], p: int, m: int, training: bool = True) -> None:
    """Every stage runs F(i) for each micro-batch once, and (training) B(i) once, after F(i)."""
    if len(actions) != p:
        raise ScheduleError(f"schedule has {len(actions)} stages, expected {p}")
    for s, acts in enumerate(actions):
        seen: dict = {}
        for j, a in enumerate(acts):
            if a.kind not in ("F", "B"):
                raise ScheduleError(f"stage {s}: unknown action kind {a.kind!r}")
            if not 0 <= a.mb < m:
                raise ScheduleError(f"stage {s}, action {j} ({a}): micro-batch {a.mb} is outside "
                                    f"0..{m - 1} (chunks={m})")
            if a in seen:
                raise ScheduleError(f"stage {s} runs {a} twice (actions {seen[a]} and {j})")
            if a.kind == "B" and Action("F", a.mb) not in seen:
                raise ScheduleError(f"stage {s} runs {a} (action {j}) before F{a.mb}")
            seen[a] = j
        want = {Action("F", i) for i in range(m)}
        if training:
            want |= {Action("B", i) for i in range(m)}
        missing = sorted(want - set(seen))
        if missing:
            raise ScheduleError(f"stage {s} never runs {', '.join(map(str, missing[:8]))}"
                                + (" ..." if len(missing) > 8 else ""))
        if not training and any(a.kind == "B" for a in seen):
            raise ScheduleError(f"stage {s}: a forward-only schedule has backward actions")


@dataclass
class ScheduleReport:
    """What `simulate` found: per-stage busy time, the makespan, the bubble (idle fraction of the
    stages' time), peak micro-batches held between F and B, and the timed action list."""
    p: int
    m: int
    makespan: float
    busy: list
    peak_in_flight: list
    timeline: list = field(default_factory=list)   # (stage, Action, start, end)

    @property
    def bubble(self) -> float:
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.p * self.makespan)

    @property
    def formula(self) -> float:
        return bubble_formula(self.p, self.m)

    def render(self, width: int = 120) -> str:
        """A text Gantt chart, one row per stage: forward of micro-batch i is drawn with the
        digit i % 10, its backward with the letter 'abcdefghij'[i % 10], idle time with '.'."""
        if not self.timeline or self.makespan <= 0:
            return ""
        unit = min((e - s for _, _, s, e in self.timeline if e > s), default=1.0)
        scale = min(1.0, width / max(1.0, self.makespan / unit))
        cols = max(1, int(round(self.makespan / unit * scale)))
        rows = [["."] * cols for _ in range(self.p)]
        for s, a, start, end in self.timeline:
            c0 = int(round(start / unit * scale))
            c1 = max(c0 + 1, int(round(end / unit * scale)))
            ch = str(a.mb % 10) if a.kind == "F" else "abcdefghij"[a.mb % 10]
            for c in range(c0, min(c1, cols)):
                rows[s][c] = ch
        return "\n".join(f"stage {s}: {''.join(r)}" for s, r in enumerate(rows))

    def __str__(self) -> str:
        return (f"{self.p} stages x {self.m} micro-batches: makespan {self.makespan:g}, bubble "
                f"{self.bubble:.1%} (formula (p-1)/(m+p-1) = {self.formula:.1%}), peak "
                f"micro-batches in flight per stage {self.peak_in_flight}")


def _per_stage(v, p: int, what: str) -> list[float]:
    if isinstance(v, (int, float)):
        return [float(v)] * p
    vals = [float(x) for x in v]
    if len(vals) != p:
        raise ValueError(f"{what} needs one value per stage ({p}), got {len(vals)}")
    return vals


def simulate(actions: Sequence[Sequence[Action]], m: int, edges: Iterable[tuple[int, int]],
             t_f=1.0, t_b=2.0, training: bool = True) -> ScheduleReport:
    """Replay the schedule with sends that never block and receives that wait for their
    message, with forward/backward taking `t_f`/`t_b` (scalars or one per stage). Raises
    ScheduleError naming the stuck stages and their messages if it cannot complete."""
    p = len(actions)
    validate(actions, p, m, training)
    edges = sorted(set(edges))
    tf, tb = _per_stage(t_f, p, "t_f"), _per_stage(t_b, p, "t_b")
    programs = [lower(actions[s], s, edges) for s in range(p)]
    sent = {}
    for s, prog in enumerate(programs):
        for op in prog:
            if op[0] == "send":
                sent[op[1]] = s
    for s, prog in enumerate(programs):
        for op in prog:
            if op[0] == "recv" and op[1] not in sent:
                raise ScheduleError(f"stage {s} waits for {op[1].describe()}, which no stage "
                                    f"sends")
    pc = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    avail: dict = {}
    in_flight = [0] * p
    peak = [0] * p
    timeline = []
    progress = True
    while progress:
        progress = False
        for s in range(p):
            prog = programs[s]
            while pc[s] < len(prog):
                kind, what = prog[pc[s]]
                if kind == "recv":
                    if what not in avail:
                        break
                    clock[s] = max(clock[s], avail[what])
                elif kind == "send":
                    avail[what] = clock[s]
                else:
                    d = tf[s] if what.kind == "F" else tb[s]
                    timeline.append((s, what, clock[s], clock[s] + d))
                    clock[s] += d
                    busy[s] += d
                    if what.kind == "F" and training:
                        in_flight[s] += 1
                        peak[s] = max(peak[s], in_flight[s])
                    elif what.kind == "B":
                        in_flight[s] -= 1
                pc[s] += 1
                progress = True
    stuck = [s for s in range(p) if pc[s] < len(programs[s])]
    if stuck:
        lines = []
        for s in stuck:
            msg = programs[s][pc[s]][1]
            sender = msg.src
            where = "has finished" if pc[sender] >= len(programs[sender]) else \
                f"is itself waiting for {programs[sender][pc[sender]][1].describe()}"
            done = sum(1 for op in programs[s][:pc[s]] if op[0] == "compute")
            lines.append(f"  stage {s} (after {done} of {len(actions[s])} actions) waits for "
                         f"{msg.describe()}; stage {sender} {where}")
        raise ScheduleError("the schedule would deadlock:\n" + "\n".join(lines))
    return ScheduleReport(p, m, max(clock), busy, peak, timeline)


def check(schedule, p: int, m: int, edges: Optional[Iterable[tuple[int, int]]] = None,
          t_f=1.0, t_b=2.0, training: bool = True) -> ScheduleReport:
    """Build (if named), validate and simulate a schedule on a chain of p stages plus `edges`."""
    acts = build(schedule, p, m) if training else forward_only(p, m)
    chain = {(s, s + 1) for s in range(p - 1)}
    return simulate(acts, m, chain | set(edges or ()), t_f, t_b, training)
