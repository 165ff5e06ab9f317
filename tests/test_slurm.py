"""hvdlite on a real SLURM: munged, slurmctld and two slurmd on this machine (tests/slurm.py).

Jobs start the way users start them: `srun python train.py` with no launcher, `hvdlite-run`
inside `salloc`, and a job ended by SLURM (`scancel`) or by one task dying. Every check reads
what the ranks computed against the sums computed here.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import slurm
from util import HVDLITE_RUN, ROOT, WORKERS, clean_env

from hvdlite.common.hostlist import expand_hostlist

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    slurm.require()
    with slurm.SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2) as c:
        yield c


def _env(cluster) -> dict:
    env = clean_env({"SLURM_CONF": str(cluster.conf), "HVDLITE_START_TIMEOUT": "90",
                     "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    for name in list(env):
        if name.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")) and name != "SLURM_CONF":
            env.pop(name)
    return env


def _run(cluster, argv, timeout=180, env=None):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env={**_env(cluster), **(env or {})}, cwd=str(ROOT), check=False)
    return proc, proc.stdout + proc.stderr


def _launcher() -> list:
    return [HVDLITE_RUN] if os.path.exists(HVDLITE_RUN) else [sys.executable, "-m",
                                                              "hvdlite.runner"]


def _nothing_left(cluster, marker: str, timeout: float = 30) -> None:
    """No job in squeue and no process of this test's workers, within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        jobs = cluster.jobs()
        procs = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True,
                               check=False).stdout.split()
        if not jobs and not procs:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left running: jobs {jobs}, processes {procs}")
        time.sleep(0.5)


def test_hostlist_expansion_matches_scontrol(cluster):
    text = "hvd[1-2],gpu[08-11],rack[1-2]-n[01-02],login"
    out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True,
                         text=True, env=_env(cluster), timeout=30, check=True).stdout.split()
    assert expand_hostlist(text) == out


def test_srun_without_a_launcher(cluster):
    """`srun -n 2 python train.py`: one job of two ranks (it used to be two jobs of one)."""
    proc, out = _run(cluster, ["srun", "-N1", "-n2", "--label", sys.executable,
                               str(WORKERS / "env_start.py")], env={"HOROVOD_LOG_LEVEL": "debug"})
    assert proc.returncode == 0, out + cluster.logs()
    assert re.search(r"^0: OK rank=0 size=2 local=0/2", out, re.MULTILINE), out
    assert re.search(r"^1: OK rank=1 size=2 local=1/2", out, re.MULTILINE), out
    # The debug line says which row of the environment table init() used.
    assert re.search(r"^1: .*hvdlite.init: rank 1 of 2 from SLURM \(srun\) \(.*SLURM_PROCID=1",
                     out, re.MULTILINE), out


@pytest.mark.parametrize("nodes,np", [(1, 2), (2, 4)])
def test_hvdlite_run_inside_salloc(cluster, nodes, np):
    """hvdlite-run takes hosts and slots from the allocation and starts the ranks with srun:
    with -N2 -n4, ranks 0-1 on hvd1 and 2-3 on hvd2 (two nodes of this machine)."""
    proc, out = _run(cluster, ["salloc", f"-N{nodes}", f"-n{np}", *_launcher(), "-np", str(np),
                               sys.executable, str(WORKERS / "env_start.py")])
    assert proc.returncode == 0, out + cluster.logs()
    per_node = np // nodes
    for r in range(np):
        assert f"[{r}]<stdout>:OK rank={r} size={np} local={r % per_node}/{per_node}" in out, out


def test_dry_run_inside_salloc(cluster):
    proc, out = _run(cluster, ["salloc", "-N2", "-n4", *_launcher(), "-np", "3", "--dry-run",
                               "python", "train.py"])
    assert proc.returncode == 0, out
    assert re.search(r"^environment: SLURM allocation \d+ \(SLURM_JOB_NODELIST=hvd\[1-2\]", out,
                     re.MULTILINE), out
    assert "hosts: hvd1:2, hvd2:2" in out
    assert "ranks per host: hvd1: 2 (rank 0-1), hvd2: 1 (rank 2)" in out
    assert "  srun --ntasks=3 --nodes=2 --nodelist=hvd1,hvd2" in out and "python train.py" in out


def test_batch_script_without_srun_refuses(cluster, tmp_path):
    """`sbatch -n2` running python directly: a clear error, not a one-rank job."""
    log = tmp_path / "batch.out"
    proc, out = _run(cluster, ["sbatch", "--wait", "-N1", "-n2", "-o", str(log), "--wrap",
                               f"{sys.executable} {WORKERS / 'env_start.py'}"])
    text = log.read_text()
    assert proc.returncode != 0, out + text
    assert "not started by srun" in text and "OK rank" not in text, text


def test_world_size_of_nodes_under_srun_fails_every_rank(cluster):
    """A batch script that exported WORLD_SIZE=$SLURM_NNODES and RANK=$SLURM_NODEID, then ran
    `srun -n 2`: both tasks would be rank 0 of 1. Every rank fails with one line naming both."""
    proc, out = _run(cluster, ["srun", "-N1", "-n2", "--label", sys.executable,
                               str(WORKERS / "env_start.py")],
                     env={"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": "29999"})
    assert proc.returncode != 0, out
    assert "OK rank" not in out, out
    for task in (0, 1):
        assert re.search(rf"^{task}: ValueError: hvdlite.init\(\): two environments disagree: "
                         rf"SLURM \(srun\) says rank {task} of 2 .* but RANK/WORLD_SIZE "
                         rf"\(torch env://\) says rank 0 of 1", out, re.MULTILINE), out


class _Lines:
    """A running process's output, read in the background, waited on with a bound."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()

    def wait_for(self, pattern: str, count: int, timeout: float) -> list:
        with self.cond:
            self.cond.wait_for(lambda: len(self.matching(pattern)) >= count, timeout)
            found = self.matching(pattern)
        assert len(found) >= count, f"waited for {count} x {pattern!r}:\n" + self.text()
        return found

    def matching(self, pattern: str) -> list:
        return [m for m in (re.search(pattern, line) for line in self.lines) if m]

    def text(self) -> str:
        with self.cond:
            return "\n".join(self.lines)


def _start_steps(cluster, marker: str) -> tuple:
    proc = subprocess.Popen(["srun", "-N1", "-n2", "--label", sys.executable,
                             str(WORKERS / "scheduler_steps.py"), "120", marker],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(cluster), cwd=str(ROOT))
    lines = _Lines(proc)
    lines.wait_for(r"RUNNING rank=\d", 2, 150)
    pids = {int(m.group(1)): int(m.group(2))
            for m in lines.matching(r"PID rank=(\d) pid=(\d+)")}
    return proc, lines, pids


def test_one_task_killed_fails_every_rank(cluster):
    """A task that dies (SIGKILL, as the OOM killer or a lost node ends it): the other rank
    fails with an error naming the lost rank, srun fails, and nothing is left running."""
    marker = f"hvdlite-killed-{os.getpid()}"
    proc, lines, pids = _start_steps(cluster, marker)
    os.kill(pids[1], signal.SIGKILL)
    try:
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines.thread.join(10)
    out = lines.text()
    assert code != 0, out
    assert re.search(r"^0: FAILED rank=0 HorovodInternalError: .*rank 1", out, re.MULTILINE), out
    assert "TIMEOUT" not in out
    _nothing_left(cluster, marker)


def test_scancel_ends_every_rank(cluster):
    marker = f"hvdlite-scancel-{os.getpid()}"
    proc, lines, _ = _start_steps(cluster, marker)
    jobs = cluster.jobs()
    assert len(jobs) == 1, jobs
    subprocess.run(["scancel", jobs[0].split()[0]], env=_env(cluster), check=True, timeout=30)
    try:
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines.thread.join(10)
    out = lines.text()
    assert code != 0, out
    assert "TIMEOUT" not in out
    _nothing_left(cluster, marker)


def test_sigusr1_to_hvdlite_run_reaches_every_rank(cluster):
    """hvdlite-run inside salloc passes SIGUSR1 (SLURM's warning before a time limit, `--signal`)
    to srun, which passes it to every task: the ranks stop together after one step and exit 0."""
    marker = f"hvdlite-usr1-{os.getpid()}"
    proc = subprocess.Popen(["salloc", "-N1", "-n2", *_launcher(), "-np", "2", sys.executable,
                             str(WORKERS / "scheduler_steps.py"), "120", marker],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(cluster), cwd=str(ROOT))
    lines = _Lines(proc)
    try:
        lines.wait_for(r"<stdout>:RUNNING rank=\d", 2, 150)
        launcher = psutil.Process(proc.pid).children()     # salloc runs hvdlite-run itself
        assert len(launcher) == 1 and "-np" in launcher[0].cmdline(), launcher
        launcher[0].send_signal(signal.SIGUSR1)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines.thread.join(10)
    out = lines.text()
    assert code == 0, out
    stopped = lines.matching(r"\[(\d)\]<stdout>:STOPPED rank=(\d) step=(\d+)")
    assert sorted(int(m.group(2)) for m in stopped) == [0, 1], out
    assert len({m.group(3) for m in stopped}) == 1, out      # the same step on both ranks
    _nothing_left(cluster, marker)


# Known flaky, still run and reported (XPASS when it passes): 1 of 2 fresh-clone CI runs on 2 cores
# saw the job not stop after the signal (issue 62 stays open on it).
@pytest.mark.xfail(strict=False, reason="intermittent: the job has been seen not to stop "
                   "after SLURM's SIGUSR1 on 2 loaded cores (issue 62)")
@pytest.mark.timeout(480)
def test_elastic_job_sent_sigusr1_by_slurm_commits_exits_and_resumes(cluster, tmp_path):
    """`scancel --signal=USR1` (what `--signal=USR1@120` does before a time limit) reaches every
    rank of an hvdlite-run job inside salloc: the durable elastic state commits, saves, exits
    128 + SIGUSR1 saying how to resume, and the same command resumes from that checkpoint and
    finishes with the weights of uninterrupted training, no committed step done twice."""
    from test_elastic import check_exact, elastic_train

    total = 40
    env = {"ELASTIC_TOTAL_STEPS": str(total), "ELASTIC_COMMIT_EVERY": "2",
           "ELASTIC_STEP_DELAY": "0.05", "ELASTIC_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
           "ELASTIC_CHECKPOINT_EVERY": "3", "ELASTIC_STEP_LOG": str(tmp_path / "steps.log")}
    command = ["salloc", "-N1", "-n2", *_launcher(), "-np", "2", sys.executable,
               str(WORKERS / "elastic_train.py")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**_env(cluster), **env}, cwd=str(ROOT))
    lines = _Lines(proc)
    log = tmp_path / "steps.log"
    try:
        deadline = time.monotonic() + 150
        while not (log.exists() and "commit 8 " in log.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, lines.text()
            time.sleep(0.2)
        jobs = cluster.jobs()
        assert len(jobs) == 1, jobs
        subprocess.run(["scancel", "--signal=USR1", jobs[0].split()[0]], env=_env(cluster),
                       check=True, timeout=30)
        try:
            code = proc.wait(180)
        except subprocess.TimeoutExpired:
            raise AssertionError("the job did not stop:\n" + lines.text()) from None
    finally:
        if proc.poll() is None:
            proc.kill()
    lines.thread.join(10)
    out = lines.text()
    assert code == 128 + signal.SIGUSR1, out
    assert re.search(r"hvdlite: stopped by SIGUSR1 at commit \d+; saved .*commit-\d+; to "
                     r"resume, run the same command again", out), out
    _nothing_left(cluster, str(WORKERS / "elastic_train.py"))

    again, out = _run(cluster, command, env=env, timeout=300)
    assert again.returncode == 0, out
    assert "elastic: resumed from checkpoint" in out, out
    result = json.loads(out.split("<stdout>:RESULT ", 1)[1].splitlines()[0])
    check_exact(result, total)
    assert elastic_train.steps_lost(log.read_text()) == []
    _nothing_left(cluster, str(WORKERS / "elastic_train.py"))
