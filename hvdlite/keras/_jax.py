"""`hvdlite.keras` on Keras 3's JAX backend (`KERAS_BACKEND=jax`).

Keras on JAX trains statelessly: `model.fit` runs `train_step` under `jax.jit` and the optimizer
update as `optimizer.stateless_apply`, which calls `apply(grads)` inside a StatelessScope. So the
wrapper is the one of the other backends, a subclass of the user's optimizer class whose `apply`
averages the gradients first, here with one grouped `hvdlite.jax` allreduce: inside the compiled
step an ordered host callback (hvdlite/jax/bridge.py), eagerly a DLPack hand-over.

`backward_passes_per_step=N` keeps its sums and its pass count in optimizer variables (a jitted
step can keep nothing else from one call to the next); on the N-th pass the sums are reduced
(the host callback sits in the taken branch of a `lax.cond`, so the others move nothing) and
applied; on the others the update is computed and thrown away (`jnp.where`), as Keras' own
gradient accumulation does on JAX, and only `iterations` advances.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np

from .. import jax as _hvd
from ..common import ops as _cops
from ..common.fusion import group_positions, resolve_groups
from ..common.messages import handle_average_backwards_compatibility
from ..jax import (Adasum, Average, Compression, HorovodInternalError,  # noqa: F401
                   HostsUpdatedInterrupt, Max, Min, Product, ProcessSet, Sum, add_process_set,
                   allgather_object, broadcast_object, ccl_built, cross_rank, cross_size,
                   cuda_built, ddl_built, gloo_built, gloo_enabled, global_process_set, init,
                   is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                   mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set,
                   rocm_built, shutdown, size, start_timeline, stop_timeline)
from .._keras_callbacks import built_layer_variables, local_layer_list
from ..jax import bridge as _bridge


def _concrete(values) -> bool:
    return not _bridge.traced([v for v in values if v is not None])


class _Distributed:
    """Methods of the wrapper (first base of the dynamic subclass)."""

    _hvd_distributed = True

    def register_local_var(self, var):
        """Keep `var`'s gradient local: not reduced (divided by the set size when
        scale_local_gradients), as Horovod's optimizers do."""
        self._hvd["local"][id(var)] = var

    def build(self, variables):
        super().build(variables)
        cfg = self._hvd
        if cfg["passes"] > 1 and not cfg["sums"]:
            cfg["sums"] = [self.add_variable_from_reference(v, "hvd_gradient_sum")
                           for v in variables]
            cfg["count"] = self.add_variable((), initializer="zeros", dtype="int32",
                                             name="hvd_passes")

    def _hvd_reduce(self, grads: list, variables) -> list:
        """`grads` averaged (or summed) over the set, the local variables' kept (divided by
        the set size with scale_local_gradients)."""
        cfg = self._hvd
        grads = list(grads)
        if cfg["local"] or isinstance(cfg["groups"], list):
            variables = list(variables if variables is not None else self._trainable_variables)
        local = set() if not cfg["local"] else \
            {i for i, v in enumerate(variables) if id(v) in cfg["local"]}
        present = [i for i, g in enumerate(grads) if g is not None and i not in local]
        included = cfg["process_set"].included() is not False
        if local and cfg["scale_local"] and included:
            n = cfg["process_set"].size()
            if n > 1:
                for i in local:
                    if grads[i] is not None:
                        grads[i] = grads[i] / n
        if present and included and _hvd.size() > 1:
            f = cfg["predivide"]
            pre, post = (1.0 / f, f) if f != 1.0 else (1.0, 1.0)
            for k, members in enumerate(group_positions(present, variables, cfg["groups"])):
                reduced = _hvd.grouped_allreduce(
                    [grads[i] for i in members], op=cfg["op"], compression=cfg["compression"],
                    name=f"{self.name}.DistributedOptimizer" + (f".group_{k}" if k else ""),
                    prescale_factor=pre, postscale_factor=post, process_set=cfg["process_set"])
                for i, r in zip(members, reduced):
                    grads[i] = r
        return grads

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        _register_pending_layers(self)
        if self._hvd["passes"] > 1:
            return self._hvd_apply_accumulated(grads, trainable_variables)
        return super().apply(self._hvd_reduce(grads, trainable_variables), trainable_variables)

    def _hvd_apply_accumulated(self, grads: list, trainable_variables):
        cfg = self._hvd
        variables = list(trainable_variables if trainable_variables is not None
                         else self._trainable_variables)
        if not self.built:
            self.build(variables)
            self.built = True
        n = cfg["passes"] if cfg["average_aggregated"] else 1
        sums = [None if g is None else s.value + g for s, g in zip(cfg["sums"], grads)]
        count = cfg["count"].value + 1
        update = count >= cfg["passes"]

        def reduced():
            return self._hvd_reduce([None if s is None else s / n for s in sums], variables)

        if _concrete(grads + [count]):
            if not bool(update):
                for var, s in zip(cfg["sums"], sums):
                    if s is not None:
                        var.assign(s)
                cfg["count"].assign(count)
                self.iterations.assign_add(1)
                return None
            out = super().apply(reduced(), trainable_variables)
            self._hvd_reset_accumulation()
            return out
        present = [i for i, s in enumerate(sums) if s is not None]
        values = jax.lax.cond(update, lambda: [reduced()[i] for i in present],
                              lambda: [jnp.zeros_like(sums[i]) for i in present])
        full = [None] * len(sums)
        for i, v in zip(present, values):
            full[i] = v
        kept = [v for v in variables] + [v for v in self.variables
                                         if v is not self._iterations]
        before = [v.value for v in kept]
        super().apply(full, trainable_variables)
        for v, old in zip(kept, before):
            v.assign(jnp.where(update, v.value, old))
        for var, s in zip(cfg["sums"], sums):
            if s is not None:
                var.assign(jnp.where(update, jnp.zeros_like(s), s))
        cfg["count"].assign(jnp.where(update, 0, count).astype("int32"))
        return None

    def _hvd_reset_accumulation(self) -> None:
        """Drop the passes added up since the last reduction (an elastic reset, on every rank:
        a rank that joined, or one restored to the last commit, would otherwise count the
        passes to the next reduction differently, and the ranks' reductions would not pair)."""
        cfg = self._hvd
        for var in cfg["sums"]:
            var.assign(jnp.zeros(var.shape, var.dtype))
        if cfg["count"] is not None:
            cfg["count"].assign(0)


_CLASSES: dict = {}


def _distributed_class(base):
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(base.__name__, (_Distributed, base),
                                    {"__module__": base.__module__,
                                     "__qualname__": base.__qualname__,
                                     "__doc__": base.__doc__})
    return cls


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras 3 optimizer so that gradients are averaged (or summed) over the ranks of
    `process_set` before each update (Horovod's arguments; see hvdlite.tensorflow.keras).
    `compression`: hvdlite.jax's (none, fp16)."""
    if op not in (Average, Sum):
        raise ValueError("op currently only supports Average and Sum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    groups = resolve_groups(groups, num_groups, "keras.Variable")
    if getattr(optimizer, "_hvd_distributed", False):
        raise ValueError(f"{type(optimizer).__name__} is already a hvdlite DistributedOptimizer")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(f"hvdlite.keras.DistributedOptimizer wraps Keras optimizers, got "
                         f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    new = _distributed_class(type(optimizer)).from_config(config)
    object.__setattr__(new, "_hvd", {"compression": compression, "op": op,
                                     "predivide": float(gradient_predivide_factor),
                                     "process_set": process_set, "groups": groups,
                                     "passes": int(backward_passes_per_step),
                                     "average_aggregated": bool(average_aggregated_gradients),
                                     "sums": [], "count": None, "local": {},
                                     "scale_local": bool(scale_local_gradients),
                                     "pending_layers": []})
    return new


def _register_pending_layers(optimizer) -> None:
    """Register the variables of the local layers built since the last call
    (PartialDistributedOptimizer; _keras_callbacks.built_layer_variables)."""
    cfg = optimizer._hvd
    if cfg["pending_layers"]:
        found, cfg["pending_layers"] = built_layer_variables(cfg["pending_layers"])
        for var in found:
            optimizer.register_local_var(var)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average, groups=None,
                                process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A `DistributedOptimizer` that keeps the gradients of `local_layers` (a Keras layer or a
    list of them) local: not reduced, and divided by the set size with
    `scale_local_gradients` (Horovod's `horovod.keras.PartialDistributedOptimizer`)."""
    layers = local_layer_list(local_layers, keras.layers.Layer)
    opt = DistributedOptimizer(optimizer, name=name, device_dense=device_dense,
                               device_sparse=device_sparse, compression=compression,
                               sparse_as_dense=sparse_as_dense,
                               gradient_predivide_factor=gradient_predivide_factor, op=op,
                               groups=groups, process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    opt._hvd["pending_layers"] = layers
    _register_pending_layers(opt)
    return opt


def _as_jax(value):
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        return value
    return jnp.asarray(np.asarray(keras.ops.convert_to_numpy(value)
                                  if hasattr(value, "shape") else value))


def broadcast_global_variables(root_rank):
    """TF1 graphs only in Horovod; there are no global variables on the JAX backend."""
    raise NotImplementedError("broadcast_global_variables() needs TF1 global variables; use "
                              "hvdlite.keras.callbacks.BroadcastGlobalVariablesCallback(0) or "
                              "hvdlite.keras.broadcast_variables")


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Average (default) or reduce a value (array, NumPy array, number) over the ranks; a
    jax.Array (the backend's tensor type)."""
    op = handle_average_backwards_compatibility(op, average)
    return _hvd.allreduce(_as_jax(value), name=name, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, compression=compression)


def allgather(value, name=None):
    """Concatenate every rank's value along its first dimension."""
    return _hvd.allgather(_as_jax(value), name=name)


def broadcast(value, root_rank, name=None):
    """The value of `root_rank`, on every rank."""
    return _hvd.broadcast(_as_jax(value), root_rank, name=name)


def reducescatter(value, name=None, op=Average):
    """Reduce a value over the ranks and keep this rank's slice of its first dimension."""
    return _hvd.reducescatter(_as_jax(value), name=name, op=op)


def broadcast_variables(variables, root_rank, process_set=global_process_set):
    """Assign `root_rank`'s values to Keras variables on every rank (one grouped broadcast)."""
    variables = list(variables)
    values = [_bridge.to_buffer(_as_jax(v.value)) for v in variables]
    # One grouped broadcast: ranks whose models differ (or one with none, an empty list: it
    # takes part too, common.ops._empty_group) fail at once with both counts.
    results = _cops.broadcast(values, root_rank,
                              names=[f"keras.bcast.{i}" for i in range(len(values))],
                              process_set=process_set, group="keras.bcast").wait()
    for v, r in zip(variables, results):
        v.assign(_bridge.from_buffer(r))


def _average_numbers(values: list, name: str) -> list:
    """The ranks' average of a list of numbers, in float64 (a jax.Array would be float32
    unless JAX runs with x64)."""
    (out,) = _cops.allreduce([_bridge.to_buffer(np.array(values, np.float64))], names=[name],
                             op=Average).wait()
    return out.tolist()


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """Load a saved model and wrap its optimizer in `DistributedOptimizer` (state kept)."""
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not getattr(opt, "_hvd_distributed", False):
        new = DistributedOptimizer(opt, compression=compression)
        if getattr(opt, "built", False):
            new.build(model.trainable_variables)
            for d, s in zip(new.variables, opt.variables):
                d.assign(s)
        model.optimizer = new
        model.train_function = None
    return model


__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported",
    "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max",
    "Product", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer",
    "broadcast_global_variables", "allreduce",
    "allgather", "broadcast", "reducescatter", "load_model", "broadcast_variables",
    "broadcast_object", "allgather_object", "HorovodInternalError", "HostsUpdatedInterrupt",
]
