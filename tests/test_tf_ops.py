"""hvdlite.tensorflow collectives on 2 real ranks (hvdlite-run, gloo): every op eagerly and inside
tf.function against single-process references, their gradients, process sets, object helpers,
DistributedGradientTape, the TF1 DistributedOptimizer, SyncBatchNormalization, and the errors
(mismatched shapes/dtypes: the same clear error on every rank; XLA; bad dtypes).

All checks share one launch (TensorFlow imports slowly); each test judges one named check.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from tf_launch import SKIP_NO_TF, Run  # noqa: E402

pytestmark = SKIP_NO_TF

MODES = ["eager", "function"]
PER_MODE = [f"allreduce_{op}" for op in ("Average", "Sum", "Min", "Max", "Product")] + [
    "allreduce_variants", "grouped_allreduce", "sparse_allreduce", "allgather", "broadcast",
    "broadcast_inplace", "alltoall", "reducescatter", "join_barrier", "gradients",
    "gradient_tape", "gradient_path", "tf1_optimizer", "sync_batch_norm", "mismatch_errors", "adasum"]
CHECKS = ["topology", "api"] + [f"{c}_{m}" for m in MODES for c in PER_MODE] + [
    "tf1_graph", "uneven_join", "process_sets", "objects", "partial_tape", "size_one_tape",
    "local_errors", "one_rank_errors", "unnamed_steady", "eager_without_tape",
    "autograph_leaves_hvdlite_alone"]


@pytest.fixture(scope="module")
def ops():
    return Run("tf_ops.py", np=2, timeout=360)


@pytest.mark.timeout(420)
def test_tf_ops_finished(ops):
    ops.finished()


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", CHECKS)
def test_tf_op(ops, name):
    ops.check(name)
