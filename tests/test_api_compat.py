"""hvdlite.torch exposes Horovod 0.28's public names with the same signatures and defaults, so a
Horovod script runs after changing only the import."""
import inspect

import pytest

import hvdlite.torch as hvd

# name -> Horovod 0.28's parameters (name=default), from horovod/torch/__init__.py & mpi_ops.py
SIGNATURES = {
    "init": "comm=None, process_sets=None",
    "allreduce": "tensor, average=None, name=None, compression=Compression.none, op=None, "
                 "prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set",
    "allreduce_async": "tensor, average=None, name=None, op=None, prescale_factor=1.0, "
                       "postscale_factor=1.0, process_set=global_process_set",
    "allreduce_": "tensor, average=None, name=None, op=None, prescale_factor=1.0, "
                  "postscale_factor=1.0, process_set=global_process_set",
    "allreduce_async_": "tensor, average=None, name=None, op=None, prescale_factor=1.0, "
                        "postscale_factor=1.0, process_set=global_process_set",
    "grouped_allreduce": "tensors, average=None, name=None, compression=Compression.none, "
                         "op=None, prescale_factor=1.0, postscale_factor=1.0, "
                         "process_set=global_process_set",
    "grouped_allreduce_async": "tensors, average=None, name=None, op=None, prescale_factor=1.0, "
                               "postscale_factor=1.0, process_set=global_process_set",
    "grouped_allreduce_": "tensors, average=None, name=None, op=None, prescale_factor=1.0, "
                          "postscale_factor=1.0, process_set=global_process_set",
    "grouped_allreduce_async_": "tensors, average=None, name=None, op=None, "
                                "prescale_factor=1.0, postscale_factor=1.0, "
                                "process_set=global_process_set",
    "sparse_allreduce_async": "tensor, name, op, process_set=global_process_set",
    "allgather": "tensor, name=None, process_set=global_process_set",
    "allgather_async": "tensor, name=None, process_set=global_process_set",
    "grouped_allgather": "tensors, name=None, process_set=global_process_set",
    "grouped_allgather_async": "tensors, name=None, process_set=global_process_set",
    "broadcast": "tensor, root_rank, name=None, process_set=global_process_set",
    "broadcast_async": "tensor, root_rank, name=None, process_set=global_process_set",
    "broadcast_": "tensor, root_rank, name=None, process_set=global_process_set",
    "broadcast_async_": "tensor, root_rank, name=None, process_set=global_process_set",
    "alltoall": "tensor, splits=None, name=None, process_set=global_process_set",
    "alltoall_async": "tensor, splits=None, name=None, process_set=global_process_set",
    "reducescatter": "tensor, name=None, compression=Compression.none, op=Average, "
                     "process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0",
    "reducescatter_async": "tensor, name=None, op=Average, process_set=global_process_set, "
                           "prescale_factor=1.0, postscale_factor=1.0",
    "grouped_reducescatter": "tensors, name=None, compression=Compression.none, op=Average, "
                             "process_set=global_process_set, prescale_factor=1.0, "
                             "postscale_factor=1.0",
    "grouped_reducescatter_async": "tensors, name=None, op=Average, "
                                   "process_set=global_process_set, prescale_factor=1.0, "
                                   "postscale_factor=1.0",
    "poll": "handle",
    "synchronize": "handle",
    "join": "device=-1",
    "barrier": "process_set=global_process_set",
    "broadcast_object": "obj, root_rank=0, name=None, process_set=global_process_set",
    "allgather_object": "obj, name=None, process_set=global_process_set",
    "start_timeline": "file_path, mark_cycles=False",
    "DistributedOptimizer": "optimizer, named_parameters=None, compression=Compression.none, "
                            "backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, "
                            "num_groups=0, groups=None, sparse_as_dense=False, "
                            "process_set=global_process_set",
    "SyncBatchNorm": "num_features, eps=1e-05, momentum=0.1, affine=True, "
                     "track_running_stats=True",
}

NO_ARGS = ["shutdown", "is_initialized", "size", "local_size", "cross_size", "rank", "local_rank",
           "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
           "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
           "rocm_built", "stop_timeline"]

OTHER = ["Compression", "HorovodInternalError", "ProcessSet", "global_process_set",
         "add_process_set", "remove_process_set", "broadcast_parameters",
         "broadcast_optimizer_state", "Average", "Sum", "Adasum", "Min", "Max", "Product"]


def _render(fn) -> str:
    sig = inspect.signature(fn.__init__ if inspect.isclass(fn) else fn)
    parts = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        if p.default is inspect.Parameter.empty:
            parts.append(p.name)
            continue
        d = p.default
        if d is hvd.global_process_set:
            text = "global_process_set"
        elif d is hvd.Compression.none:
            text = "Compression.none"
        elif p.name == "op" and d == hvd.Average and d is not None:
            text = "Average"
        else:
            text = repr(d)
        parts.append(f"{p.name}={text}")
    return ", ".join(parts)


# hvdlite-only keywords, appended after Horovod's parameters (so positional calls are unchanged).
EXTENSIONS = {
    "DistributedOptimizer": "zero_stage=0",
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_horovod(name):
    expected = SIGNATURES[name]
    if name in EXTENSIONS:
        expected += ", " + EXTENSIONS[name]
    assert _render(getattr(hvd, name)) == expected


@pytest.mark.parametrize("name", NO_ARGS + OTHER)
def test_name_exists(name):
    assert hasattr(hvd, name)


def test_reduce_op_values_match_horovod():
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)


def test_exceptions_are_importable_from_both_places():
    import hvdlite
    from hvdlite.common.exceptions import HorovodInternalError
    assert hvd.HorovodInternalError is HorovodInternalError
    assert issubclass(HorovodInternalError, RuntimeError)
    assert hvdlite.HorovodInternalError is HorovodInternalError


# ---------------------------------------------------------------------- behaviours (issue 10)
# Multi-process behaviours (exception classes on every rank, result dtypes, tf.function) are in
# test_compat.py; these need no job.
@pytest.mark.parametrize("ranks", [[2, 0, 1], reversed(range(3)), range(3), (1, 2, 0), {0, 1, 2},
                                   "numpy", "tensor"])
def test_process_set_takes_any_iterable_of_ranks_sorted(ranks):
    import numpy as np
    import torch
    if ranks == "numpy":
        ranks = np.array([2, 1, 0])
    elif ranks == "tensor":
        ranks = torch.tensor([1, 0, 2])
    ps = hvd.ProcessSet(ranks)
    assert ps.ranks == [0, 1, 2]
    assert ps == hvd.ProcessSet([0, 1, 2])


@pytest.mark.parametrize("bad", ["012", 3, [0, 0, 1], [0.5, 1]])
def test_process_set_refuses_non_rank_lists(bad):
    with pytest.raises(ValueError):
        hvd.ProcessSet(bad)


def test_alltoall_split_checks_are_value_errors():
    from hvdlite.common.validation import alltoall_splits
    assert alltoall_splits(None, 4, 2) is None
    assert alltoall_splits([3, 1], 4, 2) == (3, 1)
    for splits, dim0, size, needle in [(None, 5, 2, "divide evenly"), ([1, 1], 3, 2, "sum to"),
                                       ([1, 1, 1], 3, 2, "one count per rank"),
                                       ([4, -1], 3, 2, "negative")]:
        with pytest.raises(ValueError, match=needle):
            alltoall_splits(splits, dim0, size)


def test_reducescatter_adasum_is_horovod_internal_error_before_init():
    """Horovod's enqueue refuses it (Aborted, a RuntimeError) and its frontend re-raises that
    as HorovodInternalError, a RuntimeError too."""
    import torch
    with pytest.raises(hvd.HorovodInternalError, match="Adasum"):
        hvd.reducescatter(torch.ones(2), op=hvd.Adasum)


def test_tf_error_classes_are_horovods_and_hvdlites():
    tf = pytest.importorskip("tensorflow")
    from hvdlite.common.exceptions import HorovodInternalError, HorovodMismatchError
    from hvdlite.tensorflow.errors import as_tf_error
    e = as_tf_error(HorovodMismatchError("Mismatched shapes"))
    assert isinstance(e, tf.errors.FailedPreconditionError)
    assert isinstance(e, HorovodInternalError) and str(e) == "Mismatched shapes"
    e = as_tf_error(ValueError("bad splits"))
    assert isinstance(e, tf.errors.InvalidArgumentError) and isinstance(e, ValueError)
    e = as_tf_error(NotImplementedError("xla"))
    assert isinstance(e, tf.errors.UnimplementedError)
    # A broken job (a peer that left): Horovod's UnknownError, still a HorovodInternalError,
    # which elastic recovery catches.
    e = as_tf_error(HorovodInternalError("peer died"))
    assert isinstance(e, tf.errors.UnknownError) and isinstance(e, HorovodInternalError)
    assert not isinstance(e, HorovodMismatchError) and str(e) == "peer died"
    from hvdlite.common.exceptions import HostsUpdatedInterrupt
    other = HostsUpdatedInterrupt()
    assert as_tf_error(other) is other


def test_submodules_hold_what_horovods_hold():
    """Horovod's horovod.torch.mpi_ops defines the basics too (`from horovod.torch.mpi_ops
    import rank, size` is common), and horovod.torch.elastic re-exports init and shutdown:
    the same objects as hvdlite.torch's."""
    import hvdlite.torch.elastic as elastic
    import hvdlite.torch.mpi_ops as mpi_ops
    for name in NO_ARGS + ["init", "start_timeline", "add_process_set", "remove_process_set",
                           "ProcessSet", "global_process_set", "HorovodInternalError"]:
        assert getattr(mpi_ops, name) is getattr(hvd, name), name
    assert elastic.init is hvd.init and elastic.shutdown is hvd.shutdown
