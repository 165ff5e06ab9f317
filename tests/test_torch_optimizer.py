"""hvd.DistributedOptimizer on real ranks through hvdlite-run, compared with single-process
training on the global batch (worker scripts: tests/workers/torch_optimizer_*.py)."""
from __future__ import annotations

import pytest

from util import hvdlite_run, rank_lines

CHECKS = [
    "named_parameters_average",
    "default_names_and_param_groups",
    "adam",
    "compression_fp16",
    "op_sum",
    "gradient_predivide_factor",
    "backward_passes_per_step_2",
    "too_many_backward_passes",
    "groups_int_and_num_groups",
    "groups_list",
    "sparse_gradients",
    "synchronize_clip_skip_synchronize",
    "zero_grad_guard",
    "unused_parameters",
    "load_state_dict_clears",
    "validation_errors",
    "closure_and_wrapped_optimizer_untouched",
    "recreated_optimizer",
]


@pytest.fixture(scope="module")
def checks_output() -> str:
    """One 2-rank launch runs every check; each test below reads its own result line."""
    return hvdlite_run("torch_optimizer_checks.py", np=2, timeout=100).stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", CHECKS)
def test_distributed_optimizer(check, checks_output):
    for rank in range(2):
        lines = rank_lines(checks_output, rank)
        assert f"OK {check}" in lines, f"rank {rank} did not pass {check}:\n{checks_output}"


@pytest.mark.timeout(120)
def test_every_check_ran(checks_output):
    for rank in range(2):
        lines = rank_lines(checks_output, rank)
        assert lines[-1] == "ALL DONE"
        assert sorted(line[3:] for line in lines if line.startswith("OK ")) == sorted(CHECKS)


@pytest.mark.timeout(120)
def test_process_sets_four_ranks():
    out = hvdlite_run("torch_optimizer_process_sets.py", np=4, timeout=100).stdout
    for rank in range(4):
        lines = rank_lines(out, rank)
        assert "OK pairs {}" in lines and "OK pairs {'groups': 2}" in lines, out
        assert "OK excluded rank" in lines and "OK objects on process sets" in lines, out
        assert lines[-1] == "ALL DONE", out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 4])
def test_horovod_style_training_script(np):
    out = hvdlite_run("torch_optimizer_train.py", np=np, timeout=100).stdout
    results = [rank_lines(out, rank) for rank in range(np)]
    for lines in results:
        assert len(lines) == 1 and lines[0].startswith(f"TRAIN OK ranks={np} "), out
    assert len({lines[0] for lines in results}) == 1, out
