"""`import hvdlite.tensorflow.keras as hvd`: Horovod's Keras API on Keras 3 (TensorFlow backend).

Uses the Keras that `tf.keras` resolves to: Keras 3, or Keras 2 (`tf_keras`) for scripts run with
`TF_USE_LEGACY_KERAS=1`, so Horovod-era Keras 2 scripts run unchanged.
"""
from .optimizer import check_backend as _check_backend

_check_backend()

import tensorflow as _tf  # noqa: E402

from ... import tensorflow as _hvd_tf  # noqa: E402
from ...tensorflow import (Adasum, Average, Compression, HorovodInternalError,  # noqa: E402
                           HostsUpdatedInterrupt, Max, Min, Product, ProcessSet, Sum,
                           add_process_set, allgather_object, broadcast_object,
                           broadcast_variables, ccl_built, cross_rank, cross_size, cuda_built,
                           ddl_built, gloo_built, gloo_enabled, global_process_set, init,
                           is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                           mpi_enabled, mpi_threads_supported, nccl_built, rank,
                           remove_process_set, rocm_built, shutdown, size, start_timeline,
                           stop_timeline)
from . import callbacks  # noqa: E402
from .optimizer import create_distributed_optimizer as _create  # noqa: E402
from .optimizer import is_distributed as _is_distributed  # noqa: E402
from .optimizer import is_keras3 as _is_keras3  # noqa: E402
from .optimizer import register_pending_layers as _register_pending_layers  # noqa: E402
from ..._keras_callbacks import local_layer_list as _local_layer_list  # noqa: E402


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras optimizer (SGD, Adam, AdamW, ... any `keras.optimizers.Optimizer`) so that
    gradients are averaged (or summed) over the ranks of `process_set` before each update.

    The result is an instance of the optimizer's own class name (saved models load with plain
    Keras). Use it in `model.compile(optimizer=...)` or call `apply_gradients`/`apply` in a custom
    loop; both reduce the gradients first.

    Arguments (Horovod 0.28):
        name: the optimizer's name (default: the wrapped optimizer's).
        device_dense, device_sparse: accepted for compatibility (hvdlite reduces on the host).
        compression: `Compression.none` or `Compression.fp16`.
        sparse_as_dense: reduce `tf.IndexedSlices` (embedding) gradients as dense tensors.
        gradient_predivide_factor: with `Average`, scale by 1/f before the sum and f/size after.
        op: `Average` (default) or `Sum`.
        backward_passes_per_step: accumulate gradients locally over this many steps, then reduce
            and apply once (the optimizer's `iterations` still counts every step).
        average_aggregated_gradients: divide the accumulated gradients by
            backward_passes_per_step (default: their sum).
        num_groups: deprecated alias of `groups`.
        groups: an int (split the gradients into that many groups) or a list of lists of
            variables; each group is reduced by one grouped allreduce.
        process_set: reduce over the ranks of this process set only.
        scale_local_gradients: divide the gradients of local variables (`register_local_var`)
            by the set size.
    """
    return _create(optimizer, name=name, device_dense=device_dense,
                   device_sparse=device_sparse, compression=compression,
                   sparse_as_dense=sparse_as_dense,
                   gradient_predivide_factor=gradient_predivide_factor, op=op,
                   backward_passes_per_step=backward_passes_per_step,
                   average_aggregated_gradients=average_aggregated_gradients,
                   num_groups=num_groups, groups=groups, process_set=process_set,
                   scale_local_gradients=scale_local_gradients)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average, groups=None,
                                process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A `DistributedOptimizer` that keeps the gradients of `local_layers` (a Keras layer or a
    list of them: a per-rank head, a rank's own embedding) local: they are not reduced, and
    with `scale_local_gradients` they are divided by the set size, as Horovod does. Horovod's
    `horovod.keras.PartialDistributedOptimizer`; the other arguments are DistributedOptimizer's.

    Layers that are not built yet (no variables before the model's first call) are registered
    when they are, before the first update."""
    layers = _local_layer_list(local_layers, _tf.keras.layers.Layer)
    opt = DistributedOptimizer(optimizer, name=name, device_dense=device_dense,
                               device_sparse=device_sparse, compression=compression,
                               sparse_as_dense=sparse_as_dense,
                               gradient_predivide_factor=gradient_predivide_factor, op=op,
                               groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    opt._hvd.pending_layers = layers
    _register_pending_layers(opt)
    return opt


def broadcast_global_variables(root_rank):
    """Broadcast all TF1 global variables from `root_rank` (TF1 graphs only; with Keras 3 use
    `BroadcastGlobalVariablesCallback` or `hvd.broadcast_variables(model.variables, 0)`)."""
    return _hvd_tf.broadcast_global_variables(root_rank)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Average (default) or reduce a value (tensor, NumPy array, number) over the ranks."""
    return _hvd_tf.allreduce(_tf.constant(value), average=average,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             op=op, compression=compression, name=name)


def allgather(value, name=None):
    """Concatenate every rank's value along its first dimension."""
    return _hvd_tf.allgather(_tf.constant(value), name=name)


def broadcast(value, root_rank, name=None):
    """The value of `root_rank` (a global rank), on every rank."""
    return _hvd_tf.broadcast(_tf.constant(value), root_rank, name=name)


def reducescatter(value, name=None, op=Average):
    """Reduce a value over the ranks and keep this rank's slice of its first dimension."""
    return _hvd_tf.reducescatter(_tf.constant(value), name=name, op=op)


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """Load a model saved with `model.save()` and wrap its optimizer in `DistributedOptimizer`
    (keeping its restored state), so training resumes distributed.

    `custom_optimizers` lists optimizer classes that Keras does not know by name;
    `custom_objects` is passed to `keras.models.load_model`. `legacy_opts` is accepted for
    Horovod compatibility (Keras 3 has no legacy optimizers).
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects.setdefault(cls.__name__, cls)
    model = _tf.keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not _is_distributed(opt):
        model.optimizer = DistributedOptimizer(opt, compression=compression)
        if hasattr(model, "train_function"):
            model.train_function = None
    return model


def __getattr__(name):
    if name == "elastic":
        import importlib
        return importlib.import_module(".elastic", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported",
    "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max",
    "Product", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer",
    "broadcast_global_variables", "allreduce",
    "allgather", "broadcast", "reducescatter", "load_model", "broadcast_variables",
    "broadcast_object", "allgather_object", "callbacks", "HorovodInternalError",
    "HostsUpdatedInterrupt",
]
