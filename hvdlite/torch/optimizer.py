"""Horovod's `hvd.DistributedOptimizer` for PyTorch: allreduce every gradient as soon as autograd
has accumulated it (or, where the engine sends a step's gradients as one bucket anyway, all of
them together when backpropagation ends), and wait for all of them in `step()`.

The wrapper is a dynamically created subclass of the user's optimizer class (same class name), so
checkpoints and `isinstance` checks keep working, exactly as in Horovod.
"""
from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager

import torch

from ..common import adasum as _adasum
from ..common import basics as _basics
from ..common import ops as _ops
from ..common.elastic import may_resize
from ..common.fusion import resolve_groups, split_list
from .compression import Compression, NoneCompressor, drive_all, is_stateful
from . import zero as _zero
from .flat_grads import FlatGradients
from .fsdp.api import refuse_distributed_optimizer
from .functions import broadcast_object
from .parameters import find_duplicates
from .parameters import named_parameters as _named_parameters
from .parameters import remove_hooks as _remove_hooks
from .mpi_ops import (Adasum, Average, Sum, _allreduce_batch_async, allreduce_async_,
                      global_process_set, grouped_allreduce_async_, sparse_allreduce_async,
                      synchronize)


# The handle a deferred gradient holds until backpropagation ends (_DistributedOptimizer._defer).
_DEFERRED = object()

# The id of the backward pass running on this thread (torch >= 2.1; None: gradients are never
# deferred).
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


class _HookedOptimizer(torch.optim.Optimizer):
    """The half both wrappers share: wire names for the parameters, one hook per parameter that
    counts backward passes and starts its reduction, and the bookkeeping around the wrapped
    optimizer (`_hvd_base`). Subclasses say what a ready gradient starts
    (`_gradient_ready`) and how `step()` finishes. Methods are copied into the dynamic subclass
    of the user's optimizer class (see `_wrapper_class`)."""

    _hvd_base = torch.optim.Optimizer
    _hvd_distributed = True

    def _setup(self, params, named_parameters, compression, backward_passes_per_step,
               defaults) -> list:
        self._hvd_base.__init__(self, params)
        if defaults is not None:
            # Keep the user's defaults (Horovod would fall back to the class defaults), so that
            # add_param_group() later behaves as on the wrapped optimizer.
            self.defaults = dict(defaults)
        self._compression = compression
        named_sorted, wire_prefix = _named_parameters(self.param_groups, named_parameters)
        self._parameter_names = {v: k for k, v in named_sorted}
        self._wire_names = {v: wire_prefix + k for k, v in named_sorted}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: self.backward_passes_per_step for _, v in named_sorted}
        self._handles = {}
        self._grad_accs = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True
        return named_sorted

    def _compress(self, tensor):
        if self._compression is NoneCompressor:   # the default: no call on the hot path
            return tensor, None
        return self._compression.compress(tensor)

    def _decompress(self, tensor, ctx):
        if self._compression is NoneCompressor:
            return tensor
        return self._compression.decompress(tensor, ctx)

    def load_state_dict(self, *args, **kwargs):
        self._forget_pending()
        return self._hvd_base.load_state_dict(self, *args, **kwargs)

    def _forget_pending(self) -> None:
        """Forget the gradients in flight and the backward passes counted since the last step:
        the next pass starts a step afresh (a loaded state, an elastic reset). (Subclasses
        extend it by calling this one by its class: the methods are copied into a class built
        on the user's optimizer, _wrapper_class, where super() would not find it.)"""
        self._handles = {}
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def _drop_partial_step(self) -> None:
        """After an elastic reset, on every rank (torch/elastic/state.py): when some backward
        passes of a step were already counted (`backward_passes_per_step` > 1, or a pass whose
        step never came), forget them and their gradients (`p.grad = None`), so that every
        rank, a newly joined one included, counts the passes to the next reduction from 0.
        Otherwise a survivor one pass into a step of 2 reduced after one more pass while the
        new rank waited for two: their collectives no longer paired up. (With Adasum, only a
        parameter whose passes were all in has been stepped locally and holds its delta while
        in flight; only a failure leaves one so, and the state's restore() has put the
        committed model back before this reset.)"""
        partial = bool(self._handles) or any(
            d != self.backward_passes_per_step for d in self._allreduce_delay.values())
        if not partial:
            return
        self._forget_pending()
        for p in self._allreduce_delay:
            p.grad = None

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def _hook_parameters(self):
        for param_group in self.param_groups:
            for p in param_group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    self._grad_accs.append(
                        p.register_post_accumulate_grad_hook(self._make_hook(p)))
        # The hooks hold the optimizer weakly; once it is gone (say, re-created with a new
        # learning rate) its hooks are removed instead of submitting allreduces nobody waits on.
        weakref.finalize(self, _remove_hooks, list(self._grad_accs))

    def _gradient_ready(self, p):
        """Start reducing p's gradient: (handle, ctx), or None when it was taken elsewhere."""
        return self._allreduce_grad_async(p)

    def _make_hook(self, p):
        ref = weakref.ref(self)

        def hook(*ignore):
            opt = ref()
            if opt is None:
                return
            if p in opt._handles and opt._handles[p][0] is not None:
                if opt._allreduce_delay[p] <= 0:
                    raise AssertionError(
                        "Gradients were computed more than backward_passes_per_step times "
                        "before call to step(). Increase backward_passes_per_step to "
                        "accumulate gradients locally.")
            assert not p.grad.requires_grad
            assert opt._allreduce_delay[p] > 0
            handle, ctx = None, None
            opt._allreduce_delay[p] -= 1
            if opt._allreduce_delay[p] == 0:
                started = opt._gradient_ready(p)
                if started is None:
                    return
                handle, ctx = started
            opt._handles[p] = (handle, ctx)
        return hook

    def _base_step(self, closure=None):
        base_step = self._hvd_base.step
        if getattr(base_step, "hooked", False):
            # This class's own step is already wrapped by torch's step-hook/profiler wrapper;
            # call the base implementation underneath it so step hooks run once.
            base_step = base_step.__wrapped__
        return base_step(self, closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        return self._hvd_base.zero_grad(self, set_to_none)


def _wrapper_class(base: type, impl: type) -> type:
    """A subclass of the user's optimizer class `base` (same name) with `impl`'s methods."""
    attrs = {}
    for klass in reversed(impl.__mro__):
        if klass in (torch.optim.Optimizer, object) or not issubclass(klass, _HookedOptimizer):
            continue
        attrs.update({k: v for k, v in klass.__dict__.items()
                      if k not in ("__dict__", "__weakref__")})
    attrs["_hvd_base"] = base
    return type(base.__name__, (base,), attrs)


class _DistributedOptimizer(_HookedOptimizer):
    """Average (or sum) gradients over the process set: each gradient's allreduce starts from its
    hook; `step()` waits for all of them, then steps the wrapped optimizer."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set, defaults=None):
        self._setup(params, named_parameters, compression, backward_passes_per_step, defaults)
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        if resolve_groups(groups, 0, "torch.Tensor") is not None:
            if isinstance(groups, list):
                grouped_parameter_ids = set()
                for group in groups:
                    for p in group:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("groups must consist of torch.Tensor.")
                        if id(p) in grouped_parameter_ids:
                            raise ValueError("A parameter can only appear once in groups.")
                        grouped_parameter_ids.add(id(p))
        self._groups = groups
        self._p_to_group = {}
        self._group_counts = {}
        self._deferred: list = []          # parameters whose gradient waits for the end of
        self._deferred_task = None         # this backward pass (_defer)

        if self.process_set.included() and (_basics.size() > 1 or may_resize()):
            self._register_hooks()
        # Gradients as views of one flat buffer where the engine sends whole passes
        # (flat_grads.py): only for a reduction that is the same element by element over one
        # buffer as over each gradient (no groups, no compression, Average or Sum).
        self._flat = (FlatGradients() if self._grad_accs and groups is None
                      and compression is NoneCompressor and op in (Average, Sum)
                      and _graph_task_id is not None else None)

    def _forget_pending(self) -> None:
        _HookedOptimizer._forget_pending(self)
        self._deferred, self._deferred_task = [], None
        self._synchronized = False
        self._should_synchronize = True

    find_duplicates = staticmethod(find_duplicates)

    def _register_hooks(self):
        if self._groups is not None:
            p_list = [p for param_group in self.param_groups for p in param_group["params"]
                      if p.requires_grad]
            # Every rank forms the groups in the parameter order of the set's first rank
            # (Horovod used global rank 0, which is not a member of every process set).
            root = self.process_set.ranks[0] if self.process_set.ranks else 0
            p_list_names = [self._parameter_names.get(p) for p in p_list]
            p_list_names = broadcast_object(p_list_names, root_rank=root,
                                            process_set=self.process_set)
            p_list = sorted(p_list,
                            key=lambda p: p_list_names.index(self._parameter_names.get(p)))
            if isinstance(self._groups, list):
                p_groups = []
                grouped_id = set()
                p_list_ids = {id(p) for p in p_list}
                for group in self._groups:
                    p_groups.append([p for p in group if id(p) in p_list_ids])
                    grouped_id.update(id(p) for p in p_groups[-1])
                for p in p_list:
                    if id(p) not in grouped_id:
                        p_groups.append([p])
            else:
                p_groups = split_list(p_list, self._groups)
            p_groups = [tuple(g) for g in p_groups if len(g) > 0]
            for group in p_groups:
                for p in group:
                    self._p_to_group[p] = group
                self._group_counts[group] = 0
        self._hook_parameters()

    def _scale_factors(self):
        if self.op == Average:
            # The engine applies the extra 1/size to postscale for Average, as Horovod's C++.
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            # No gradient this step (unused parameter); another rank may have one, so every rank
            # still submits the same tensor. (Cannot know here whether it would be sparse.)
            p.grad = p.data.new(p.size()).zero_()

        name = self._wire_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if self.sparse_as_dense:
                tensor = tensor.to_dense()
            else:
                return self._sparse_allreduce_grad_async(p, name)

        if is_stateful(self._compression):
            # 8-bit / PowerSGD: the compressor runs its own collectives (see zero.py too).
            return self._compression.reduce_async(tensor, name, op=self.op,
                                                  process_set=self.process_set), None
        tensor_compressed, ctx = self._compress(tensor)
        prescale_factor, postscale_factor = self._scale_factors()
        handle = allreduce_async_(tensor_compressed, name=name, op=self.op,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor,
                                  process_set=self.process_set)
        return handle, ctx

    def _grouped_allreduce_grad_async(self, ps):
        name = self._wire_names.get(ps[0])
        # A sparse gradient inside an explicit group is reduced dense (written back sparse).
        dense = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in ps]
        tensors_compressed, ctxs = zip(*[self._compress(t) for t in dense])
        prescale_factor, postscale_factor = self._scale_factors()
        handle = grouped_allreduce_async_(list(tensors_compressed), name=name, op=self.op,
                                          prescale_factor=prescale_factor,
                                          postscale_factor=postscale_factor,
                                          process_set=self.process_set)
        return handle, ctxs

    def _sparse_allreduce_grad_async(self, p, name):
        handle = sparse_allreduce_async(p.grad, name=name, op=self.op,
                                        process_set=self.process_set)
        return handle, None

    def _gradient_ready(self, p):
        if self._groups is None:
            if self._flat is not None and self._flat.owns(p):
                self._flat.gradient_ready(p)       # into its view of the flat buffer
            if self._defers(p):
                return self._defer(p)
            return self._allreduce_grad_async(p)
        group = self._p_to_group[p]
        self._group_counts[group] += 1
        if self._group_counts[group] == len(group):
            self._handles[group] = self._grouped_allreduce_grad_async(group)
            # Drop the placeholders left by the group's earlier hooks.
            for gp in group:
                self._handles.pop(gp, None)
            self._group_counts[group] = 0
            return None
        return None, None

    def _defers(self, p) -> bool:
        """Whether p's gradient waits for the end of this backward pass (_defer): a dense,
        contiguous CPU gradient with a wire name, no stateful compressor, and an engine that
        sends a step's CPU gradients as one bucket anyway. Anything else (a GPU gradient, whose
        transfer overlaps backpropagation; a host with cores to spare; buckets off) is
        submitted from its hook, as in Horovod."""
        grad = p.grad
        return (_graph_task_id is not None and grad.is_cpu and not grad.is_sparse
                and grad.is_contiguous() and p in self._wire_names
                and not is_stateful(self._compression) and _ops.whole_pass())

    def _defer(self, p):
        """Keep p for one submission of every deferred gradient when backpropagation ends
        (_submit_deferred, queued once per backward pass with autograd's final callback).

        Why: where the engine holds a step's gradients until the last one is in
        (ops.whole_pass), a gradient submitted from its hook only waits there, while the
        submission's Python ran in the middle of backpropagation with its caches cold: ~100-190
        us per gradient, 2.3 ms of the CNN's and 5 ms of the transformer's backward pass on 2
        ranks. Submitted together, the same requests (same names, each its own collective)
        cost one call with warm caches; a rank that submits them one by one instead still
        agrees with this one, as holding is rank-local."""
        task = _graph_task_id()
        if task != self._deferred_task:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._submit_deferred)
            except RuntimeError:            # not in a backward pass the engine runs
                return self._allreduce_grad_async(p)
            self._deferred_task = task
        self._deferred.append(p)
        return _DEFERRED, None

    def _submit_deferred(self) -> None:
        """Submit the deferred gradients in one call (each its own named allreduce, in place,
        as allreduce_async_ would) and give each parameter its handle."""
        ps, self._deferred, self._deferred_task = self._deferred, [], None
        if self._flat is not None and self._flat.active:
            # Members of the flat buffers wait for synchronize() (flat_grads.py), keeping
            # their _DEFERRED handles.
            ps = [p for p in ps if not self._flat.owns(p)]
        if not ps:
            return
        tensors, ctxs = [], []
        for p in ps:
            tensor, ctx = self._compress(p.grad)
            tensors.append(tensor)
            ctxs.append(ctx)
        prescale_factor, postscale_factor = self._scale_factors()
        handles = _allreduce_batch_async(tensors, [self._wire_names[p] for p in ps], self.op,
                                         prescale_factor, postscale_factor, self.process_set)
        for p, handle, ctx in zip(ps, handles, ctxs):
            self._handles[p] = (handle, ctx)

    @staticmethod
    def _write_back(p, aggregated):
        if p.grad.is_sparse:
            if not aggregated.is_sparse:
                # sparse_as_dense: back to sparse before the update.
                aggregated = aggregated.to_sparse()
            # Sparse tensors do not support set_; this is the equivalent.
            p.grad.zero_().add_(aggregated)
        else:
            if aggregated.is_sparse:
                aggregated = aggregated.to_dense()
            if aggregated is not p.grad:     # (a deferred gradient is reduced in p.grad itself)
                p.grad.set_(aggregated)

    def synchronize(self):
        """Wait for every gradient allreduce and write the results into `p.grad`."""
        if self.process_set is not global_process_set and not self.process_set.included():
            self._synchronized = True
            return

        if self._deferred:      # a backward pass that did not reach its end (it raised)
            self._submit_deferred()
        flat = self._flat
        owned = flat.views if flat is not None and flat.usable() else {}
        completed = set()
        for x in self._handles.keys():
            if isinstance(x, tuple):
                completed.update(x)
            else:
                completed.add(x)
        missing_p = self._requires_update - completed
        for p in missing_p:
            if p not in owned:
                self._handles[p] = self._allreduce_grad_async(p)

        for p, (handle, _ctx) in list(self._handles.items()):
            if p in owned:          # (not a tuple: groups never take the flat path)
                del self._handles[p]
            elif handle is None or handle is _DEFERRED:
                # _DEFERRED: its submission raised, or the flat path was just left.
                self._handles[p] = self._allreduce_grad_async(p)
        if owned:
            for p in owned:
                self._allreduce_delay[p] = self.backward_passes_per_step
            flat.reduce(self.op, *self._scale_factors(), self.process_set)

        drive_all([handle for handle, _ in self._handles.values()])
        for p, (handle, ctx) in self._handles.items():
            if isinstance(p, tuple):
                outputs = synchronize(handle)
                for gp, output, gctx in zip(p, outputs, ctx):
                    self._allreduce_delay[gp] = self.backward_passes_per_step
                    self._write_back(gp, self._decompress(output, gctx))
                if self._groups is not None and self._group_counts[p] != 0:
                    self._group_counts[p] = 0
            else:
                # A callable handle (sparse allreduce) returns the aggregated tensor itself.
                output = handle() if callable(handle) else synchronize(handle)
                self._allreduce_delay[p] = self.backward_passes_per_step
                if self._groups is not None:
                    group = self._p_to_group[p]
                    if self._group_counts[group] != 0:
                        self._group_counts[group] = 0
                self._write_back(p, self._decompress(output, ctx))
        self._handles.clear()
        if flat is not None and flat.needs_agreement():
            flat.agree(self._requires_update, self._wire_names, self.process_set)
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Make `step()` skip synchronization, after an explicit `synchronize()`:

            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without "
                              "optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._base_step(closure)


class _DistributedAdasumOptimizer(_HookedOptimizer):
    """Horovod's delta formulation of Adasum: as soon as a parameter's gradient is ready, step
    the wrapped optimizer on that parameter alone, then Adasum-allreduce the change it made
    (new - start) in place; `step()` waits and sets every parameter to start + combined delta.

    Adasum combines the ranks' updates rather than their gradients, so the wrapped optimizer's
    own scaling (learning rate, momentum, Adam's normalisation) applies before the combination.
    """

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 defaults=None):
        named_sorted = self._setup(params, named_parameters, compression,
                                   backward_passes_per_step, defaults)
        self.op = Adasum
        self.process_set = global_process_set
        # The parameters' values before the local step: delta = new - start.
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False)
                                 for _, p in named_sorted}
        self._hook_parameters()

    def _allreduce_grad_async(self, p):
        """Step the wrapped optimizer on p alone, turn p into the delta, Adasum it in place."""
        start = self._starting_models[p]
        stashed = []
        for group in self.param_groups:
            stashed.append(group["params"])
            group["params"] = [p] if any(p is v for v in group["params"]) else []
        try:
            start.data.copy_(p.data)
            self._base_step()
        finally:
            for saved, group in zip(stashed, self.param_groups):
                group["params"] = saved
        p.data.sub_(start)
        tensor_compressed, ctx = self._compress(p.data)
        handle = allreduce_async_(tensor_compressed, name=self._wire_names.get(p), op=Adasum)
        return handle, ctx

    def synchronize(self):
        """Nothing to do: with Adasum the reduction happens in step()."""

    @contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum "
                             "optimizer.")
        yield  # pragma: no cover

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Parameters whose hook did not fire (no gradient this step) still take part, so every
        # rank submits the same tensors; their local step leaves them unchanged (delta 0).
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, ctx) in list(self._handles.items()):
            if handle is None:   # step() before backward_passes_per_step passes: reduce now
                handle, ctx = self._allreduce_grad_async(p)
                self._handles[p] = (handle, ctx)
        for p, (handle, ctx) in self._handles.items():
            delta = self._decompress(synchronize(handle), ctx)
            start = self._starting_models[p]
            start.data.add_(delta.data.view_as(start))
            p.data.copy_(start)
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss


def DistributedOptimizer(optimizer, named_parameters=None,
                         compression=Compression.none,
                         backward_passes_per_step=1,
                         op=Average,
                         gradient_predivide_factor=1.0,
                         num_groups=0, groups=None,
                         sparse_as_dense=False,
                         process_set=global_process_set,
                         zero_stage=0):
    """Wrap `optimizer` so that gradients are averaged (or summed) over the ranks of
    `process_set` before every update.

    Allreduces start from autograd hooks as soon as each gradient is ready and overlap the rest
    of `loss.backward()`; `step()` waits for them. For gradient clipping call `synchronize()`
    first and then `step()` inside `skip_synchronize()`.

    Arguments (as Horovod 0.28):
        named_parameters: (name, parameter) pairs naming the allreduces, usually
            `model.named_parameters()`; default names are `allreduce.noname.<group>.<index>`.
        compression: `Compression.none` or `Compression.fp16`.
        backward_passes_per_step: backward passes accumulated locally before one allreduce.
        op: `Average` (default), `Sum`, or `Adasum` (global process set, power-of-two number
            of ranks): each rank steps the wrapped optimizer locally and the parameter changes
            are combined with Adasum (Horovod's `_DistributedAdasumOptimizer`).
        gradient_predivide_factor: with `Average`, scale by 1/f before the sum and f/size after.
        num_groups: deprecated alias of `groups`.
        groups: an int (split the parameters into that many groups) or a list of lists of
            parameters; each group is reduced by one grouped allreduce once all of it is ready.
        sparse_as_dense: reduce sparse gradients as dense tensors.
        process_set: reduce only over the ranks of this process set.
        zero_stage (hvdlite): 0 (default) keeps a full optimizer state on every rank; 1 shards
            the optimizer state over the ranks of `process_set`; 2 shards the averaged
            gradients too (reducescatter). See `hvdlite.torch.zero`.
        compression (hvdlite additions): `Compression.int8` (8-bit with error feedback) and
            `Compression.powersgd(rank=r)` (low rank with error feedback), class or instance.
    """
    refuse_distributed_optimizer(optimizer)     # fully_shard's gradients are reduced already
    zero_stage = _zero.check_zero_stage(zero_stage)
    if isinstance(compression, type) and is_stateful(compression):
        compression = compression()   # per-tensor state belongs to this optimizer
    if is_stateful(compression):
        if op == Adasum:
            raise ValueError("stateful compression (int8, powersgd) cannot be used with Adasum")
        if groups is not None or num_groups:
            raise ValueError("stateful compression (int8, powersgd) reduces tensor by tensor; "
                             "do not pass groups/num_groups with it")
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor is not supported with stateful "
                             "compression (int8, powersgd)")
    if gradient_predivide_factor != 1.0:
        if _basics.rocm_built():
            raise ValueError("gradient_predivide_factor not supported yet with ROCm")
        if op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")

    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")

    groups = resolve_groups(groups, num_groups, "torch.Tensor")

    if zero_stage:
        if op == Adasum:
            raise ValueError("zero_stage 1/2 cannot be combined with op=Adasum")
        return _zero.make_zero_optimizer(optimizer, named_parameters, compression,
                                         backward_passes_per_step, op,
                                         gradient_predivide_factor, groups, sparse_as_dense,
                                         process_set, zero_stage)

    base = optimizer.__class__
    if op == Adasum and _basics.size() > 1:
        if process_set != global_process_set:
            raise NotImplementedError(_adasum.NON_GLOBAL_SET)
        if not _adasum.is_power_of_two(_basics.size()):
            raise NotImplementedError(_adasum.NON_POWER_OF_TWO)
        if any(p.device.type != "cpu" for group in optimizer.param_groups
               for p in group["params"]):
            raise NotImplementedError(_adasum.GPU_TENSOR)
        cls = _wrapper_class(base, _DistributedAdasumOptimizer)
        return cls(optimizer.param_groups, named_parameters, compression,
                   backward_passes_per_step, defaults=getattr(optimizer, "defaults", None))

    cls = _wrapper_class(base, _DistributedOptimizer)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, groups, sparse_as_dense, process_set,
               defaults=getattr(optimizer, "defaults", None))


__all__ = ["DistributedOptimizer"]
