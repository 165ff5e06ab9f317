"""Elastic training through the real `hvdlite-run`, with a discovery script the test rewrites.

The "hosts" are names of this machine (localhost, 127.0.0.1, its hostname, localhost.localdomain):
each is a separate host for the driver and the coordinator, started without ssh (the ssh path
of elastic jobs is in test_multihost.py). The worker (workers/elastic_train.py) trains so that
the exact result is known: every test checks that the job ends with the expected step count,
that the committed steps are exactly 0..N-1 (none lost, none repeated), and that the weights are
bit-identical to single-process training.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
HVDLITE_RUN = str(Path(sys.executable).parent / "hvdlite-run")
WORKER = Path(__file__).parent / "workers" / "elastic_train.py"
PY = sys.executable
HOSTNAME = socket.gethostname()

sys.path.insert(0, str(WORKER.parent))
import elastic_train  # noqa: E402  (the worker's reference computation)
from util import clean_env  # noqa: E402

sys.path.remove(str(WORKER.parent))


class ElasticJob:
    """An `hvdlite-run` elastic job in the background, with a rewritable discovery script."""

    def __init__(self, tmp_path: Path, hosts: list[str], flags: list[str],
                 env: dict[str, str] | None = None, command: list[str] | None = None):
        self.dir = tmp_path
        self.marks = tmp_path / "marks"
        self.marks.mkdir(exist_ok=True)
        self.hosts_file = tmp_path / "hosts"
        self.set_hosts(hosts)
        script = tmp_path / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        script.chmod(0o755)
        self.marker = f"hvdlite-elastic-test-{os.getpid()}-{time.monotonic_ns()}"
        full_env = clean_env()
        full_env.update({"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                         "HVDLITE_START_TIMEOUT": "60", "ELASTIC_MARK_DIR": str(self.marks),
                         "HVDLITE_TEST_MARKER": self.marker})
        full_env.update(env or {})
        cmd = [HVDLITE_RUN, "--host-discovery-script", str(script), *map(str, flags),
               *(command or [PY, str(WORKER)])]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=full_env)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._cond = threading.Condition()
        for stream, sink in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()

    def _pump(self, stream, sink: list[str]) -> None:
        for line in stream:
            with self._cond:
                sink.append(line.rstrip("\n"))
                self._cond.notify_all()

    def set_hosts(self, hosts: list[str]) -> None:
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("".join(h + "\n" for h in hosts))
        os.replace(tmp, self.hosts_file)

    def err_text(self) -> str:
        with self._cond:
            return "\n".join(self.stderr)

    def wait_for_line(self, pattern: str, timeout: float = 60) -> str:
        """The first launcher stderr line matching `pattern` (a regex)."""
        deadline = time.monotonic() + timeout
        exited_at = None
        with self._cond:
            while True:
                for line in self.stderr:
                    if re.search(pattern, line):
                        return line
                now = time.monotonic()
                if self.proc.poll() is not None:
                    exited_at = exited_at or now
                if now > deadline or (exited_at is not None and now - exited_at > 2):
                    raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n"
                                         + "\n".join(self.stderr[-60:]))
                self._cond.wait(0.25)

    def progress(self, worker: str) -> tuple[int, int, int]:
        """(step, size, rank) last reported by `worker` ("host:slot"), or (-1, 0, -1)."""
        path = self.marks / f"step.{worker.replace(':', '_')}"
        try:
            step, size, rank = path.read_text().split()
            return int(step), int(size), int(rank)
        except (OSError, ValueError):
            return -1, 0, -1

    def wait_progress(self, worker: str, step: int, size: int | None = None,
                      timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            s, n, _ = self.progress(worker)
            if s >= step and (size is None or n == size):
                return
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"{worker} did not reach step {step} (size {size}) within "
                                     f"{timeout} s; last {s, n}\n" + self.err_text()[-4000:])
            time.sleep(0.05)

    def pid(self, worker: str) -> int:
        return int((self.marks / f"pid.{worker.replace(':', '_')}").read_text())

    def finish(self, timeout: float = 150) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(30)
            raise AssertionError("the elastic job did not finish:\n" + self.err_text()[-6000:])
        time.sleep(0.2)  # let the pump threads drain
        return code

    def result(self) -> dict:
        with self._cond:
            for line in self.stdout:
                if "]<stdout>:RESULT " in line:
                    return json.loads(line.split("]<stdout>:RESULT ", 1)[1])
        raise AssertionError("no RESULT line:\n" + "\n".join(self.stdout[-20:]) + "\n"
                             + self.err_text()[-4000:])

    def leftovers(self, timeout: float = 15) -> list[str]:
        """Processes of this job still running (none should be)."""
        deadline = time.monotonic() + timeout
        while True:
            left = []
            for p in psutil.process_iter(["status"]):
                try:
                    if p.pid != os.getpid() and p.info["status"] != psutil.STATUS_ZOMBIE and \
                            p.environ().get("HVDLITE_TEST_MARKER") == self.marker:
                        left.append(f"{p.pid} {' '.join(p.cmdline())}")
                except (psutil.Error, OSError):
                    continue
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def jobs():
    started: list[ElasticJob] = []
    yield started
    for job in started:
        job.kill()


def check_exact(result: dict, total: int) -> None:
    assert result["step"] == total
    assert result["trace"] == list(range(total)), "a committed step was lost or repeated"
    assert result["params"] == elastic_train.reference(total)
    # ElasticSampler: every finished epoch saw every sample; repeats only from the padding that
    # evens out the last batches (at most size - 1 per resize, sizes here are <= 3).
    epochs = result["epochs"]
    assert len(epochs) >= 2
    for ids in epochs[:-1]:
        assert sorted(set(ids)) == list(range(elastic_train.DATASET)), ids
        assert len(ids) - elastic_train.DATASET <= 2 * 4, ids


def worker_env(total: int, hold_at: int | None = None, hold_size: int = 1,
               delay: float = 0.05) -> dict[str, str]:
    env = {"ELASTIC_TOTAL_STEPS": str(total), "ELASTIC_STEP_DELAY": str(delay),
           "ELASTIC_COMMIT_EVERY": "2"}
    if hold_at is not None:
        env.update(ELASTIC_HOLD_AT=str(hold_at), ELASTIC_HOLD_SIZE=str(hold_size))
    return env


# --------------------------------------------------------------------------- units

@pytest.mark.timeout(30)
def test_round_assignment_keeps_order_and_puts_survivors_first():
    from hvdlite.runner.discovery import Blacklist, FixedHosts, parse_host_lines
    from hvdlite.runner.elastic_driver import ElasticDriver, ElasticSpec, _Worker

    d = ElasticDriver(ElasticSpec(command=["true"], env={}, discovery=FixedHosts([]),
                                  num_proc=1, min_np=1, max_np=5))
    d.round = 3
    d.plan = {"a:0": {"rank": 0}, "a:1": {"rank": 1}, "b:0": {"rank": 2}, "b:1": {"rank": 3}}
    for wid in ("a:1", "b:0", "b:1", "a:0"):
        host, slot = wid.split(":")
        d.workers[wid] = _Worker(host, int(slot), "x", None, None)
        d.workers[wid].round = 3
    d.workers["a:0"].round = None  # a:0 died; this is its slot's new process
    d.available.update(parse_host_lines("a:2\nb:2\nc:4\n", "test", 1))
    d.host_order = ["c", "a", "b"]
    target = d._target(0.0)
    assert target == ["a:0", "a:1", "b:0", "b:1", "c:0"]  # the round's slots, then new ones
    got = {wid: (a["rank"], a["local_rank"], a["local_size"], a["cross_rank"], a["cross_size"])
           for wid, a in d._assign(target)}
    assert got == {"a:1": (0, 0, 2, 0, 3), "a:0": (1, 1, 2, 0, 2), "b:0": (2, 0, 2, 1, 3),
                   "b:1": (3, 1, 2, 1, 2), "c:0": (4, 0, 1, 2, 3)}
    d.blacklist.add("a", now=0.0)
    assert d._target(1.0) == ["b:0", "b:1", "c:0", "c:1", "c:2"]

    cooldown = Blacklist((2, 5))
    delays = [cooldown.add("h", now=0.0) for _ in range(3)]
    assert 2 <= delays[0] <= 2.5 and 4 <= delays[1] <= 5 and delays[2] == 5
    assert cooldown.is_blacklisted("h", 4.9) and not cooldown.is_blacklisted("h", 5.1)
    assert cooldown.expired(5.1) == ["h"] and cooldown.expired(6) == []
    assert Blacklist(None).add("h") is None  # no range: for good


# --------------------------------------------------------------------------- failures

@pytest.mark.timeout(180)
def test_sigkill_survivors_continue_host_blacklisted_then_back(tmp_path, jobs):
    """SIGKILL rank 0 (the coordinator's process) mid-training: the survivor rolls back to its
    last commit and goes on alone; the dead worker's host is blacklisted, comes back after its
    cooldown, and the job grows again."""
    total = 26
    job = ElasticJob(tmp_path, ["localhost:1", "127.0.0.1:1"],
                     ["-np", "2", "--min-np", "1", "--max-np", "2",
                      "--blacklist-cooldown-range", "3", "4"],
                     env=worker_env(total, hold_at=20, hold_size=2))
    jobs.append(job)
    job.wait_progress("localhost:0", 7, size=2)
    assert job.progress("localhost:0")[2] == 0  # rank 0
    os.kill(job.pid("localhost:0"), signal.SIGKILL)
    job.wait_for_line(r"worker localhost:0 \(host localhost, rank 0, pid \d+\) was killed by "
                      r"signal SIGKILL; blacklisting host localhost for \d+ s")
    job.wait_for_line(r"reset 1: round 2 with 1 workers: 127\.0\.0\.1:0=0")
    job.wait_for_line(r"host localhost is back after its blacklist cooldown")
    job.wait_for_line(r"round 3 with 2 workers: 127\.0\.0\.1:0=0, localhost:0=1")
    assert job.finish() == 0, job.err_text()
    result = job.result()
    check_exact(result, total)
    assert result["size"] == 2
    assert result["reset_sizes"] == [1, 2]
    assert job.leftovers() == []


@pytest.mark.timeout(150)
def test_every_worker_failing_stops_the_job(tmp_path, jobs):
    """A bug that makes every worker fail is not retried forever."""
    job = ElasticJob(tmp_path, ["localhost:1", "127.0.0.1:1"],
                     ["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "1", "2"],
                     command=[PY, "-c", "import sys; sys.exit(7)"])
    jobs.append(job)
    assert job.finish(60) == 7
    job.wait_for_line(r"every worker has failed; the last error: worker .* exited with code 7")
    assert job.leftovers() == []


@pytest.mark.timeout(120)
def test_workers_stop_when_the_driver_dies(tmp_path, jobs):
    """SIGKILL to the driver itself (nothing can clean up after it): its workers notice the lost
    control connection and exit instead of running on as orphans."""
    job = ElasticJob(tmp_path, ["localhost:2"], ["-np", "2", "--min-np", "1"],
                     env=worker_env(400, delay=0.1))
    jobs.append(job)
    job.wait_progress("localhost:0", 2)
    job.proc.kill()
    job.proc.wait(10)
    assert job.leftovers(timeout=20) == []


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_worker(tmp_path, jobs):
    job = ElasticJob(tmp_path, ["localhost:1", "127.0.0.1:1"], ["-np", "2", "--min-np", "1"],
                     env=worker_env(400, delay=0.1))
    jobs.append(job)
    job.wait_progress("localhost:0", 2)
    job.proc.send_signal(signal.SIGINT)
    assert job.finish(60) == 130
    job.wait_for_line(r"hvdlite-run: interrupted, stopping 2 workers")
    assert "blacklisting" not in job.err_text()
    assert job.leftovers() == []


# --------------------------------------------------------------------------- membership

@pytest.mark.timeout(180)
def test_host_added_grows_up_to_max_np(tmp_path, jobs):
    """A new host appears: the job grows, but never beyond --max-np; a discovery script that
    later fails or prints garbage is reported and the job keeps its hosts."""
    total = 26
    outdir = tmp_path / "out"
    job = ElasticJob(tmp_path, ["localhost:1"],
                     ["-np", "1", "--min-np", "1", "--max-np", "2", "--output-filename", outdir],
                     env=worker_env(total, hold_at=16, hold_size=2))
    jobs.append(job)
    job.wait_progress("localhost:0", 4, size=1)
    job.set_hosts(["localhost:1", "127.0.0.1:3"])
    job.wait_for_line(r"hosts changed \(adding 127\.0\.0\.1:0\); notifying the workers")
    job.wait_for_line(r"reset 1: round 2 with 2 workers: localhost:0=0, 127\.0\.0\.1:0=1")
    job.wait_progress("localhost:0", 18, size=2)
    job.set_hosts(["localhost:1", "127.0.0.1:3", "this is not a host line"])
    job.wait_for_line(r"host discovery script .* line 3: expected 'host\[:slots\]', got "
                      r"'this is not a host line'; keeping the last host list and retrying")
    assert job.finish() == 0, job.err_text()
    result = job.result()
    check_exact(result, total)
    assert result["size"] == 2 and result["reset_sizes"] == [2]
    assert "with 3 workers" not in job.err_text()
    assert not (job.marks / "pid.127.0.0.1_1").exists()  # slots beyond --max-np never start
    # Per-worker output files (a worker's rank changes, so they are named by host and slot).
    assert "RESULT" in (outdir / "worker.localhost.0" / "stdout").read_text()
    assert (outdir / "worker.127.0.0.1.0" / "stderr").exists()


@pytest.mark.timeout(200)
def test_host_removed_shrinks_to_min_np_and_new_host_syncs(tmp_path, jobs):
    """Hosts are removed: the job shrinks down to --min-np without a rollback. Below --min-np
    the survivor waits; when a new host arrives, the survivor (which had no reason to sync after
    a removal) and the new worker (which must sync) agree through one collective, so the job
    goes on: horovod#3494's deadlock cannot happen. Each worker runs on one core, with its data
    over TCP, so the optimizer's gradients go as one flat buffer (torch/flat_grads.py), which
    the ranks agree on again after every reset, the new worker included."""
    total = 30
    release = tmp_path / "release"
    job = ElasticJob(tmp_path, ["localhost:1", "127.0.0.1:1", f"{HOSTNAME}:1"],
                     ["-np", "3", "--min-np", "2", "--max-np", "3", "--elastic-timeout", "90"],
                     env={**worker_env(total, hold_at=12, hold_size=2),
                          "ELASTIC_HOLD_FILE": str(release), "ELASTIC_ONE_CORE": "1",
                          "HVDLITE_SHM": "0"})
    jobs.append(job)
    job.wait_progress("localhost:0", 4, size=3)
    job.set_hosts(["localhost:1", "127.0.0.1:1"])
    job.wait_for_line(rf"hosts changed \(removing {re.escape(HOSTNAME)}:0\)")
    job.wait_for_line(r"reset 1: round 2 with 2 workers: localhost:0=0, 127\.0\.0\.1:0=1")
    job.wait_progress("localhost:0", 8, size=2)
    job.set_hosts(["localhost:1"])
    job.wait_for_line(r"waiting for more slots: 1 available, 2 needed \(--min-np 2\)")
    job.set_hosts(["localhost:1", "localhost.localdomain:1"])
    job.wait_for_line(r"reset 2: round 3 with 2 workers: localhost:0=0, "
                      r"localhost\.localdomain:0=1")
    release.write_text("go")
    assert job.finish() == 0, job.err_text()
    result = job.result()
    check_exact(result, total)
    assert result["size"] == 2 and result["reset_sizes"] == [2, 2]
    assert result["flat"]
    text = job.err_text()
    assert "blacklisting" not in text  # removed workers leave cleanly, they do not fail
    assert job.leftovers() == []


@pytest.mark.timeout(150)
def test_reset_limit_stops_the_job_cleanly(tmp_path, jobs):
    job = ElasticJob(tmp_path, ["localhost:1", "127.0.0.1:1", f"{HOSTNAME}:1"],
                     ["-np", "3", "--min-np", "1", "--reset-limit", "1"],
                     env=worker_env(60, hold_at=30, hold_size=3))
    jobs.append(job)
    job.wait_progress("localhost:0", 4, size=3)
    job.set_hosts(["localhost:1", "127.0.0.1:1"])
    job.wait_for_line(r"reset 1: round 2 with 2 workers")
    job.wait_progress("localhost:0", 8, size=2)
    job.set_hosts(["localhost:1"])
    start = time.monotonic()
    assert job.finish(90) == 1
    assert time.monotonic() - start < 60
    job.wait_for_line(r"hvdlite-run: elastic: the job needs reset number 2 but --reset-limit "
                      r"is 1; stopping")
    assert "round 3" not in job.err_text()
    assert job.leftovers() == []


# --------------------------------------------------------------------------- bad input

@pytest.mark.timeout(120)
@pytest.mark.parametrize("script, message", [
    ("echo 'localhost:1'; echo oops >&2; exit 3",
     r"host discovery script '.*' failed with exit code 3: oops"),
    ("echo 'localhost:two'",
     r"host discovery script '.*' line 1: slots must be a positive integer in 'localhost:two'"),
    ("echo '!!!'", r"host discovery script '.*' line 1: bad host name '!!!'"),
])
def test_discovery_script_failing_on_first_run(tmp_path, script, message):
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(0o755)
    start = time.monotonic()
    out = subprocess.run([HVDLITE_RUN, "--min-np", "1", "--host-discovery-script", str(path),
                          "true"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert re.search(r"hvdlite-run: elastic: " + message, out.stderr), out.stderr
    assert time.monotonic() - start < 30


@pytest.mark.timeout(120)
def test_too_few_slots_for_np_stops_after_elastic_timeout(tmp_path, jobs):
    job = ElasticJob(tmp_path, ["localhost:1"],
                     ["-np", "3", "--min-np", "2", "--elastic-timeout", "3"],
                     env=worker_env(10))
    jobs.append(job)
    assert job.finish(90) == 1
    job.wait_for_line(r"elastic: only 1 slots available but 3 needed \(-np 3\) for "
                      r"--elastic-timeout 3 s; hosts: localhost:1")
    assert job.leftovers() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    ("--min-np 4 --max-np 2 true", "argument --min-np/--min-num-proc: 4 is larger than --max-np 2"),
    ("-np 1 --min-np 2 --host-discovery-script x true",
     "argument -np/--num-proc: 1 is smaller than --min-np 2"),
    ("-np 3 --max-np 2 --host-discovery-script x true",
     "argument -np/--num-proc: 3 is larger than --max-np 2"),
    ("--min-np 1 --blacklist-cooldown-range 5 2 true",
     "argument --blacklist-cooldown-range: expected 0 <= MIN <= MAX, got 5 2"),
    ("--min-np 1 -H localhost:1 --host-discovery-script x true",
     "argument --host-discovery-script: not allowed with argument -H/--hosts"),
    # A fixed host list gains no slots: refused at once (horovodrun waits 600 s, then fails).
    ("-np 3 --min-np 2 -H localhost:2 true",
     "-np 3 but the hosts give only 2 slots: localhost:2; an elastic job on a fixed host list "
     "(-H/--hostfile) cannot gain hosts"),
    ("--min-np 3 -H localhost:2 true", "--min-np 3 but the hosts give only 2 slots"),
])
def test_elastic_usage_errors(args, message):
    out = subprocess.run([HVDLITE_RUN, *args.split()], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.timeout(120)
def test_fixed_hosts_below_min_np_after_a_failure_stop_at_once():
    """On a fixed host list, once a failed host is blacklisted for good and the slots left are
    below --min-np, no slot can come back: the job stops at once, not after --elastic-timeout
    (600 s by default)."""
    command = ('if [ "$HOROVOD_HOSTNAME" = 127.0.0.1 ]; then exit 3; fi; sleep 60')
    start = time.monotonic()
    out = subprocess.run([HVDLITE_RUN, "-np", "2", "--min-np", "2", "-H",
                          "localhost:1,127.0.0.1:1", "sh", "-c", command],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 1, out.stderr
    assert re.search(r"elastic: only 1 slots left but 2 needed \(-np 2\), and a fixed host "
                     r"list \(-H/--hostfile, no --host-discovery-script\) gains none \(a failed "
                     r"host stays out without --blacklist-cooldown-range\); hosts: localhost:1, "
                     r"127\.0\.0\.1:1 \(blacklisted\)",
                     out.stderr), out.stderr
    assert time.monotonic() - start < 45, out.stderr


@pytest.mark.timeout(60)
def test_elastic_command_not_found(tmp_path):
    out = subprocess.run([HVDLITE_RUN, "--min-np", "1", "-H", "localhost:1",
                          "no-such-command-hvdlite"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 127
    assert "hvdlite-run: command 'no-such-command-hvdlite' not found" in out.stderr
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    out = subprocess.run([HVDLITE_RUN, "--min-np", "1", "--host-discovery-script", str(script),
                          "no-such-command-hvdlite"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 127
    assert "hvdlite-run: command 'no-such-command-hvdlite' not found" in out.stderr


# --------------------------------------------------------------------------- security

def _frame(key: bytes, obj) -> bytes:
    """One signed frame, exactly as wire.Channel sends it."""
    from hvdlite.common.wire import Channel

    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    try:
        Channel(a, key).send(obj)
        a.close()
        data = b""
        while True:
            chunk = b.recv(65536)
            if not chunk:
                return data
            data += chunk
    finally:
        b.close()


@pytest.mark.timeout(150)
def test_control_endpoint_rejects_forged_and_replayed_messages(tmp_path, jobs):
    """The driver's endpoint rejects a stranger's and a replayed handshake, logs both, and the
    job goes on; the job secret is on no command line."""
    from hvdlite.common.rendezvous import _MAGIC, _session_key

    total = 24
    job = ElasticJob(tmp_path, ["localhost:2"], ["-np", "2", "--min-np", "2"],
                     env=worker_env(total, hold_at=10, hold_size=2, delay=0.1))
    jobs.append(job)
    job.wait_progress("localhost:0", 2)
    env = psutil.Process(job.pid("localhost:0")).environ()
    secret = bytes.fromhex(env["HVDLITE_SECRET"])
    addr = (env["HVDLITE_DRIVER_ADDR"], int(env["HVDLITE_DRIVER_PORT"]))
    for p in psutil.process_iter(["cmdline"]):
        try:
            assert env["HVDLITE_SECRET"] not in " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            pass

    def handshake(key: bytes, hello, recorded: bytes | None = None) -> tuple[bytes, bytes]:
        sock = socket.create_connection(addr, timeout=10)
        head = b""
        while len(head) < len(_MAGIC) + 32:
            head += sock.recv(len(_MAGIC) + 32 - len(head))
        client_nonce = os.urandom(32)
        sent = recorded if recorded is not None else \
            client_nonce + _frame(_session_key(key, head[len(_MAGIC):], client_nonce), hello)
        sock.sendall(sent)
        try:
            reply = sock.recv(65536)
        except OSError:
            reply = b""
        sock.close()
        return sent, reply

    hello = ("HELLO", "localhost:0", "forged", 1, "attacker")
    # 1. A stranger without the secret.
    _, reply = handshake(os.urandom(32), hello)
    assert reply == b""
    job.wait_for_line(r"rejected a control connection from 127\.0\.0\.1:\d+: rejected a control "
                      r"message from .*: bad signature or replayed sequence number.*"
                      r"\(the job goes on\)")
    # 2. A valid handshake (as if recorded on the wire), replayed on a new connection.
    recorded, reply = handshake(secret, hello)
    assert reply != b""  # the driver answered the genuine handshake ...
    job.wait_for_line(r"claiming to be worker localhost:0: no such worker is waiting")
    before = job.err_text().count("bad signature or replayed")
    _, reply = handshake(secret, hello, recorded=recorded)
    assert reply == b""  # ... but not its replay: the session key depends on a fresh nonce
    deadline = time.monotonic() + 20
    while job.err_text().count("bad signature or replayed") <= before:
        assert time.monotonic() < deadline, job.err_text()
        time.sleep(0.1)
    # 3. A frame announcing 2 GiB: refused before anything is buffered.
    _, reply = handshake(secret, hello, recorded=os.urandom(32) + (1 << 31).to_bytes(4, "big")
                         + bytes(8 + 32))
    assert reply == b""
    job.wait_for_line(r"rejected a control connection from .*: rejected a control message: "
                      r"oversized first frame \(the job goes on\)")
    assert job.finish() == 0, job.err_text()
    check_exact(job.result(), total)


# --------------------------------------------------------------------------- Python API

@pytest.mark.timeout(120)
def test_run_api_elastic_returns_final_workers_values():
    from hvdlite.runner import run

    def train(steps):
        import torch

        import hvdlite.torch as hvd

        hvd.init()
        state = hvd.elastic.ObjectState(step=0, total=0.0)

        @hvd.elastic.run
        def loop(state):
            while state.step < steps:
                state.total += float(hvd.allreduce(torch.tensor([1.0]), name="one").item())
                state.step += 1
                state.commit()

        loop(state)
        return hvd.rank(), hvd.size(), state.step, state.total

    assert run(train, args=(5,), min_num_proc=2, max_num_proc=2, hosts="localhost:2") == \
        [(0, 2, 5, 5.0), (1, 2, 5, 5.0)]
