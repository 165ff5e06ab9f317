"""broadcast_parameters / broadcast_optimizer_state / broadcast_object / allgather_object and
SyncBatchNorm on real ranks through hvdlite-run, compared with what one process computes
(worker script: tests/workers/torch_functions_checks.py)."""
from __future__ import annotations

import pytest

from util import hvdlite_run, rank_lines

CHECKS = [
    "broadcast_parameters_forms",
    "broadcast_optimizer_state_existing_state",
    "broadcast_optimizer_state_fresh",
    "broadcast_optimizer_state_scalars",
    "broadcast_object_and_allgather_object",
    "sync_batch_norm_equal_batches",
    "sync_batch_norm_unequal_batches",
    "sync_batch_norm_options",
    "sync_batch_norm_eval_is_local",
    "sync_batch_norm_training_with_distributed_optimizer",
]


@pytest.fixture(scope="module")
def checks_output() -> str:
    """One 2-rank launch runs every check; each test below reads its own result line."""
    return hvdlite_run("torch_functions_checks.py", np=2, timeout=100).stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", CHECKS)
def test_functions_and_sync_batch_norm(check, checks_output):
    for rank in range(2):
        lines = rank_lines(checks_output, rank)
        assert f"OK {check}" in lines, f"rank {rank} did not pass {check}:\n{checks_output}"


@pytest.mark.timeout(120)
def test_every_check_ran(checks_output):
    for rank in range(2):
        lines = rank_lines(checks_output, rank)
        assert lines[-1] == "ALL DONE"
        assert sorted(line[3:] for line in lines if line.startswith("OK ")) == sorted(CHECKS)


def test_exports():
    import hvdlite.torch as hvd
    from hvdlite.torch.sync_batch_norm import SyncBatchNorm
    for name in ("DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
                 "broadcast_object", "allgather_object", "SyncBatchNorm", "allreduce",
                 "Compression", "init"):
        assert hasattr(hvd, name), name
    assert hvd.SyncBatchNorm is SyncBatchNorm
    import inspect
    sig = inspect.signature(hvd.DistributedOptimizer)
    assert list(sig.parameters) == ["optimizer", "named_parameters", "compression",
                                    "backward_passes_per_step", "op",
                                    "gradient_predivide_factor", "num_groups", "groups",
                                    "sparse_as_dense", "process_set"]
    assert str(inspect.signature(hvd.SyncBatchNorm)) == \
        "(num_features, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)"
