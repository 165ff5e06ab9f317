"""broadcast_parameters / broadcast_optimizer_state / broadcast_object / allgather_object and
SyncBatchNorm on real ranks through hvdlite-run, compared with what one process computes
(worker script: tests/workers/torch_functions_checks.py)."""
from __future__ import annotations

import pytest

from util import Run, hvdlite_run, rank_lines

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
def checks_output() -> Run:
    """One 2-rank launch runs every check; each test below reads its own result line."""
    return Run("torch_functions_checks.py", np=2, timeout=100, check_exit=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", CHECKS)
def test_functions_and_sync_batch_norm(check, checks_output):
    checks_output.check(check)


@pytest.mark.timeout(120)
def test_every_check_ran(checks_output):
    checks_output.finished()
    for rank in range(2):
        ran = [line.split()[1] for line in checks_output.lines[rank]
               if line.startswith("CHECK ")]
        assert sorted(ran) == sorted(CHECKS), checks_output.output[-3000:]


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
                                    "sparse_as_dense", "process_set",
                                    "zero_stage"]      # hvdlite's one trailing extension
    assert str(inspect.signature(hvd.SyncBatchNorm)) == \
        "(num_features, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)"
