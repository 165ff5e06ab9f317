"""hvdlite-run across hosts: a private sshd on 127.0.0.2/127.0.0.3 plays the remote hosts.

127.0.0.1, localhost and this machine's own names/addresses are local (started without ssh);
every other address, 127.0.0.2 and 127.0.0.3 included, is a remote host reached through the
real ssh client and the real sshd started here, so the whole remote path runs: ssh options,
the stdin bootstrap, remote environment, output forwarding, exit status, remote cleanup.

The sshd comes from Debian's openssh-server (`apt-get install -y openssh-server`, done by
.ci/run). Without it these tests skip, unless HVDLITE_REQUIRE_SSHD=1 makes that a failure.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from util import clean_env, env_reports, free_port

ROOT = Path(__file__).resolve().parent.parent
HVDLITE_RUN = str(Path(sys.executable).parent / "hvdlite-run")
SCRIPTS = Path(__file__).parent / "launcher_scripts"
WORKERS = Path(__file__).parent / "workers"
PY = sys.executable
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
REMOTE_A, REMOTE_B = "127.0.0.2", "127.0.0.3"


def _skip_or_fail(reason: str):
    if os.environ.get("HVDLITE_REQUIRE_SSHD") == "1":
        pytest.fail(f"{reason} (HVDLITE_REQUIRE_SSHD=1)")
    pytest.skip(f"{reason}; install it with `apt-get install -y openssh-server`, or set "
                f"HVDLITE_REQUIRE_SSHD=1 to make this a failure")


class Sshd:
    def __init__(self, root: Path, port: int, key: Path, proc: subprocess.Popen):
        self.root, self.port, self.key, self.proc = root, port, key, proc

    def env(self) -> dict[str, str]:
        """Environment for hvdlite-run: known_hosts in the temp dir, not ~/.ssh."""
        return {"HVDLITE_SSH_ARGS": f"-o UserKnownHostsFile={self.root / 'known_hosts'}"}

    def flags(self) -> list[str]:
        return ["-p", str(self.port), "-i", str(self.key)]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    if SSHD is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        _skip_or_fail("openssh-server (sshd) is not installed")
    root = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)],
                       check=True)
    (root / "authorized_keys").write_text((root / "user_key.pub").read_text())
    os.chmod(root / "authorized_keys", 0o600)
    port = free_port()
    (root / "sshd_config").write_text(f"""\
Port {port}
ListenAddress {REMOTE_A}
ListenAddress {REMOTE_B}
HostKey {root / 'host_key'}
AuthorizedKeysFile {root / 'authorized_keys'}
PidFile {root / 'sshd.pid'}
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
MaxStartups 100:30:200
MaxSessions 100
""")
    try:
        os.makedirs("/run/sshd", exist_ok=True)  # privilege separation directory
    except OSError:
        pass
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(root / "sshd_config")],
                            stdout=subprocess.DEVNULL, stderr=open(root / "sshd.log", "w"))
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection((REMOTE_A, port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log = (root / "sshd.log").read_text()
                _skip_or_fail(f"the private sshd did not start: {log.strip()[-500:]}")
            time.sleep(0.1)
    server = Sshd(root, port, root / "user_key", proc)
    # One real login first, so that a broken set-up fails here with ssh's own words.
    out = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                          "-o", f"UserKnownHostsFile={root / 'known_hosts'}", "-o",
                          "LogLevel=ERROR", "-p", str(port), "-i", str(server.key), REMOTE_A,
                          "true"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        proc.kill()
        _skip_or_fail(f"cannot log in to the private sshd: {out.stderr.strip()}")
    yield server
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = clean_env()
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["HVDLITE_START_TIMEOUT"] = "60"
    env.update(extra or {})
    return env


def launch(*args: object, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([HVDLITE_RUN, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=_env(env))


def processes_mentioning(marker: str) -> list[psutil.Process]:
    """Live processes whose command line or environment contains `marker` (ours only)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            text = " ".join(proc.info["cmdline"] or [])
            if marker in text or marker in " ".join(proc.environ().values()):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def wait_gone(marker: str, timeout: float = 15.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        left = processes_mentioning(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# --------------------------------------------------------------------------- static jobs

@pytest.mark.timeout(120)
def test_two_hosts_over_ssh_coordinates_and_store(sshd):
    """One local host and one remote host: each rank learns its coordinates from the driver
    and reaches the driver's store from its host."""
    out = launch("-np", "4", "-H", f"localhost:2,{REMOTE_A}:2", *sshd.flags(), PY,
                 SCRIPTS / "env_dump.py", "store", env=sshd.env())
    assert out.returncode == 0, out.stderr
    reports = env_reports(out.stdout)
    assert sorted(reports) == [0, 1, 2, 3]
    expect = {0: ("localhost", 0, 0), 1: ("localhost", 1, 0), 2: (REMOTE_A, 0, 1),
              3: (REMOTE_A, 1, 1)}
    for rank, (host, local_rank, cross_rank) in expect.items():
        env = reports[rank]
        assert env["HOROVOD_HOSTNAME"] == env["HVDLITE_HOSTNAME"] == host
        assert env["HOROVOD_RANK"] == str(rank) and env["HOROVOD_SIZE"] == "4"
        assert env["HOROVOD_LOCAL_RANK"] == str(local_rank)
        assert env["HOROVOD_LOCAL_SIZE"] == "2"
        assert env["HOROVOD_CROSS_RANK"] == str(cross_rank) and env["HOROVOD_CROSS_SIZE"] == "2"
        assert env["peer_value"] == f"hello from {(rank + 1) % 4}"
    assert reports[0]["HVDLITE_SECRET"] == reports[3]["HVDLITE_SECRET"]


@pytest.mark.timeout(150)
def test_training_across_two_remote_hosts_matches_single_process(sshd, tmp_path):
    """A real training job with one rank on each of two remote hosts (both over ssh), using
    collectives, gradient allreduce and per-rank output files; while it runs, no command line
    on the machine holds the job secret."""
    marks = tmp_path / "marks"
    marks.mkdir()
    outdir = tmp_path / "out"
    proc = subprocess.Popen(
        [HVDLITE_RUN, "-np", "2", "-H", f"{REMOTE_A}:1,{REMOTE_B}:1", *sshd.flags(),
         "--output-filename", str(outdir), PY, str(WORKERS / "elastic_train.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env({**sshd.env(), "ELASTIC_TOTAL_STEPS": "20", "ELASTIC_STEP_DELAY": "0.1",
                  "ELASTIC_MARK_DIR": str(marks)}))
    secret = None
    deadline = time.monotonic() + 90
    while secret is None and time.monotonic() < deadline and proc.poll() is None:
        for p in marks.glob("pid.*"):
            try:
                secret = psutil.Process(int(p.read_text())).environ().get("HVDLITE_SECRET")
            except (psutil.Error, ValueError):
                pass
        time.sleep(0.1)
    assert secret and re.fullmatch(r"[0-9a-f]{64}", secret)
    for p in psutil.process_iter(["cmdline"]):
        try:
            assert secret not in " ".join(p.info["cmdline"] or []), p.info["cmdline"]
        except psutil.Error:
            pass
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    result = json.loads(stdout.split("[0]<stdout>:RESULT ", 1)[1].splitlines()[0])
    sys.path.insert(0, str(WORKERS))
    try:
        import elastic_train
    finally:
        sys.path.remove(str(WORKERS))
    assert result["size"] == 2 and result["step"] == 20
    assert result["params"] == elastic_train.reference(20)
    assert "RESULT" in (outdir / "rank.0" / "stdout").read_text()
    assert (outdir / "rank.1" / "stdout").exists()


@pytest.mark.timeout(90)
def test_remote_command_not_found_names_the_host(sshd):
    out = launch("-np", "2", "-H", f"localhost:1,{REMOTE_A}:1", *sshd.flags(),
                 "--start-timeout", "20", "sh", "-c", "exit 0", env=sshd.env())
    assert out.returncode == 0, out.stderr
    out = launch("-np", "1", "-H", f"{REMOTE_A}:1", *sshd.flags(),
                 "no-such-command-hvdlite", env=sshd.env())
    assert out.returncode == 127, out.stderr
    assert f"host {REMOTE_A}: command 'no-such-command-hvdlite' not found" in out.stderr


@pytest.mark.timeout(90)
def test_wrong_ssh_port_and_unreachable_host(sshd):
    closed = free_port()
    start = time.monotonic()
    out = launch("-np", "2", "-H", f"localhost:1,{REMOTE_A}:1", "-p", closed, "-i", sshd.key,
                 "--start-timeout", "10", "true", env=sshd.env())
    assert out.returncode == 2, out.stderr
    assert f"hvdlite-run: cannot reach host {REMOTE_A} over ssh port {closed}:" in out.stderr
    assert "Connection refused" in out.stderr
    assert time.monotonic() - start < 20
    # 192.0.2.1 (TEST-NET-1) never answers: the check gives up after --start-timeout.
    start = time.monotonic()
    out = launch("-np", "1", "-H", "192.0.2.1:1", "--start-timeout", "3", "true",
                 env=sshd.env(), timeout=60)
    assert out.returncode == 2, out.stderr
    assert "hvdlite-run: cannot reach host 192.0.2.1 over ssh" in out.stderr
    assert time.monotonic() - start < 3 + 15


@pytest.mark.timeout(120)
def test_failing_remote_rank_stops_everything_everywhere(sshd, tmp_path):
    """A remote rank fails: the job stops with its exit code, and neither the local ranks nor
    the other remote ranks (nor their children) are left running on any host."""
    marker = f"hvdlite-orphan-check-{os.getpid()}-{time.monotonic_ns()}"
    out = launch("-np", "3", "-H", f"localhost:1,{REMOTE_A}:1,{REMOTE_B}:1", *sshd.flags(), PY,
                 SCRIPTS / "fail.py", "2", "3", marker,
                 env={**sshd.env(), "HVDLITE_TEST_MARKER": marker}, timeout=90)
    assert out.returncode == 3, out.stderr
    assert f"rank 2 (host {REMOTE_B}) exited with code 3" in out.stderr
    assert wait_gone(marker) == []


@pytest.mark.timeout(120)
def test_sigint_stops_remote_ranks(sshd):
    marker = f"hvdlite-sigint-check-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen([HVDLITE_RUN, "-np", "2", "-H", f"{REMOTE_A}:1,{REMOTE_B}:1",
                             *sshd.flags(), PY, str(SCRIPTS / "hang.py"), marker],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env({**sshd.env(), "HVDLITE_TEST_MARKER": marker}))
    try:
        deadline = time.monotonic() + 60
        while len([p for p in processes_mentioning(marker)
                   if "hang.py" in " ".join(p.info["cmdline"] or [])]) < 2:
            assert time.monotonic() < deadline, "remote ranks did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=40) == 130
        assert wait_gone(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(120)
def test_run_api_across_hosts(sshd, monkeypatch):
    """`hvdlite.runner.run` starts the function on a local and a remote host and returns every
    rank's value."""
    from hvdlite.runner import run

    monkeypatch.setenv("HVDLITE_SSH_ARGS", sshd.env()["HVDLITE_SSH_ARGS"])

    def work(x):
        import os

        import torch

        import hvdlite.torch as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + x)]), op=hvd.Sum).item()
        return hvd.rank(), os.environ["HVDLITE_HOSTNAME"], hvd.local_rank(), hvd.cross_rank(), total

    got = run(work, args=(10,), np=2, hosts=f"localhost:1,{REMOTE_A}:1", ssh_port=sshd.port,
              ssh_identity_file=str(sshd.key), start_timeout=60)
    assert got == [(0, "localhost", 0, 0, 21.0), (1, REMOTE_A, 0, 1, 21.0)]


# --------------------------------------------------------------------------- elastic over ssh

@pytest.mark.timeout(180)
def test_elastic_remote_worker_killed(sshd, tmp_path):
    """An elastic job on a local and a remote host: the remote worker is SIGKILLed, its host is
    blacklisted for good (no cooldown range), the local worker goes on from its last commit, and
    nothing is left running on the remote host."""
    from test_elastic import ElasticJob, check_exact, worker_env

    total = 24
    job = ElasticJob(tmp_path, ["localhost:1", f"{REMOTE_A}:1"],
                     ["-np", "2", "--min-np", "1", "--max-np", "2", *sshd.flags()],
                     env={**sshd.env(), **worker_env(total)})
    try:
        job.wait_progress(f"{REMOTE_A}:0", 6, size=2)
        os.kill(job.pid(f"{REMOTE_A}:0"), signal.SIGKILL)
        job.wait_for_line(rf"worker {REMOTE_A}:0 \(host {REMOTE_A}, rank 1\) was killed by signal "
                          rf"SIGKILL on its host; blacklisting host {REMOTE_A} for the rest of "
                          rf"the job")
        job.wait_for_line(r"reset 1: round 2 with 1 workers: localhost:0=0")
        assert job.finish() == 0, job.err_text()
        result = job.result()
        check_exact(result, total)
        assert result["size"] == 1
        assert job.leftovers() == []
    finally:
        job.kill()
