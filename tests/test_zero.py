"""ZeRO sharding (`DistributedOptimizer(zero_stage=1|2)`) and stateful compression, multi-process.

Workers: zero_checks.py (stages 1/2 vs stage 0 vs one process on the global batch, float64;
clipping; backward_passes_per_step; state_dict round trip through plain torch; process_set;
bad input), compression_checks.py (error feedback, convergence, bad dtype), and the elastic
worker (elastic_train.py) with a sharded optimizer resized from 3 ranks to 2.
"""
from __future__ import annotations

import os
import signal
import socket

import pytest

from util import hvdlite_run, rank_lines

import test_elastic as te  # the elastic job harness and its exact reference
from test_elastic import jobs  # noqa: F401  (fixture)


def _all_ranks_finished(out: str, np: int) -> None:
    for r in range(np):
        lines = rank_lines(out, r)
        fails = [line for line in lines if line.startswith("CHECK") and " FAIL" in line]
        assert not fails, "\n".join(lines)
        assert any(line.startswith("FINISHED") and ", 0 failed" in line for line in lines), \
            "\n".join(lines)


@pytest.mark.timeout(150)
def test_zero_stages_match_stage0_and_single_process_2_ranks():
    out = hvdlite_run("zero_checks.py", np=2, timeout=140).stdout
    _all_ranks_finished(out, 2)


@pytest.mark.timeout(150)
def test_zero_stages_4_ranks_and_mesh_dp_process_set():
    out = hvdlite_run("zero_checks.py", np=4, args=["--quick", "--mesh"], timeout=140).stdout
    _all_ranks_finished(out, 4)


@pytest.mark.timeout(150)
def test_int8_and_powersgd_error_feedback_and_convergence():
    out = hvdlite_run("compression_checks.py", np=2, timeout=140).stdout
    _all_ranks_finished(out, 2)


@pytest.mark.timeout(180)
def test_elastic_sharded_optimizer_resized_3_to_2(tmp_path, jobs):  # noqa: F811
    """Kill rank 0 of a 3-rank job whose optimizer is sharded (stage 2): the survivors roll back
    to the last commit, re-shard over 2 ranks and finish with the exact single-process weights
    and momentum buffers, every committed step done once."""
    total = 16
    host = socket.gethostname()
    job = te.ElasticJob(tmp_path, ["localhost:1", "127.0.0.1:1", f"{host}:1"],
                        ["-np", "3", "--min-np", "2", "--max-np", "3",
                         "--blacklist-cooldown-range", "600", "600"],
                        env={**te.worker_env(total), "ELASTIC_ZERO_STAGE": "2"})
    jobs.append(job)
    job.wait_progress("localhost:0", 5, size=3)
    os.kill(job.pid("localhost:0"), signal.SIGKILL)
    job.wait_for_line(r"reset 1: round 2 with 2 workers")
    assert job.finish() == 0, job.err_text()
    result = job.result()
    te.check_exact(result, total)
    params, momentum = te.elastic_train.reference(total, momentum=True)
    assert result["momentum"] == momentum
    assert result["size"] == 2 and result["reset_sizes"] == [2]
    assert job.leftovers() == []


@pytest.mark.timeout(300)
def test_keras_distributed_optimizer_int8_and_powersgd():
    pytest.importorskip("tensorflow")
    out = hvdlite_run("tf_keras_compression.py", np=2, timeout=280).stdout
    _all_ranks_finished(out, 2)
