"""fully_shard (parameter sharding) against single-process training, multi-process.

Worker: fsdp_checks.py (float64; Adam, each policy, no_sync, clip_grad_norm_, a tied weight,
torch.compile on the blocks, DistributedOptimizer's refusal and every bad input on 2 and 4 ranks;
hybrid sharding over parallel.mesh(dp_shard=2, dp_replicate=2); a sharded checkpoint saved on 2
ranks, continued on 4, saved, continued on 2, each time equal to one process's weights).
"""
from __future__ import annotations

import pytest
from util import hvdlite_run, rank_lines


def _all_ranks_finished(out: str, np: int, checks: int) -> None:
    for r in range(np):
        lines = rank_lines(out, r)
        fails = [line for line in lines if line.startswith("CHECK") and " FAIL" in line]
        assert not fails, "\n".join(lines)
        assert any(line.startswith(f"FINISHED {checks} checks, 0 failed") for line in lines), \
            "\n".join(lines)


@pytest.mark.timeout(150)
def test_fully_shard_matches_single_process_2_ranks():
    out = hvdlite_run("fsdp_checks.py", np=2, timeout=140).stdout
    _all_ranks_finished(out, 2, 9)


@pytest.mark.timeout(200)
def test_fully_shard_4_ranks_with_compiled_blocks():
    out = hvdlite_run("fsdp_checks.py", np=4, args=["--compile"], timeout=190).stdout
    _all_ranks_finished(out, 4, 10)


@pytest.mark.timeout(150)
def test_hybrid_sharding_and_tensor_parallel_4_ranks():
    out = hvdlite_run("fsdp_checks.py", np=4, args=["--hybrid"], timeout=140).stdout
    _all_ranks_finished(out, 4, 3)


@pytest.mark.timeout(300)
def test_sharded_checkpoint_resharded_2_to_4_to_2(tmp_path):
    """Each round loads every saved rank's sharded_state_dict (LocalShard values) on the other
    number of ranks, trains 2 more steps and must equal one process trained for all of them."""
    rounds = [(2, None, "a"), (4, "a", "b"), (2, "b", "c")]
    for np, load, save in rounds:
        args = ["--save", str(tmp_path / save), "--steps", "2"]
        if load:
            args += ["--load", str(tmp_path / load)]
        out = hvdlite_run("fsdp_checks.py", np=np, args=args, timeout=90).stdout
        _all_ranks_finished(out, np, 1)
        assert len(list((tmp_path / save).glob("rank*.pt"))) == np
