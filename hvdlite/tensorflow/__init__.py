"""`import hvdlite.tensorflow as hvd`: Horovod's TensorFlow API on hvdlite's engine.

Every collective works eagerly and inside `tf.function` (as a graph node that runs it each time the
graph runs), and has Horovod's gradient. See `hvdlite.tensorflow.keras` for Keras.
"""
import os as _os

try:
    import tensorflow as _tf
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError("hvdlite.tensorflow needs TensorFlow: pip install 'hvdlite[tensorflow]' "
                      "(or tensorflow / tensorflow-cpu >= 2.16)") from _exc

from ..common.basics import (ccl_built, cross_rank, cross_size, cuda_built,
                             ddl_built, gloo_built, gloo_enabled, is_homogeneous,
                             is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                             mpi_threads_supported, nccl_built, rank, rocm_built, size,
                             start_timeline, stop_timeline)
from ..common.ops import add_process_set, remove_process_set
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..common.process_sets import ProcessSet, global_process_set
from . import mpi_ops as _mpi_ops
from .compression import Compression
from .errors import eager_errors as _eager_errors
from .functions import (allgather_object, broadcast_object, broadcast_object_fn,
                        broadcast_variables)
from .gradient_aggregation import LocalGradientAggregationHelper
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .mpi_ops import init, shutdown
from .mpi_ops import (Adasum, Average, Max, Min, Product, Sum, _executing_eagerly, allgather,
                      alltoall, barrier, broadcast, broadcast_, check_num_rank_power_of_2,
                      grouped_allgather, handle_average_backwards_compatibility, join,
                      local_rank_op, local_size_op, process_set_included_op, rank_op, size_op)
from .optimizer import DistributedOptimizer


@_eager_errors
def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """Average (default) or reduce a tf.Tensor / tf.Variable over the ranks of `process_set`;
    a tf.IndexedSlices is reduced by allgathering its values and indices. Differentiable.

    Arguments (Horovod 0.28):
        average: deprecated, use `op`.
        device_dense, device_sparse: accepted for compatibility (hvdlite reduces on the host).
        compression: `Compression.none` or `Compression.fp16`.
        op: Average (default), Sum, Min, Max or Product (IndexedSlices: Average or Sum).
        prescale_factor, postscale_factor: multiply before / after the reduction.
        name: the collective's name, identical on every rank (default: derived from the call
            site eagerly, from a per-graph counter in tf.function).
        process_set: reduce over this process set only.
        ignore_name_scope: in a graph, do not prefix `name` with the current name scope.
    """
    op = handle_average_backwards_compatibility(op, average)
    if isinstance(tensor, _tf.IndexedSlices):
        return _mpi_ops._sparse_allreduce(tensor, op, name, process_set, ignore_name_scope,
                                          prescale_factor, postscale_factor)
    tensor = _tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    reduced = _mpi_ops._allreduce(compressed, name=name, op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor,
                                  ignore_name_scope=ignore_name_scope, process_set=process_set)
    return compression.decompress(reduced, ctx)


@_eager_errors
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Allreduce a list of tf.Tensor / tf.IndexedSlices together (negotiated and fused as one
    group); differentiable. Arguments as `allreduce`."""
    if not tensors:     # (eagerly it still takes part: mpi_ops._empty_grouped)
        _mpi_ops._grouped_allreduce([], name=name, ignore_name_scope=ignore_name_scope,
                                    process_set=process_set)
        return tensors
    op = handle_average_backwards_compatibility(op, average)
    out = [None] * len(tensors)
    dense_idx = [i for i, t in enumerate(tensors) if not isinstance(t, _tf.IndexedSlices)]
    sparse_idx = [i for i, t in enumerate(tensors) if isinstance(t, _tf.IndexedSlices)]
    for k, i in enumerate(sparse_idx):
        out[i] = _mpi_ops._sparse_allreduce(
            tensors[i], op, None if name is None else f"{name}.sparse_{k}", process_set,
            ignore_name_scope, prescale_factor, postscale_factor)
    if dense_idx:
        dense = [_tf.convert_to_tensor(tensors[i]) for i in dense_idx]
        compressed, ctxs = zip(*[compression.compress(t) for t in dense])
        reduced = _mpi_ops._grouped_allreduce(list(compressed), name=name, op=op,
                                              prescale_factor=prescale_factor,
                                              postscale_factor=postscale_factor,
                                              ignore_name_scope=ignore_name_scope,
                                              process_set=process_set)
        for i, r, c in zip(dense_idx, reduced, ctxs):
            out[i] = compression.decompress(r, c)
    return out


@_eager_errors
def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce `tensor` over the set and keep this rank's slice of dimension 0 (the first
    dim0 % size ranks get one row more); differentiable."""
    compressed, ctx = compression.compress(_tf.convert_to_tensor(tensor))
    reduced = _mpi_ops._reducescatter(compressed, name=name, op=op,
                                      ignore_name_scope=ignore_name_scope,
                                      process_set=process_set, prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor)
    return compression.decompress(reduced, ctx)


@_eager_errors
def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0, name=None, ignore_name_scope=False):
    """Reduce-scatter a list of tensors together; differentiable."""
    if not tensors:     # (eagerly it still takes part: mpi_ops._empty_grouped)
        _mpi_ops._grouped_reducescatter([], name=name, ignore_name_scope=ignore_name_scope,
                                        process_set=process_set)
        return tensors
    compressed, ctxs = zip(*[compression.compress(_tf.convert_to_tensor(t)) for t in tensors])
    reduced = _mpi_ops._grouped_reducescatter(list(compressed), name=name, op=op,
                                              ignore_name_scope=ignore_name_scope,
                                              process_set=process_set,
                                              prescale_factor=prescale_factor,
                                              postscale_factor=postscale_factor)
    return [compression.decompress(r, c) for r, c in zip(reduced, ctxs)]


def broadcast_global_variables(root_rank):
    """Broadcast all TF1 global variables from `root_rank` (TF1 graphs only)."""
    if _tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. Please use "
            "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(_tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(_tf.compat.v1.train.SessionRunHook):
    """TF1 SessionRunHook that broadcasts all global variables from `root_rank` when the session
    is created, so every rank starts from the same weights."""

    def __init__(self, root_rank, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self):
        if not self.bcast_op or self.bcast_op.graph != _tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord):
        session.run(self.bcast_op)


def __getattr__(name):
    # Loaded on first use: SyncBatchNormalization imports Keras (slow, and it follows
    # KERAS_BACKEND); `elastic` needs hvdlite's elastic runtime.
    import importlib
    if name == "SyncBatchNormalization":
        return importlib.import_module(".sync_batch_norm", __name__).SyncBatchNormalization
    if name == "elastic":
        return importlib.import_module(".elastic", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous", "rank_op",
    "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum", "Adasum",
    "Min", "Max", "Product", "handle_average_backwards_compatibility",
    "check_num_rank_power_of_2", "allreduce", "grouped_allreduce", "allgather",
    "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "grouped_reducescatter", "join", "barrier", "broadcast_variables", "broadcast_object",
    "broadcast_object_fn", "allgather_object", "broadcast_global_variables",
    "BroadcastGlobalVariablesHook", "Compression", "DistributedOptimizer",
    "DistributedGradientTape", "PartialDistributedGradientTape", "SyncBatchNormalization",
    "LocalGradientAggregationHelper", "HorovodInternalError", "HostsUpdatedInterrupt",
]
