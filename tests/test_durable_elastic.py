"""Durable elastic state: the whole job dies, or is stopped by a signal, and resumes from disk.

Through the real `hvdlite-run` with the elastic worker (workers/elastic_train.py) and
`TorchState(checkpoint_dir=, checkpoint_every=)`. The worker's step log spans both runs, so
`steps_lost` counts exactly the committed steps the second run had to do again; the final
weights and step trace must equal uninterrupted single-process training (`check_exact`), which
is what a replay from the checkpoint gives.
"""
from __future__ import annotations

import os
import re
import signal

import pytest

from test_elastic import ElasticJob, check_exact, elastic_train, jobs, worker_env  # noqa: F401

COMMIT_EVERY, CHECKPOINT_EVERY = 2, 3   # a checkpoint every 6 steps


def durable_job(tmp_path, total: int) -> ElasticJob:
    env = worker_env(total)
    env.update(ELASTIC_STEP_LOG=str(tmp_path / "steps.log"),
               ELASTIC_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
               ELASTIC_CHECKPOINT_EVERY=str(CHECKPOINT_EVERY))
    return ElasticJob(tmp_path, ["localhost:2"], ["-np", "2", "--min-np", "2", "--max-np", "2"],
                      env=env)


@pytest.mark.timeout(240)
def test_whole_job_killed_resumes_from_the_newest_checkpoint(tmp_path, jobs):  # noqa: F811
    total = 40
    job = durable_job(tmp_path, total)
    jobs.append(job)
    job.wait_progress("localhost:0", 22, size=2)
    # Every process of the job at once, as when every host is preempted.
    for worker in ("localhost:0", "localhost:1"):
        os.kill(job.pid(worker), signal.SIGKILL)
    job.proc.kill()
    job.proc.wait(30)
    assert job.leftovers() == []
    before = (tmp_path / "steps.log").read_text()
    done = max(int(line.split()[1]) for line in before.splitlines() if line.startswith("run"))

    again = durable_job(tmp_path, total)
    jobs.append(again)
    line = again.wait_for_line(r"elastic: resumed from checkpoint .*commit-(\d+) \(commit \d+\)")
    commit = int(re.search(r"commit-(\d+)", line).group(1))
    assert again.finish() == 0, again.err_text()
    check_exact(again.result(), total)
    lost = elastic_train.steps_lost((tmp_path / "steps.log").read_text())
    # At most checkpoint_every commits' steps were done again, and exactly those after it.
    assert len(lost) <= CHECKPOINT_EVERY * COMMIT_EVERY, lost
    assert lost == list(range(commit * COMMIT_EVERY, lost[-1] + 1)) if lost else True
    assert not lost or lost[-1] < done + 1
    assert again.leftovers() == []


@pytest.mark.timeout(240)
def test_sigterm_commits_saves_and_exits_then_resumes_losing_nothing(tmp_path, jobs):  # noqa: F811
    total = 40
    job = durable_job(tmp_path, total)
    jobs.append(job)
    job.wait_progress("localhost:0", 9, size=2)
    job.proc.send_signal(signal.SIGTERM)    # the launcher passes it on to every worker
    assert job.finish(60) == 128 + signal.SIGTERM
    out = "\n".join(job.stdout)
    # The launcher asks for flight-recorder dumps (SIGUSR1) before it passes SIGTERM on: both
    # are stop signals.
    assert re.search(r"hvdlite: stopped by SIG(TERM|USR1) at commit \d+; saved .*commit-\d+; to resume, "
                     r"run the same command again: hvd.elastic.run resumes from the newest "
                     r"complete checkpoint in ", out), out + job.err_text()
    again = durable_job(tmp_path, total)
    jobs.append(again)
    again.wait_for_line(r"elastic: resumed from checkpoint")
    assert again.finish() == 0, again.err_text()
    check_exact(again.result(), total)
    assert elastic_train.steps_lost((tmp_path / "steps.log").read_text()) == []
    assert again.leftovers() == []
