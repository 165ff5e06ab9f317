"""hvdlite.torch.checkpoint through the real launcher (workers/checkpoint_checks.py).

DCP interoperability both ways against a single-process reference (DCP runs without a process
group, `no_dist`), resharding 2 -> 4 -> 3 with ZeRO and `LocalShard` state, every bad input, and
a job killed mid-save resuming from the checkpoint before.
"""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

from util import hvdlite_run, rank_lines

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
import checkpoint_checks as cc  # noqa: E402  (the worker's model and table)
import elastic_train as et  # noqa: E402

sys.path.pop(0)

WORKER = "checkpoint_checks.py"


def all_ok(out: str, np: int, checks: int) -> None:
    for r in range(np):
        lines = rank_lines(out, r)
        assert f"FINISHED {checks} checks, 0 failed: []" in lines, "\n".join(lines)


def reference_state(steps: int) -> dict:
    """What the job's checkpoint must hold, computed in one process, in DCP's layout."""
    params, momentum = et.reference(steps, momentum=True)
    names = ["weight", "bias"]
    return {"model": {k: torch.tensor(v) for k, v in params.items()},
            "optimizer": {"state": {n: {"momentum_buffer": torch.tensor(m)}
                                    for n, m in zip(names, momentum)}},
            "step": steps, "table": cc.TABLE.clone()}


def zeros_like(tree):
    if torch.is_tensor(tree):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: zeros_like(v) for k, v in tree.items()}
    return 0


def same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b.to(a.dtype))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.timeout(240)
def test_dcp_reads_hvdlite_and_hvdlite_reads_dcp_and_reshards_2_4_3(tmp_path):
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "ckpt"
    # 2 ranks, ZeRO 1: each rank writes its own parameters' optimizer state, the table's rows.
    all_ok(hvdlite_run(WORKER, np=2, args=["save", str(root), "3", "1"], timeout=120).stdout,
           2, 1)
    expected = reference_state(3)
    got = zeros_like(expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=str(root / "commit-0003"), no_dist=True)
    assert same(got, expected), (got, expected)
    # 4 ranks load it (ZeRO 1 over 4: other owners), train 2 more steps, save again.
    all_ok(hvdlite_run(WORKER, np=4, args=["resume", str(root), "3", "2", "1"],
                       timeout=120).stdout, 4, 3)
    # 3 ranks, ZeRO 2, load that one.
    all_ok(hvdlite_run(WORKER, np=3, args=["resume", str(root), "5", "0", "2"],
                       timeout=120).stdout, 3, 2)
    # DCP writes one in a single process (no process group); 2 hvdlite ranks load it.
    dcp_root = tmp_path / "from_dcp"
    ref = reference_state(4)
    ref["optimizer"]["param_groups"] = [{"lr": et.LR, "momentum": et.MOMENTUM, "dampening": 0,
                                         "weight_decay": 0, "nesterov": False,
                                         "maximize": False, "foreach": None,
                                         "differentiable": False, "fused": None,
                                         "params": ["weight", "bias"]}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(ref, checkpoint_id=str(dcp_root / "commit-0004"), no_dist=True)
    all_ok(hvdlite_run(WORKER, np=2, args=["resume", str(dcp_root), "4", "0", "0"],
                       timeout=120).stdout, 2, 2)


@pytest.mark.timeout(240)
def test_bad_input_on_every_rank_and_a_kill_mid_save(tmp_path):
    """Another model's checkpoint, a partial one, a rank that cannot write, a second save while
    one is in flight; then rank 0 is killed while a save is written, and the job resumes from
    the checkpoint before it."""
    proc = hvdlite_run(WORKER, np=2, args=["bad", str(tmp_path)], timeout=140, check=False)
    all_ok(proc.stdout, 2, 4)
    assert proc.returncode != 0
    assert "STALLED BEFORE METADATA" in proc.stdout, proc.stdout + proc.stderr
    died = tmp_path / "die"
    assert not (died / "commit-0004" / ".metadata").exists()
    assert (died / "commit-0004" / "__1_0.distcp").exists()   # the parts were written
    proc = hvdlite_run(WORKER, np=2, args=["resume", str(died), "2", "0", "0"], timeout=120)
    all_ok(proc.stdout, 2, 2)
    assert "skipping " + str(died / "commit-0004") in proc.stderr, proc.stderr
