"""A real cluster on this machine: hosts in network namespaces, joined by a bridge.

Each host is a network namespace with its own `eth0` (a veth whose other end is on a bridge in a
"switch" namespace of its own, so the machine's own network stack is never touched), its own host
name, IPC namespace and private `/dev/shm` (`unshare --uts --ipc --mount` inside
`ip netns exec`), its own `/etc/hosts` naming every host of the cluster, and its own sshd
(Debian's openssh-server, the private set-up tests/test_multihost.py uses). The file system is
shared, as an NFS home is. A login host, one more namespace of the same kind, runs `hvdlite-run`;
the ranks start on the worker hosts over real ssh.

Links: `partition(host)` takes the switch end of a host's veth down (its processes live on, its
peers see only silence: no RST, no exit), `heal(host)` brings it up; `cut(a, b)` makes the pair
unreachable from each other only (each routes the other through a gateway that does not exist,
so packets are dropped as on a dead path: this kernel has neither `netem` nor tc filters);
`rate(host, "1gbit")` shapes both directions of a host's link with `tbf`.

Addresses are in 198.18.0.0/15 (set aside for benchmarks) only: eth0 198.18.0.0/24, the second
interface (nics=2) 198.19.0.0/24. Names start with `hvdlt-<pid>-`: at start, whatever a dead
process of this module left is swept away (namespaces, and every process inside them), and an
atexit hook plus the fixture's finalizer tear down this process's own, pass or fail.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and sshd. Without them `require()` skips with the
reason; HVDLITE_REQUIRE_NETNS=1 turns that into a failure (set by .ci/run).
"""
from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "hvdlt-"
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
HVDLITE_RUN = str(Path(sys.executable).parent / "hvdlite-run")
SUBNETS = ("198.18.0", "198.19.0")     # eth0, eth1: both inside 198.18.0.0/15
LOGIN_OCTET, FIRST_NODE_OCTET, DEAD_GATEWAY_OCTET = 2, 11, 254
RATES = {"1gbit": "256kb", "10gbit": "2mb", "100mbit": "64kb"}   # rate -> tbf burst
_counter = itertools.count()
_live: list[Cluster] = []


class ClusterUnavailable(RuntimeError):
    """This machine cannot build the cluster (not root, no namespaces, no sshd)."""


def _run(*cmd: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), check=False, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _batch(lines: Sequence[str], netns: str | None = None) -> None:
    """Many `ip` commands in one process (`ip -batch`): set-up stays well under a second."""
    cmd = ["ip"] + (["-n", netns] if netns else []) + ["-batch", "-"]
    out = subprocess.run(cmd, check=False, input="\n".join(lines) + "\n", capture_output=True, text=True,
                         timeout=20)
    if out.returncode != 0:
        raise RuntimeError(f"ip -batch failed: {out.stderr.strip()}\n" + "\n".join(lines))


def namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    """Every process in `ns` (SIGKILL, by PID), then the namespace itself."""
    for _ in range(20):
        pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    _run("ip", "netns", "delete", ns, check=False)


def sweep_stale() -> list[str]:
    """Remove namespaces (and their processes) left by a dead process of this module."""
    removed = []
    for ns in namespaces():
        if not ns.startswith(PREFIX):
            continue
        try:
            owner = int(ns[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if owner != os.getpid() and not _pid_alive(owner):
            _kill_namespace(ns)
            removed.append(ns)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def require() -> None:
    """Raise ClusterUnavailable with the reason when this machine cannot build a cluster."""
    if sys.platform != "linux":
        raise ClusterUnavailable("network namespaces need Linux")
    for tool in ("ip", "tc", "unshare", "nsenter", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"`{tool}` is not installed")
    if SSHD is None:
        raise ClusterUnavailable("openssh-server (sshd) is not installed")
    if os.geteuid() != 0:
        raise ClusterUnavailable("making network namespaces needs root")
    probe = f"{PREFIX}{os.getpid()}-probe"
    out = _run("ip", "netns", "add", probe, check=False)
    if out.returncode != 0:
        raise ClusterUnavailable(f"cannot make a network namespace: {out.stderr.strip()}")
    _run("ip", "netns", "delete", probe, check=False)


@dataclass
class Host:
    name: str            # host name inside the namespace, and in every host's /etc/hosts
    ns: str              # network namespace
    port: str            # the switch end of its eth0 veth
    addrs: list[str]     # eth0 (and eth1) addresses
    holder: subprocess.Popen | None = None   # sshd: holds the UTS/IPC/mount namespaces
    shaped: list[str] = field(default_factory=list)

    @property
    def addr(self) -> str:
        return self.addrs[0]


class Cluster:
    """`n` worker hosts node1..nodeN and a login host, each with an sshd; see the module doc."""

    def __init__(self, n: int, nics: int = 1, workdir: Path | None = None) -> None:
        require()
        sweep_stale()
        self.tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="hvdlite-cluster-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.switch = f"{self.tag}-sw"
        self.nics = nics
        self.hosts: dict[str, Host] = {}
        self._closed = False
        _live.append(self)
        try:
            self._build(n)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ set-up
    def _build(self, n: int) -> None:
        names = ["login"] + [f"node{i}" for i in range(1, n + 1)]
        octets = [LOGIN_OCTET] + [FIRST_NODE_OCTET + i for i in range(n)]
        _run("ip", "netns", "add", self.switch)
        lines = [f"link add br{k} type bridge" for k in range(self.nics)]
        lines += [f"link set br{k} up" for k in range(self.nics)]
        _batch(lines, self.switch)
        root_lines = []
        for name, octet in zip(names, octets):
            ns = f"{self.tag}-{name}"
            _run("ip", "netns", "add", ns)
            host = Host(name, ns, f"{name}e0", [f"{SUBNETS[k]}.{octet}" for k in range(self.nics)])
            self.hosts[name] = host
            for k in range(self.nics):
                root_lines.append(f"link add eth{k} netns {ns} type veth peer name {name}e{k} "
                                  f"netns {self.switch}")
        _batch(root_lines)
        sw_lines = []
        for host in self.hosts.values():
            lines = ["link set lo up"]
            for k in range(self.nics):
                sw_lines += [f"link set {host.name}e{k} master br{k}", f"link set {host.name}e{k} up"]
                lines += [f"addr add {host.addrs[k]}/24 dev eth{k}", f"link set eth{k} up"]
            _batch(lines, host.ns)
        _batch(sw_lines, self.switch)
        self._keys()
        hosts_file = self.dir / "etc_hosts"
        hosts_file.write_text("127.0.0.1 localhost\n" + "".join(
            f"{h.addr} {h.name}\n" for h in self.hosts.values()))
        for host in self.hosts.values():
            self._start_sshd(host, hosts_file)
        deadline = time.monotonic() + 15
        for host in self.hosts.values():
            self._wait_port(host, deadline)

    def _keys(self) -> None:
        for name in ("host_key", "user_key"):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / name))
        (self.dir / "authorized_keys").write_text((self.dir / "user_key.pub").read_text())
        os.chmod(self.dir / "authorized_keys", 0o600)
        (self.dir / "sshd_config").write_text(f"""\
Port 22
HostKey {self.dir / 'host_key'}
AuthorizedKeysFile {self.dir / 'authorized_keys'}
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
UseDNS no
MaxStartups 100:30:200
MaxSessions 100
PidFile none
""")
        # Every host has the same host key, so one known_hosts line per name covers the cluster.
        key = (self.dir / "host_key.pub").read_text().split()
        (self.dir / "known_hosts").write_text("".join(
            f"{name} {key[0]} {key[1]}\n" for name in self._all_names()))
        os.makedirs("/run/sshd", exist_ok=True)   # sshd's privilege separation directory

    def _all_names(self) -> list[str]:
        names = []
        for h in self.hosts.values():
            names += [h.name, *h.addrs]
        return names

    def _start_sshd(self, host: Host, hosts_file: Path) -> None:
        # The sshd is the namespace holder: every session (so every rank) inherits its host name,
        # IPC namespace, /dev/shm and /etc/hosts.
        setup = (f"mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm && "
                 f"mount --bind {hosts_file} /etc/hosts && hostname {host.name} && "
                 f"exec {SSHD} -D -e -f {self.dir / 'sshd_config'}")
        with open(self.dir / f"sshd.{host.name}.log", "w") as log:
            host.holder = subprocess.Popen(
                ["ip", "netns", "exec", host.ns, "unshare", "--uts", "--ipc", "--mount",
                 "--propagation", "private", "sh", "-c", setup],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)

    def _wait_port(self, host: Host, deadline: float) -> None:
        while True:
            probe = subprocess.run(
                ["ip", "netns", "exec", host.ns, sys.executable, "-c",
                 "import socket;socket.create_connection(('127.0.0.1',22),1).close()"],
                check=False, capture_output=True)
            if probe.returncode == 0:
                return
            if host.holder.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / f"sshd.{host.name}.log").read_text()
                raise ClusterUnavailable(f"the sshd of {host.name} did not start: {log[-500:]}")
            time.sleep(0.05)

    # ------------------------------------------------------------------ running things
    @property
    def nodes(self) -> list[Host]:
        return [h for h in self.hosts.values() if h.name != "login"]

    def ssh_env(self) -> dict[str, str]:
        """What hvdlite-run needs to reach the hosts over ssh (known_hosts in the work dir)."""
        return {"HVDLITE_SSH_ARGS": f"-o UserKnownHostsFile={self.dir / 'known_hosts'} "
                                    f"-o StrictHostKeyChecking=yes"}

    def ssh_flags(self) -> list[str]:
        return ["-i", str(self.dir / "user_key")]

    def enter(self, host: str) -> list[str]:
        """Command prefix that runs a program inside `host` (all its namespaces)."""
        pid = self.hosts[host].holder.pid
        # -w: entering a mount namespace otherwise starts in its root directory.
        return ["nsenter", "-t", str(pid), "--net", "--uts", "--ipc", "--mount", f"-w{ROOT}"]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
        env.setdefault("HVDLITE_START_TIMEOUT", "60")
        env.update(self.ssh_env())
        env.update(extra or {})
        return env

    def popen(self, host: str, cmd: Sequence[str], env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        return subprocess.Popen([*self.enter(host), *map(str, cmd)], env=self.env(env),
                                cwd=str(ROOT), **kwargs)

    def run(self, host: str, cmd: Sequence[str], env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([*self.enter(host), *map(str, cmd)], env=self.env(env),
                                  cwd=str(ROOT), capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            def text(b):
                return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            raise AssertionError(f"{' '.join(map(str, cmd))} on {host} timed out after "
                                 f"{timeout} s\n--- stdout\n{text(exc.stdout)[-4000:]}\n"
                                 f"--- stderr\n{text(exc.stderr)[-4000:]}") from None

    def hvdlite_run(self, args: Sequence[object], env: dict[str, str] | None = None,
                    timeout: float = 120) -> subprocess.CompletedProcess:
        """`hvdlite-run args...` on the login host, ranks over ssh."""
        return self.run("login", [HVDLITE_RUN, *self.ssh_flags(), *map(str, args)], env,
                        timeout)

    def hosts_arg(self, slots: int, hosts: Sequence[str] | None = None) -> str:
        names = hosts or [h.name for h in self.nodes]
        return ",".join(f"{name}:{slots}" for name in names)

    # ------------------------------------------------------------------ links
    def partition(self, host: str) -> None:
        """Cut `host` off the network; its processes live on and hear nothing."""
        _run("ip", "-n", self.switch, "link", "set", self.hosts[host].port, "down")

    def heal(self, host: str) -> None:
        _run("ip", "-n", self.switch, "link", "set", self.hosts[host].port, "up")

    def cut(self, a: str, b: str) -> None:
        """Make `a` and `b` unable to reach each other (both ways); others still reach both."""
        for src, dst in ((a, b), (b, a)):
            for k, addr in enumerate(self.hosts[dst].addrs):
                gw = f"{SUBNETS[k]}.{DEAD_GATEWAY_OCTET}"
                _run("ip", "-n", self.hosts[src].ns, "route", "replace", f"{addr}/32", "via", gw,
                     "dev", f"eth{k}")
                _run("ip", "-n", self.hosts[src].ns, "neigh", "flush", "dev", f"eth{k}", "to",
                     addr, check=False)

    def uncut(self, a: str, b: str) -> None:
        for src, dst in ((a, b), (b, a)):
            for k, addr in enumerate(self.hosts[dst].addrs):
                _run("ip", "-n", self.hosts[src].ns, "route", "del", f"{addr}/32", check=False)

    def rate(self, host: str, rate: str, nic: int = 0) -> None:
        """Shape both directions of `host`'s link `eth<nic>` to `rate` (tbf)."""
        burst = RATES.get(rate, "256kb")
        h = self.hosts[host]
        for ns, dev in ((h.ns, f"eth{nic}"), (self.switch, f"{h.name}e{nic}")):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", burst, "latency", "50ms")

    def rate_all(self, rate: str) -> None:
        for h in self.hosts.values():
            for k in range(self.nics):
                self.rate(h.name, rate, k)

    def counters(self, host: str) -> dict[str, int]:
        """Bytes sent by `host` on each interface (eth0, eth1)."""
        out = {}
        for k in range(self.nics):
            path = f"/sys/class/net/eth{k}/statistics/tx_bytes"
            got = _run(*self.enter(host), "cat", path, check=False)
            out[f"eth{k}"] = int(got.stdout.strip() or 0)
        return out

    def processes(self, host: str) -> list[int]:
        """PIDs in `host`'s network namespace other than its sshd."""
        h = self.hosts[host]
        pids = [int(p) for p in _run("ip", "netns", "pids", h.ns, check=False).stdout.split()]
        holder = h.holder.pid if h.holder else -1
        return [p for p in pids if p != holder and _comm(p) != "sshd"]

    # ------------------------------------------------------------------ tear-down
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self.hosts.values():
            if h.holder is not None and h.holder.poll() is None:
                try:
                    os.killpg(h.holder.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for ns in [h.ns for h in self.hosts.values()] + [self.switch]:
            if ns in namespaces():
                _kill_namespace(ns)
        for h in self.hosts.values():
            if h.holder is not None:
                try:
                    h.holder.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self in _live:
            _live.remove(self)

    def leftovers(self) -> list[str]:
        """Namespaces of this cluster still present (none after close())."""
        return [ns for ns in namespaces() if ns.startswith(self.tag + "-")]

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@atexit.register
def _close_all() -> None:
    for cluster in _live:
        cluster.close()


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((host, port), timeout).close()
        return True
    except OSError:
        return False
