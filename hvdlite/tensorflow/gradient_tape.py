"""Horovod's `DistributedGradientTape` and `PartialDistributedGradientTape`.

The returned tape is an instance of a dynamically created subclass of the user's tape class (same
name), sharing the recorded tape, so `isinstance(tape, tf.GradientTape)` holds and both usages
work: wrapping a tape after its `with` block, or entering the wrapped tape itself.
"""
from __future__ import annotations

import tensorflow as tf

from .compression import Compression
from .._keras_callbacks import local_layer_list
from .gradients import GradientReducer, call_site, check_reduce_args
from .mpi_ops import Average, global_process_set


class _DistributedGradientTape:
    """Methods of the wrapper (first base of the dynamic subclass)."""

    _hvd_distributed = True

    def register_local_source(self, source):
        """Keep `source`'s gradient local: not reduced (divided by the set size when
        scale_local_gradients)."""
        self._hvd_reducer.register_local(source)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, *,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """The tape's gradients, reduced over the ranks of the process set."""
        site = call_site() if tf.executing_eagerly() else None
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = self._hvd_reducer.reduce(flat_grads, flat_sources,
                                           use_generic_names=use_generic_names, site=site)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False, *,
                                       unconnected_gradients=tf.UnconnectedGradients.NONE):
        """(local sources' (source, gradient) pairs, other sources' (source, reduced gradient)
        pairs), each a list in the order of `sources`, as Horovod's: for code that treats the
        two kinds differently."""
        flat_sources = tf.nest.flatten(sources)
        grads = self.gradient(target, flat_sources, output_gradients, use_generic_names,
                              unconnected_gradients=unconnected_gradients)
        pairs = list(zip(flat_sources, grads))
        local = [(s, g) for s, g in pairs if self._hvd_reducer.is_local(s)]
        shared = [(s, g) for s, g in pairs if not self._hvd_reducer.is_local(s)]
        return local, shared


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """A tape whose `gradient()` averages (or sums) the gradients over the ranks of
    `process_set` before returning them.

    Arguments (Horovod 0.28):
        gradtape: the `tf.GradientTape` (recorded already, or to be entered).
        device_dense, device_sparse: accepted for compatibility (hvdlite reduces on the host).
        compression: `Compression.none` or `Compression.fp16`.
        sparse_as_dense: reduce `tf.IndexedSlices` gradients as dense tensors.
        op: `Average` (default), `Sum`, `Min`, `Max` or `Product`.
        gradient_predivide_factor: with `Average`, scale by 1/f before the sum and f/size after.
        num_groups: deprecated alias of `groups`.
        groups: an int (split the gradients into that many groups) or a list of lists of
            variables; each group is reduced by one grouped allreduce.
        process_set: reduce over the ranks of this process set only.
        scale_local_gradients: divide the gradients of local sources
            (`register_local_source`) by the set size.
    """
    groups = check_reduce_args(op, gradient_predivide_factor, num_groups, groups)
    if not isinstance(gradtape, tf.GradientTape):
        raise ValueError(f"DistributedGradientTape wraps a tf.GradientTape, got "
                         f"{type(gradtape).__name__}")
    base = type(gradtape)
    cls = type(base.__name__, (_DistributedGradientTape, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__})
    tape = cls(persistent=gradtape._persistent,
               watch_accessed_variables=gradtape._watch_accessed_variables)
    # Share what the user's tape recorded (Horovod does the same).
    tape._tape = gradtape._tape
    tape._watched_variables = getattr(gradtape, "_watched_variables", ())
    tape._hvd_reducer = GradientReducer(
        "DistributedGradientTape", compression=compression, sparse_as_dense=sparse_as_dense,
        op=op, gradient_predivide_factor=gradient_predivide_factor, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A `DistributedGradientTape` that leaves the gradients of `local_layers` (Keras layers,
    e.g. a per-rank head) local. The other arguments are those of DistributedGradientTape."""
    local_layers = local_layer_list(local_layers, tf.keras.layers.Layer)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]
