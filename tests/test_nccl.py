"""NCCL transport for CUDA tensors; runs where GPUs are present and skips elsewhere."""
import pytest
import torch
import torch.distributed as dist

from util import hvdlite_run, rank_lines

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(
    GPUS < 1 or not dist.is_nccl_available(),
    reason="needs a CUDA GPU and torch built with NCCL (this machine has none)")


@pytest.mark.timeout(240)
def test_cuda_collectives_over_nccl():
    np = 2
    env = {}
    if GPUS < np:
        # Several ranks may share one GPU only for gloo staging; NCCL needs one GPU per rank.
        pytest.skip(f"needs {np} GPUs for NCCL, found {GPUS}")
    proc = hvdlite_run("nccl_worker.py", np=np, env=env, timeout=200)
    for r in range(np):
        assert any(line.startswith("OK") for line in rank_lines(proc.stdout, r)), proc.stdout


@pytest.mark.timeout(240)
def test_cuda_tensors_with_one_gpu_fall_back_to_host_staging():
    proc = hvdlite_run("nccl_worker.py", np=2, env={"HVDLITE_TEST_SHARED_GPU": "1"},
                       timeout=200)
    for r in range(2):
        assert any(line.startswith("OK") for line in rank_lines(proc.stdout, r)), proc.stdout
