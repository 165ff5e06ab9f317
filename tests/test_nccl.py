"""NCCL transport for CUDA tensors; runs where GPUs are present and skips elsewhere.

With one GPU, two tests still run: a one-rank job whose CUDA communicator is a real
NCCLCommunicator (NCCL refuses two ranks on one GPU, so one rank is the most NCCL allows there),
and two ranks sharing the GPU, which hvdlite must detect and serve through host memory.
"""
import pytest
import torch
import torch.distributed as dist

from util import hvdlite_run, rank_lines

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(
    GPUS < 1 or not dist.is_nccl_available(),
    reason="needs a CUDA GPU and torch built with NCCL (this machine has none)")


def _ok(proc, np: int) -> list:
    """The communicator class each rank reported after its checks passed."""
    used = []
    for r in range(np):
        lines = [ln for ln in rank_lines(proc.stdout, r) if ln.startswith("OK")]
        assert lines, proc.stdout + proc.stderr
        used.append(lines[-1].split()[-1])
    return used


@pytest.mark.timeout(240)
def test_cuda_collectives_over_nccl():
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs for a two-rank NCCL job (NCCL needs one GPU per rank), "
                    f"found {GPUS}")
    proc = hvdlite_run("nccl_worker.py", np=2, timeout=200)
    assert _ok(proc, 2) == ["NCCLCommunicator"] * 2


@pytest.mark.timeout(240)
def test_nccl_communicator_on_one_gpu():
    proc = hvdlite_run("nccl_worker.py", np=1, env={"HVDLITE_TEST_NCCL_ONE_RANK": "1"},
                       timeout=200)
    assert _ok(proc, 1) == ["NCCLCommunicator"]


@pytest.mark.timeout(240)
def test_ranks_sharing_a_gpu_are_served_through_host_memory():
    proc = hvdlite_run("nccl_worker.py", np=2, env={"HVDLITE_TEST_SHARED_GPU": "1"},
                       timeout=200)
    assert _ok(proc, 2) == ["GlooCommunicator"] * 2
    out = proc.stdout + proc.stderr
    assert "ranks [0, 1] share a GPU" in out and "torch.cuda.set_device(hvd.local_rank())" in out, \
        out


@pytest.mark.timeout(240)
def test_one_rank_job_with_cuda_tensors():
    """A one-rank job (debugging on one GPU): CUDA tensors go through the one-rank communicator
    and every collective still returns the reference result on the caller's stream."""
    proc = hvdlite_run("nccl_worker.py", np=1, timeout=200)
    assert _ok(proc, 1) == ["SelfCommunicator"]
