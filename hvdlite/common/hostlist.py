"""SLURM's compressed host lists (`node[01-03,7],gpu-[1-2]-ib`) and task counts (`2(x3),1`).

Expanded as `scontrol show hostnames` does, in Python, so that a rank finds the job's first node
without calling scontrol, and the launcher reads an allocation without it. Standard library only:
the launcher imports it.
"""
from __future__ import annotations

import re


class HostlistError(ValueError):
    """A host list or count list SLURM would not have written; the message quotes it."""


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in host list {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"unbalanced '[' in host list {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _range(part: str, whole: str) -> list[str]:
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
    if not m:
        raise HostlistError(f"bad range {part!r} in host list {whole!r}")
    low, high = m.group(1), m.group(2)
    if high is None:
        return [low]
    if int(high) < int(low):
        raise HostlistError(f"range {part!r} runs backwards in host list {whole!r}")
    width = len(low) if low.startswith("0") else 0   # node[08-10]: node08 node09 node10
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def _expand_one(item: str, whole: str) -> list[str]:
    """One host expression: every bracket group multiplies, left to right."""
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise HostlistError(f"unbalanced ']' in host list {whole!r}")
        return [item]
    close_at = item.find("]", open_at)
    if close_at < 0:
        raise HostlistError(f"unbalanced '[' in host list {whole!r}")
    prefix, body, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    values = [v for part in body.split(",") for v in _range(part, whole)]
    tails = _expand_one(rest, whole)
    return [prefix + v + tail for v in values for tail in tails]


def expand_hostlist(text: str) -> list[str]:
    """`scontrol show hostnames TEXT`: each host once per mention, in SLURM's order."""
    hosts = [h for item in _split_top(text or "") for h in _expand_one(item, text)]
    if not hosts:
        raise HostlistError(f"empty host list {text!r}")
    return hosts


def expand_counts(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE / SLURM_JOB_CPUS_PER_NODE (`2(x3),1`): one count per node."""
    counts: list[int] = []
    for item in (text or "").split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise HostlistError(f"bad count {item!r} in {text!r} (expected N or N(xM))")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts
