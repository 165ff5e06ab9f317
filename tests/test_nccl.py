"""NCCL transport for CUDA tensors; runs where GPUs are present and skips elsewhere.

With one GPU these still run: a one-rank job whose CUDA communicator is a real
NCCLCommunicator; two ranks sharing the GPU, which hvdlite must detect and serve through host
memory (NCCL refuses two ranks of one host on one GPU); and two ranks sharing it under their own
NCCL_HOSTIDs, which NCCL takes for two hosts and connects over loopback sockets: a real two-rank
NCCL communicator, which hvdlite must use.
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


@pytest.mark.timeout(200)
@pytest.mark.parametrize("completion", ["blocking", "async"])
def test_two_rank_nccl_job_on_one_gpu_with_nccl_hostids(completion):
    """The two-rank NCCL path on a machine with one GPU: each rank its own NCCL_HOSTID (set by
    the worker from HOROVOD_RANK), NCCL's socket transport on loopback. Every collective, a
    joined rank's zeros on its GPU, and the communicator built on the rank's own device; with
    HOROVOD_ENABLE_ASYNC_COMPLETION=1 too, where a handle completes once its work is queued and
    waiting on it makes the caller's side stream wait for the results."""
    proc = hvdlite_run("nccl_worker.py", np=2, timeout=150,
                       env={"HVDLITE_TEST_NCCL_HOSTID": "1", "NCCL_SOCKET_IFNAME": "lo",
                            "NCCL_IB_DISABLE": "1",
                            "HOROVOD_ENABLE_ASYNC_COMPLETION": str(int(completion == "async"))})
    assert _ok(proc, 2) == ["NCCLCommunicator"] * 2
    assert "share a GPU" not in proc.stdout + proc.stderr
