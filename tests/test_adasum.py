"""op=hvd.Adasum: the engine's arithmetic against a NumPy reference of Horovod's formula, then
real 2- and 4-rank runs (collectives and DistributedOptimizer(op=Adasum)), and Horovod's errors
for a non-power-of-two world and for process sets."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from hvdlite.common.adasum import tree_reduce
from hvdlite.common.fusion import fuse_responses
from hvdlite.common.messages import ADASUM, ALLREDUCE, SUM, Response

from test_torch_ops import Run

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from adasum_ref import adasum as adasum_ref  # noqa: E402


# ---------------------------------------------------------------------------- arithmetic
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tree_reduce_matches_the_numpy_reference_per_tensor(size, dtype):
    g = torch.Generator().manual_seed(size)
    counts = [1, 7, 0, 64, 5]
    rows = torch.randn(size, sum(counts), generator=g, dtype=torch.float64).to(dtype)
    rows[0, 1:8] = 0                                   # a zero contribution on rank 0
    got = tree_reduce(rows, counts)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    off = 0
    for n in counts:
        want = adasum_ref([rows[r, off:off + n].numpy() for r in range(size)], np_dtype)
        tol = 1e-6 if dtype == torch.float32 else 1e-13
        np.testing.assert_allclose(got[off:off + n].numpy(), want, rtol=tol, atol=tol)
        off += n


@pytest.mark.timeout(60)
def test_adasum_adds_orthogonal_and_averages_parallel_vectors():
    e = torch.eye(4, dtype=torch.float64)
    assert torch.allclose(tree_reduce(e, [4]), torch.ones(4, dtype=torch.float64))
    v = torch.tensor([[1.0, 2.0, 3.0]] * 4, dtype=torch.float64)
    assert torch.allclose(tree_reduce(v, [3]), v[0])
    with pytest.raises(NotImplementedError, match="non-power of 2"):
        tree_reduce(torch.ones(3, 2), [2])


@pytest.mark.timeout(60)
def test_adasum_responses_never_fuse_with_other_reductions():
    def resp(name, op):
        return Response(type=ALLREDUCE, names=[name], shapes=[(4,)], reduce_op=op,
                        cache_bits=[-1])
    fused = fuse_responses([resp("a", ADASUM), resp("s", SUM), resp("b", ADASUM),
                            resp("t", SUM)], threshold=1 << 20)
    assert [(f.names, f.reduce_op) for f in fused] == [(["a", "b"], ADASUM), (["s", "t"], SUM)]


# ---------------------------------------------------------------------------- real ranks
CHECKS = ["errors", "process_set_error", "adasum_float32", "adasum_float64", "adasum_in_flight",
          "adasum_grouped_inplace", "optimizer_sgd", "optimizer_adam",
          "optimizer_elastic_reset_drops_a_partial_step"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np_", [2, 4])
def test_adasum_on_real_ranks(np_):
    run = Run("adasum_ops.py", np_, timeout=180)
    run.finished()
    for name in CHECKS:
        run.check(name)


@pytest.mark.timeout(200)
def test_adasum_needs_a_power_of_two_world():
    run = Run("adasum_ops.py", 3, timeout=180)
    run.finished()
    run.check("errors")
    run.check("process_set_error")
