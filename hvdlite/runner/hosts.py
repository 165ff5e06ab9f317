"""Host lists (`-H a:2,b:4`, hostfiles), which of them are this machine, and rank placement.

Placement follows horovodrun: hosts in the order given, each filled with as many ranks as it has
slots before the next one is used, so a script's rank layout is the same under either launcher.
"""
from __future__ import annotations

import functools
import ipaddress
import re
import socket
import threading
from dataclasses import dataclass
from typing import Optional, Sequence


class HostError(ValueError):
    """A host list or hostfile that cannot be used; the message names the culprit."""


@dataclass(frozen=True)
class HostSpec:
    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


@dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its coordinates, as exported to the worker."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def _host_and_slots(text: str, where: str) -> HostSpec:
    name, sep, slots = text.strip().rpartition(":")
    if not sep:
        name, slots = text.strip(), "1"
    if not name or not re.fullmatch(r"[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.%A-Za-z]+\]", name):
        raise HostError(f"{where}: bad host name in {text.strip()!r} "
                        "(write IPv6 addresses as [addr]:slots)")
    if not slots.isdigit() or int(slots) < 1:
        raise HostError(f"{where}: slots must be a positive integer in {text.strip()!r}")
    return HostSpec(name.strip("[]"), int(slots))


def _check_unique(hosts: list[HostSpec], where: str) -> list[HostSpec]:
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise HostError(f"{where}: host {h.name!r} is listed more than once")
        seen.add(h.name)
    return hosts


def parse_hosts(text: str) -> list[HostSpec]:
    """Parse `-H host1:2,host2:4` (a bare host means one slot)."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise HostError("-H/--hosts: empty host list")
    return _check_unique([_host_and_slots(item, "-H/--hosts") for item in items], "-H/--hosts")


def parse_hostfile(path: str) -> list[HostSpec]:
    """Parse a hostfile: `host slots=N` (Open MPI's, and the MPI runtime's /etc/mpi/hostfile;
    a `max_slots=M` after it is Open MPI's oversubscription bound, not a slot count, and is
    ignored), `host:N` (horovodrun's, MPICH's) or `host` per line; `#` starts a comment."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise HostError(f"hostfile {path}: {e.strerror}") from None
    hosts: list[HostSpec] = []
    for lineno, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {path} line {lineno}"
        m = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\S+)(?:\s+max[-_]slots\s*=\s*\d+)?", line)
        if m:
            if not m.group(2).isdigit() or int(m.group(2)) < 1:
                raise HostError(f"{where}: slots must be a positive integer, got {line!r}")
            hosts.append(_host_and_slots(f"{m.group(1)}:{m.group(2)}", where))
        elif len(line.split()) == 1:
            hosts.append(_host_and_slots(line, where))
        else:
            raise HostError(f"{where}: expected '<host> slots=<n>' or '<host>:<n>', got {line!r}")
    if not hosts:
        raise HostError(f"hostfile {path}: no hosts listed")
    return _check_unique(hosts, f"hostfile {path}")


def total_slots(hosts: list[HostSpec]) -> int:
    return sum(h.slots for h in hosts)


@functools.lru_cache(maxsize=1)
def _local_names_and_ips() -> tuple[frozenset[str], frozenset[str]]:
    """This machine's names, and the addresses that count as this machine.

    Loopback addresses other than 127.0.0.1 and ::1 are deliberately *not* local: 127.0.0.2 and
    the like reach this machine through another address, as a separate host would (tests and
    demos use them as "remote" hosts served by an sshd listening there). The addresses the
    machine's own hostname resolves to (Debian maps it to 127.0.1.1) stay local.
    """
    names = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
    ips: set[str] = {"127.0.0.1", "::1"}
    own: list[str] = []
    try:
        own = [socket.gethostname().lower(), socket.getfqdn().lower()]
        names.update(own)
    except OSError:
        pass
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            for addr in addrs:
                if addr.family in (socket.AF_INET, socket.AF_INET6):
                    text = addr.address.split("%", 1)[0]
                    try:
                        if ipaddress.ip_address(text).is_loopback:
                            continue
                    except ValueError:
                        continue
                    ips.add(text)
    except Exception:  # psutil missing or unsupported platform: names and loopback still work
        pass
    for name in own:
        ips.update(_resolve(name))
    return frozenset(names), frozenset(ips)


def _resolve(name: str, timeout: float = 3.0) -> set[str]:
    """Addresses of `name`, bounded in time so a dead DNS server cannot stall the launcher."""
    result: set[str] = set()

    def lookup() -> None:
        try:
            for info in socket.getaddrinfo(name, None):
                result.add(str(info[4][0]).split("%", 1)[0])
        except (OSError, UnicodeError):
            pass

    t = threading.Thread(target=lookup, daemon=True)
    t.start()
    t.join(timeout)
    return set(result)


def _is_local_ip(text: str, local_ips: frozenset[str]) -> bool:
    try:
        return str(ipaddress.ip_address(text)) in local_ips
    except ValueError:
        return False


@functools.lru_cache(maxsize=256)
def is_local_host(name: str) -> bool:
    """True when `name` is this machine, started without ssh: localhost, 127.0.0.1, ::1, an
    address of a non-loopback interface, our hostname/FQDN, or a name that resolves only to
    those. Any other address (127.0.0.2 included) is a remote host, reached over ssh."""
    names, ips = _local_names_and_ips()
    lowered = name.lower()
    if lowered in names or _is_local_ip(lowered, ips):
        return True
    try:
        ipaddress.ip_address(lowered)
        return False  # a literal address that is not ours
    except ValueError:
        pass
    resolved = _resolve(name)
    return bool(resolved) and all(_is_local_ip(ip, ips) for ip in resolved)


def nic_address(nic: str) -> Optional[str]:
    """The IPv4 address of network interface `nic`, or None."""
    try:
        import psutil

        for addr in psutil.net_if_addrs().get(nic, []):
            if addr.family == socket.AF_INET:
                return addr.address
    except Exception:
        pass
    return None


def driver_address_for(host: str, nics: Optional[Sequence[str]] = None) -> str:
    """The address of this machine that workers on `host` should use to reach the driver:
    127.0.0.1 for local hosts, else the first of `nics` that has an IPv4 address, else the
    source address the kernel routes to `host` from."""
    if is_local_host(host):
        return "127.0.0.1"
    for nic in nics or ():
        address = nic_address(nic)
        if address:
            return address
    for target in sorted(_resolve(host)) or [host]:
        try:
            family = socket.AF_INET6 if ":" in target else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))
                return s.getsockname()[0]
        except OSError:
            continue
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def assign_slots(hosts: list[HostSpec], num_proc: int) -> list[SlotInfo]:
    """Rank placement: fill hosts in order; cross_rank is the host's index among the hosts that
    have a rank with the same local_rank (Horovod's definition)."""
    if num_proc > total_slots(hosts):
        raise HostError(too_few_slots_message(num_proc, hosts))
    per_host: list[tuple[str, int]] = []
    remaining = num_proc
    for h in hosts:
        if remaining <= 0:
            break
        n = min(h.slots, remaining)
        per_host.append((h.name, n))
        remaining -= n
    slots: list[SlotInfo] = []
    rank = 0
    for name, n in per_host:
        for local_rank in range(n):
            peers = [i for i, (_, m) in enumerate(per_host) if m > local_rank]
            host_index = [i for i, (hn, _) in enumerate(per_host) if hn == name][0]
            slots.append(SlotInfo(hostname=name, rank=rank, local_rank=local_rank,
                                  cross_rank=peers.index(host_index), size=num_proc,
                                  local_size=n, cross_size=len(peers)))
            rank += 1
    return slots


def too_few_slots_message(num_proc: int, hosts: list[HostSpec]) -> str:
    return (f"-np {num_proc} but the hosts give only {total_slots(hosts)} slots: "
            + ",".join(str(h) for h in hosts))
