"""fully_shard (parameter sharding) against single-process training, multi-process.

Worker: fsdp_checks.py (float64; Adam, each policy, no_sync, clip_grad_norm_, a tied weight,
torch.compile on the blocks, DistributedOptimizer's refusal and every bad input on 2 and 4 ranks;
hybrid sharding over parallel.mesh(dp_shard=2, dp_replicate=2) and tp=2 inside the mesh; a sharded
checkpoint saved on 2 ranks, continued on 4, saved, continued on 2, each time equal to one
process's weights; the same with Adam's state through hvdlite.torch.checkpoint, 2 -> 4 -> 3
ranks, read back by torch.distributed.checkpoint in one process), and elastic_train.py with
ELASTIC_FSDP=1 (an elastic job shrunk from 3 ranks to 2 re-shards and loses no committed step).
"""
from __future__ import annotations

import os
import signal
import socket
import sys

import pytest
import test_elastic as te  # the elastic job harness and its exact reference
from test_elastic import jobs  # noqa: F401  (fixture)
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
    _all_ranks_finished(out, 2, 10)


@pytest.mark.timeout(240)
def test_fully_shard_4_ranks_compiled_blocks_hybrid_and_tensor_parallel():
    out = hvdlite_run("fsdp_checks.py", np=4, args=["--compile", "--hybrid"], timeout=230).stdout
    _all_ranks_finished(out, 4, 14)


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


@pytest.mark.timeout(240)
def test_fully_shard_through_hvdlite_checkpoint_2_to_4_to_3_read_by_dcp(tmp_path):
    """A fully sharded model and its Adam state saved with hvdlite.torch.checkpoint on 2 ranks,
    loaded on 4 (each rank reads only its rows), trained, saved, loaded on 3, trained, saved;
    torch.distributed.checkpoint in this one process (no process group) then reads the whole
    tensors, equal to one process trained for every step."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    rounds = [(2, None, "a"), (4, "a", "b"), (3, "b", "c")]
    for np, load, save in rounds:
        args = ["--dcp", "--save", str(tmp_path / save), "--steps", "2"]
        if load:
            args += ["--load", str(tmp_path / load)]
        out = hvdlite_run("fsdp_checks.py", np=np, args=args, timeout=90).stdout
        _all_ranks_finished(out, np, 1)
    dtype = torch.get_default_dtype()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
    try:
        import fsdp_checks as fc  # the worker's model, data and reference, no hvdlite started
        fc.GLOBAL = fc.DCP_GLOBAL
        ref, ref_opt = fc.reference(steps=6)
    finally:
        sys.path.pop(0)
        torch.set_default_dtype(dtype)
    names = [n for n, _ in ref.named_parameters()]
    ref_state = ref_opt.state_dict()["state"]
    want = {"model": ref.state_dict(),
            "optimizer": {"state": {names[i]: st for i, st in ref_state.items()}}}
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
           "optimizer": {"state": {n: {k: torch.zeros_like(v) for k, v in st.items()}
                                   for n, st in want["optimizer"]["state"].items()}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "torch.distributed is disabled ... single process"
        dcp.load(got, checkpoint_id=str(tmp_path / "c" / "commit-0006"), no_dist=True)
    for part in ("model", "optimizer"):
        flat_want, flat_got = _flat(want[part]), _flat(got[part])
        assert flat_want.keys() == flat_got.keys()
        for k, v in flat_want.items():
            assert flat_got[k].shape == v.shape, k
            assert torch.allclose(flat_got[k], v, rtol=fc.TOL, atol=fc.TOL), \
                (k, (flat_got[k] - v).abs().max())


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.timeout(180)
def test_elastic_fully_sharded_model_resized_3_to_2(tmp_path, jobs):  # noqa: F811
    """Kill rank 0 of a 3-rank job whose model is fully sharded: the survivors roll back to the
    last commit, cut every parameter again over 2 ranks and finish with the exact
    single-process weights and momentum buffers, every committed step done once."""
    total = 16
    host = socket.gethostname()
    job = te.ElasticJob(tmp_path, ["localhost:1", "127.0.0.1:1", f"{host}:1"],
                        ["-np", "3", "--min-np", "2", "--max-np", "3",
                         "--blacklist-cooldown-range", "600", "600"],
                        env={**te.worker_env(total), "ELASTIC_FSDP": "1"})
    jobs.append(job)
    job.wait_progress("localhost:0", 5, size=3)
    os.kill(job.pid("localhost:0"), signal.SIGKILL)
    job.wait_for_line(r"reset 1: round 2 with 2 workers")
    assert job.finish() == 0, job.err_text()
    result = job.result()
    te.check_exact(result, total)
    _, momentum = te.elastic_train.reference(total, momentum=True)
    assert result["momentum"] == momentum
    assert result["size"] == 2 and result["reset_sizes"] == [2]
    assert job.leftovers() == []


def test_mesh_groups_split_dp_into_shard_and_replicate():
    """The hybrid layout: shard groups are consecutive data-parallel ranks, replicas the same
    place in each; without dp_shard/dp_replicate the mesh is as before."""
    from hvdlite.torch.parallel.groups import mesh_groups
    g = mesh_groups(8, tp=2, dp_shard=2)
    assert g["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(s in g["all"] for s in g["dp_shard"] + g["dp_replicate"])
    plain = mesh_groups(4, tp=2)
    assert plain["dp_shard"] == plain["dp"] and plain["dp_replicate"] == []
    assert plain["all"] == [[0, 1], [2, 3], [0], [1], [2], [3], [0, 2], [1, 3]]
    assert mesh_groups(4, dp_replicate=4)["dp_shard"] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="pick factors of 4"):
        mesh_groups(4, dp_shard=3)
    with pytest.raises(ValueError, match="dp must be dp_shard"):
        mesh_groups(4, dp=4, dp_shard=2, dp_replicate=1)
