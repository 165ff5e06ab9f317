"""One host, several workers, one of them fails: the others keep their state and go on.

The most common elastic set-up (one multi-GPU host, a worker that crashes: an OOM, a bad node
library) must cost the failed slot, not its healthy host-mates. The worker
(workers/elastic_train.py) logs every step it runs and every commit, so each test counts the
committed steps a failure made the job run again (`steps_lost`: must be none), on top of the
exact final weights and step trace that `check_exact` compares with single-process training.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from test_elastic import ElasticJob, check_exact, elastic_train, jobs, worker_env  # noqa: F401

FLAGS = ["-np", "3", "--min-np", "2", "--max-np", "3", "--blacklist-cooldown-range", "1", "2"]


def shared_host_job(tmp_path, total: int, hold_at: int) -> ElasticJob:
    env = worker_env(total, hold_at=hold_at, hold_size=3)
    env["ELASTIC_STEP_LOG"] = str(tmp_path / "steps.log")
    return ElasticJob(tmp_path, ["localhost:3"], FLAGS, env=env)


def kill_when_full(job: ElasticJob, worker: str, step: int) -> None:
    """SIGKILL `worker` once the job has 3 ranks again and has passed `step`."""
    job.wait_progress(worker, step, size=3)
    os.kill(job.pid(worker), signal.SIGKILL)


def check_nothing_lost(job: ElasticJob, tmp_path, total: int) -> dict:
    assert job.finish() == 0, job.err_text()
    result = job.result()
    check_exact(result, total)
    assert elastic_train.steps_lost((tmp_path / "steps.log").read_text()) == [], \
        "the job ran committed steps again:\n" + job.err_text()[-4000:]
    text = job.err_text()
    assert "blacklisting host" not in text and "its host was removed" not in text, text
    assert job.leftovers() == []
    return result


@pytest.mark.timeout(180)
def test_worker_killed_costs_its_slot_not_its_host(tmp_path, jobs):  # noqa: F811
    """The issue's scenario: localhost:3, a worker SIGKILLed after batch 10. Its slot is
    blacklisted for the cooldown, the two survivors go on from their last commit, and the slot
    comes back with a fresh worker that syncs from them."""
    total = 30
    job = shared_host_job(tmp_path, total, hold_at=24)
    jobs.append(job)
    kill_when_full(job, "localhost:1", 10)
    job.wait_for_line(r"worker localhost:1 \(host localhost, rank 1, pid \d+\) was killed by "
                      r"signal SIGKILL; blacklisting slot localhost:1 for \d+ s")
    job.wait_for_line(r"reset 1: round 2 with 2 workers: localhost:0=0, localhost:2=1")
    job.wait_for_line(r"slot localhost:1 is back after its blacklist cooldown")
    job.wait_for_line(r"round 3 with 3 workers: localhost:0=0, localhost:2=1, localhost:1=2")
    result = check_nothing_lost(job, tmp_path, total)
    assert result["reset_sizes"] == [2, 3]


@pytest.mark.timeout(180)
def test_rank_0_killed_on_a_shared_host(tmp_path, jobs):  # noqa: F811
    """Rank 0 (the coordinator's process) dies: a host-mate becomes rank 0 and holds the
    commit; nothing is trained again."""
    total = 30
    job = shared_host_job(tmp_path, total, hold_at=24)
    jobs.append(job)
    job.wait_progress("localhost:0", 10, size=3)
    assert job.progress("localhost:0")[2] == 0
    os.kill(job.pid("localhost:0"), signal.SIGKILL)
    job.wait_for_line(r"worker localhost:0 \(host localhost, rank 0, pid \d+\) was killed by "
                      r"signal SIGKILL; blacklisting slot localhost:0 for \d+ s")
    job.wait_for_line(r"reset 1: round 2 with 2 workers: localhost:1=0, localhost:2=1")
    job.wait_for_line(r"round 3 with 3 workers: localhost:1=0, localhost:2=1, localhost:0=2")
    result = check_nothing_lost(job, tmp_path, total)
    assert result["reset_sizes"] == [2, 3]


@pytest.mark.timeout(300)
def test_four_failures_in_a_row_lose_no_committed_step(tmp_path, jobs):  # noqa: F811
    """Four kills, each once the job is back to 3 ranks, rank 0's process among them (the issue
    measured 70 of 150 steps lost this way before)."""
    total = 60
    job = shared_host_job(tmp_path, total, hold_at=total - 4)
    jobs.append(job)
    step = 6
    for n, worker in enumerate(["localhost:1", "localhost:0", "localhost:2", "localhost:1"]):
        # The worker's rank after the re-forms before: whoever holds rank 0 is killed second.
        if n == 1:
            worker = next(w for w in ("localhost:0", "localhost:2")
                          if job.progress(w)[2] == 0)
        kill_when_full(job, worker, step)
        job.wait_for_line(rf"reset {2 * n + 1}: round {2 * n + 2} with 2 workers", timeout=90)
        step = job.progress("localhost:0" if worker != "localhost:0" else "localhost:2")[0] + 4
        time.sleep(0.1)
    check_nothing_lost(job, tmp_path, total)
    text = job.err_text()
    assert text.count("blacklisting slot") == 4
    # (each process records only the resets it lived through, so count the launcher's lines)
    assert text.count("with 2 workers") == 4 and text.count("with 3 workers") == 4, text


@pytest.mark.timeout(120)
def test_no_worker_holding_the_commit_stops_with_one_line(tmp_path, jobs):  # noqa: F811
    """Every host of the job is replaced at once: the workers that hold the commit leave, and
    the new ones hold nothing. The job stops with one line rather than train from step 0."""
    job = ElasticJob(tmp_path, ["localhost:2"], ["-np", "2", "--min-np", "2", "--max-np", "2"],
                     env=worker_env(400, delay=0.1))
    jobs.append(job)
    job.wait_progress("localhost:0", 6, size=2)
    job.set_hosts(["127.0.0.1:2"])
    assert job.finish(90) == 1
    job.wait_for_line(r"elastic: no worker left holds the last commit \(round 1's workers "
                      r"localhost:0, localhost:1 are gone\) and no checkpoint was saved; "
                      r"stopping instead of restarting from step 0")
    assert "round 2" not in job.err_text()
    assert job.leftovers() == []
