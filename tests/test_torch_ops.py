"""hvdlite.torch collectives on real ranks (hvdlite-run, gloo), checked against references that
every rank computes locally from every rank's deterministic input.

Each worker script (tests/workers/ops_*.py) runs many named checks in one launch and prints one
`CHECK <name> OK|FAIL ...` line per check and a final `FINISHED ...` line per rank; the tests below
share one launch per configuration and judge each check on its own, so a failure names exactly
the checks it breaks.
"""
from __future__ import annotations

import pytest

from util import Run

# ---------------------------------------------------------------------------- helpers


# ---------------------------------------------------------------------------- every op x dtype

BASIC_CHECKS = [
    "topology",
    "allreduce_Average", "allreduce_Sum", "allreduce_Min", "allreduce_Max",
    "allreduce_Product",
    "allreduce_variants",
    "min_max_nan",
    "grouped_allreduce_Average", "grouped_allreduce_Sum", "grouped_allreduce_Min",
    "grouped_allreduce_Max", "grouped_allreduce_Product",
    "allgather", "scalar_errors",
    "broadcast", "alltoall", "alltoall_bad_splits", "reducescatter", "fused_reducescatter",
    "sparse_allreduce", "errors", "poll_synchronize", "barrier",
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"np{n}")
def basic(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"basic_np{request.param}")
    return Run("ops_basic.py", request.param, args=[str(tmp)], timeout=150)


@pytest.mark.timeout(200)
def test_basic_finished(basic):
    basic.finished()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", BASIC_CHECKS)
def test_basic(basic, name):
    """allreduce (all 5 ops x 9 dtypes x 0-d/1-d/3-d x prescale/postscale; async, in place,
    non-aliasing, non-contiguous), grouped variants == ungrouped, allgather with per-rank first
    dims, broadcast from every root (bool too), alltoall with/without splits (list/tensor,
    received splits), reducescatter with dim0 % size != 0, errors, poll/synchronize, barrier."""
    basic.check(name)


# ---------------------------------------------------------------------------- fusion and cache

FUSION_CONFIGS = {
    "default": {},
    "no_fusion": {"HOROVOD_FUSION_THRESHOLD": "0"},
    "small_fusion": {"HOROVOD_FUSION_THRESHOLD": "4096"},
    "no_cache": {"HOROVOD_CACHE_CAPACITY": "0"},
    "cache2": {"HOROVOD_CACHE_CAPACITY": "2"},
}
FUSION_CHECKS = ["big_and_small_members", "many_async_allreduces",
                 "many_async_allreduces_mixed_order", "steady_state_all_ops",
                 "many_async_mixed_ops", "sync_loop_shape_change", "lone_output_not_contiguous"]


@pytest.fixture(scope="module", params=list(FUSION_CONFIGS))
def fusion(request):
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "10",
           **FUSION_CONFIGS[request.param]}
    run = Run("ops_fusion.py", 2, env=env, timeout=120)
    run.config = request.param
    return run


@pytest.mark.timeout(160)
def test_fusion_finished(fusion):
    fusion.finished()


@pytest.mark.timeout(160)
@pytest.mark.parametrize("name", FUSION_CHECKS)
def test_fusion_and_cache(fusion, name):
    """200 named fp32/fp16 tensors in flight at once, 22 iterations (steady-state cache path,
    then a shape change under the same name); every kind of named collective in steady state
    with changing parameters; exact results under every fusion/cache setting."""
    fusion.check(name)


@pytest.mark.timeout(150)
def test_lone_output_not_contiguous_over_tcp():
    """A lone allreduce into an output that is not contiguous on one rank only reduces right
    over gloo's own TCP path too (HVDLITE_SHM=0), where it used to give both ranks a wrong sum
    (workers/ops_fusion.py)."""
    run = Run("ops_fusion.py", 2, args=["lone_output_not_contiguous"],
              env={"HVDLITE_SHM": "0"}, timeout=120)
    run.check("lone_output_not_contiguous")
    run.finished()


# ---------------------------------------------------------------------------- join

@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"np{n}")
def join_run(request):
    return Run("ops_join.py", request.param, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["uneven_allreduce_join", "other_collectives_after_join",
                                  "join_twice"])
def test_join(join_run, name):
    """Rank r runs 3 + r allreduce steps then joins: results equal the zero-contribution
    reference, join() returns the last joined rank; allgather/broadcast/alltoall/reducescatter
    with a joined rank fail on every rank that submitted them."""
    join_run.check(name)
    join_run.finished()


# ---------------------------------------------------------------------------- gradients

GRAD_CHECKS = [
    "untraced",
    "allreduce_grad", "grouped_allreduce_grad",
    "allgather_grad", "grouped_allgather_grad",
    "broadcast_grad", "alltoall_grad",
    "reducescatter_grad",
    "grouped_reducescatter_grad",
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"np{n}")
def grad_run(request):
    return Run("ops_grad.py", request.param, timeout=90)


@pytest.mark.timeout(120)
def test_grad_finished(grad_run):
    grad_run.finished()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", GRAD_CHECKS)
def test_grad(grad_run, name):
    """Gradients as Horovod 0.28 defines them (see tests/workers/ops_grad.py)."""
    grad_run.check(name)


# ---------------------------------------------------------------------------- lifecycle

@pytest.fixture(scope="module")
def lifecycle_run():
    return Run("ops_lifecycle.py", 2, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["before_init", "shutdown_init_cycles", "public_handle",
                                  "results_die_with_the_caller"])
def test_lifecycle(lifecycle_run, name):
    """ValueError('Horovod has not been initialized; use hvd.init().') before init and after
    shutdown; shutdown() then init() again, three times, with collectives in every cycle; the op
    layer's public handle (wait with a timeout, test, callbacks); a finished collective's
    tensors are freed as soon as the caller drops them (no reference cycle)."""
    lifecycle_run.check(name)
    lifecycle_run.finished()
