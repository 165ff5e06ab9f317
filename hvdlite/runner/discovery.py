"""Where the elastic driver learns which hosts exist, and which ones it does not trust now.

`HostDiscoveryScript` runs the user's `--host-discovery-script` (through the shell, like
horovodrun) and parses one `host[:slots]` (or `host slots=N`) per line; `FixedHosts` serves a
fixed `-H`/`--hostfile` list. `Blacklist` keeps failing hosts out, for a cooldown that doubles
with each failure within `--blacklist-cooldown-range MIN MAX`, or for good without a range.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from collections import OrderedDict
from typing import Optional, Sequence

from hvdlite.runner.hosts import HostError, HostSpec, _host_and_slots

DEFAULT_INTERVAL_S = 1.0


class DiscoveryError(RuntimeError):
    """The discovery script failed or printed something that is not a host list."""


def parse_host_lines(text: str, source: str, default_slots: int) -> "OrderedDict[str, int]":
    hosts: "OrderedDict[str, int]" = OrderedDict()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {lineno}"
        m = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\S+)", line)
        try:
            if m:
                if not m.group(2).isdigit() or int(m.group(2)) < 1:
                    raise HostError(f"{where}: slots must be a positive integer, got {line!r}")
                spec = _host_and_slots(f"{m.group(1)}:{m.group(2)}", where)
            elif len(line.split()) == 1:
                if re.fullmatch(r"(\[[^\]]+\]|[^:\[\]]+):(\S+)", line):
                    spec = _host_and_slots(line, where)
                else:  # no slots given: --slots-per-host (default 1)
                    try:
                        name = _host_and_slots(line + ":1", where).name
                    except HostError:
                        raise HostError(f"{where}: bad host name {line!r} (expected "
                                        f"'host[:slots]'; IPv6 addresses as [addr])") from None
                    spec = HostSpec(name, default_slots)
            else:
                raise HostError(f"{where}: expected 'host[:slots]', got {line!r}")
        except HostError as exc:
            raise DiscoveryError(str(exc)) from None
        if spec.name in hosts:
            raise DiscoveryError(f"{where}: host {spec.name!r} is listed more than once")
        hosts[spec.name] = spec.slots
    return hosts


class HostDiscoveryScript:
    """Runs `--host-discovery-script` and parses its output."""

    fixed = False      # the hosts may change at every call

    def __init__(self, command: str, default_slots: Optional[int], timeout_s: float) -> None:
        self.command = command
        self.default_slots = default_slots or 1
        self.timeout_s = timeout_s

    def describe(self) -> str:
        return f"host discovery script {self.command!r}"

    def find(self) -> "OrderedDict[str, int]":
        try:
            proc = subprocess.Popen(self.command, shell=True, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:
            raise DiscoveryError(f"{self.describe()} cannot be run: {exc.strerror}") from None
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.communicate()
            raise DiscoveryError(f"{self.describe()} did not finish within "
                                 f"{self.timeout_s:.0f} s") from None
        if proc.returncode != 0:
            lines = [ln.strip() for ln in err.decode(errors="replace").splitlines() if ln.strip()]
            detail = f": {lines[-1]}" if lines else ""
            raise DiscoveryError(f"{self.describe()} failed with exit code "
                                 f"{proc.returncode}{detail}")
        return parse_host_lines(out.decode(errors="replace"), self.describe(),
                                self.default_slots)


class FixedHosts:
    """`-H`/`--hostfile` in elastic mode (`--min-np`/`--max-np` without a discovery script)."""

    fixed = True       # never a host more: only a blacklist cooldown gives slots back

    def __init__(self, hosts: Sequence[HostSpec]) -> None:
        self.hosts: "OrderedDict[str, int]" = OrderedDict((h.name, h.slots) for h in hosts)

    def describe(self) -> str:
        return "the host list"

    def find(self) -> "OrderedDict[str, int]":
        return OrderedDict(self.hosts)


class Blacklist:
    """Hosts whose workers failed. Without a cooldown range they stay out for good."""

    def __init__(self, cooldown_range: Optional[Sequence[int]] = None) -> None:
        self.cooldown_range = tuple(cooldown_range) if cooldown_range else None
        self.until: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def add(self, host: str, now: Optional[float] = None) -> Optional[float]:
        """Blacklist `host`; returns the cooldown in seconds (None: for the rest of the job)."""
        now = time.monotonic() if now is None else now
        self.count[host] = self.count.get(host, 0) + 1
        if self.cooldown_range is None:
            self.until[host] = float("inf")
            return None
        low, high = self.cooldown_range
        delay = low * (2 ** (self.count[host] - 1)) * random.uniform(1.0, 1.25)
        delay = max(float(low), min(float(high), delay))
        self.until[host] = max(self.until.get(host, 0.0), now + delay)
        return delay

    def returns(self) -> bool:
        """Whether a blacklisted host will come back (a cooldown is running out)."""
        return any(t != float("inf") for t in self.until.values())

    def is_blacklisted(self, host: str, now: Optional[float] = None) -> bool:
        now = time.monotonic() if now is None else now
        return self.until.get(host, 0.0) > now

    def expired(self, now: Optional[float] = None) -> list[str]:
        """Hosts whose cooldown has ended (each reported once)."""
        now = time.monotonic() if now is None else now
        back = [h for h, t in self.until.items() if t <= now]
        for h in back:
            del self.until[h]
        return back
