"""A real SLURM cluster on this machine for the tests: munged, slurmctld and one or two slurmd.

Debian's slurm-wlm and munge, each daemon with its own files under a temporary directory and its
own ports, so the cluster neither reads nor disturbs a system SLURM. `nodes=2` declares two nodes
that share this machine (distinct NodeName and slurmd port, the same NodeHostname), so `srun -N2`
places tasks on two SLURM nodes while they run here. Daemons are started as root (slurmd must be)
and stopped by their PIDs.

Use: `with SlurmCluster(tmp, nodes=2) as cluster: cluster.run(["srun", ...])`. `available()`
says why a test must skip; HVDLITE_REQUIRE_SLURM=1 turns that skip into a failure (.ci/run).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Self

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin")
CPUS_PER_NODE = 2


def _find(name: str) -> str | None:
    for d in SBIN:
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    return shutil.which(name)


def available() -> str | None:
    """None when a SLURM cluster can be started here, else why not."""
    missing = [n for n in (*DAEMONS, "srun", "salloc", "scontrol", "squeue") if _find(n) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing: apt-get install " \
               f"slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start tasks"
    return None


def require() -> None:
    """Skip (or, under HVDLITE_REQUIRE_SLURM=1, fail) where no cluster can be started."""
    why = available()
    if why is None:
        return
    if os.environ.get("HVDLITE_REQUIRE_SLURM") == "1":
        pytest.fail(f"HVDLITE_REQUIRE_SLURM=1 but {why}")
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """munged + slurmctld + `nodes` slurmd, 2 CPUs per node, torn down by PID on exit."""

    def __init__(self, workdir: Path, nodes: int = 1):
        self.dir = Path(workdir)
        self.nodes = [f"hvd{i + 1}" for i in range(nodes)]
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge.sock"
        self.pids: list[int] = []
        self.procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment a user's shell on this cluster has (SLURM_CONF names our config)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        for name in list(env):   # the caller's own job, if any, is not this cluster's
            if name.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")) and \
                    name != "SLURM_CONF":
                env.pop(name)
        return env

    def _write_config(self) -> None:
        ctld_port, slurmd_ports = _free_port(), [_free_port() for _ in self.nodes]
        (self.dir / "state").mkdir(exist_ok=True)
        lines = [
            "ClusterName=hvdlite",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={self.dir / 'state'}",
            f"SlurmdSpoolDir={self.dir}/spool-%n",
            f"SlurmctldPidFile={self.dir}/slurmctld.pid",
            f"SlurmdPidFile={self.dir}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.dir}/slurmctld.log",
            f"SlurmdLogFile={self.dir}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "KillWait=3", "InactiveLimit=0", "MinJobAge=5",
            "SlurmdTimeout=30", "SlurmctldTimeout=30", "MessageTimeout=20",
            # Two nodes on a 2-core machine: the config, not the hardware, says what a node has.
            "SlurmdParameters=config_overrides",
        ]
        for name, port in zip(self.nodes, slurmd_ports):
            lines.append(f"NodeName={name} NodeHostname={self.host} NodeAddr=127.0.0.1 "
                         f"Port={port} CPUs={CPUS_PER_NODE} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")

    def _start(self, argv: list[str], name: str) -> None:
        with open(self.dir / f"{name}.out", "w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True)
        self.procs.append(proc)

    def start(self) -> Self:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self._start([_find("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                     f"--key-file={key}", f"--pid-file={self.dir}/munged.pid",
                     f"--log-file={self.dir}/munged.log", f"--seed-file={self.dir}/munged.seed"],
                    "munged")
        self._wait(lambda: self.munge_socket.exists(), "munged's socket")
        self._start([_find("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for name in self.nodes:
            self._start([_find("slurmd"), "-D", "-N", name, "-f", str(self.conf)],
                        f"slurmd-{name}")
        self._wait(self._nodes_idle, "every node idle in sinfo")
        return self

    def _nodes_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True,
                             text=True, env=self.env, timeout=20, check=False).stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        return all(states.get(n, "").startswith("idle") for n in self.nodes)

    def _wait(self, ready, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited {p.returncode} while waiting for "
                                       f"{what}:\n{self.logs()}")
            try:
                if ready():
                    return
            except (subprocess.SubprocessError, ValueError, OSError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for path in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            text = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def run(self, argv: list[str], timeout: float = 120, env: dict | None = None,
            **kwargs) -> subprocess.CompletedProcess:
        full = self.env
        full.update(env or {})
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full, check=False,
                              **kwargs)

    def jobs(self) -> list[str]:
        """Jobs slurmctld still knows as pending or running."""
        out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True,
                             env=self.env, timeout=20, check=False).stdout
        return [line for line in out.splitlines() if line.strip()]

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True,
                       timeout=20, check=False)
        for proc in reversed(self.procs):   # slurmd, slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        self.procs.clear()

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
