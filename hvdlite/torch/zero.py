"""ZeRO-style sharding for `hvd.DistributedOptimizer(..., zero_stage=1|2)`.

Why: with plain data parallelism every rank keeps the full optimizer state (Adam: two fp32
copies of the model) and the full averaged gradient. ZeRO (Rajbhandari et al., 2019) gives each
rank one shard of both, at the same communication volume.

Design:
- Whole parameters are owned by one rank each (as torch's `ZeroRedundancyOptimizer`), so any
  `torch.optim` optimizer stays exact, including ones with per-tensor statistics. Parameters are
  put into buckets in backward order (reverse registration, up to `HVDLITE_ZERO_BUCKET_BYTES`);
  inside each bucket they are dealt largest first to the least-loaded rank, so every bucket and
  the whole model are balanced by element count.
- Stage 1: gradients are allreduced from autograd hooks, exactly as stage 0 (engine fusion and
  overlap with backward kept). Stage 2: when a bucket's gradients are all ready its hook packs
  them into one buffer laid out rank by rank and starts a reducescatter, then drops the gradients
  this rank does not own; each rank ends with only its shard of the averaged gradient.
- `step()` runs the wrapped optimizer on the owned parameters only (so state exists only for
  them) and then allgathers the updated parameters, one collective per dtype.
- Only public collectives (`allreduce_async_`, `reducescatter_async`, `allgather_async`,
  `synchronize`, `allgather_object`) are used.
"""
from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from typing import Any

from ..common import basics, config

import torch

from .compression import drive_all, is_stateful
from .functions import allgather_object
from .parameters import named_parameters as named_parameters_of
from .parameters import remove_hooks
from .mpi_ops import (Average, Max, Sum, allgather_async, allreduce_async_, global_process_set,
                      reducescatter_async, synchronize)

ZERO_STAGES = (0, 1, 2)
_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def check_zero_stage(zero_stage: Any) -> int:
    """Validate the `zero_stage` keyword; returns it as an int."""
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES} (0: no sharding, 1: shard the "
                         f"optimizer state, 2: shard optimizer state and gradients); got "
                         f"{zero_stage!r}")
    return int(zero_stage)


def _bucket_bytes() -> int:
    v = config.raw("HVDLITE_ZERO_BUCKET_BYTES")
    return int(v) if v else _DEFAULT_BUCKET_BYTES


def _set_size_rank(process_set) -> tuple[int, int]:
    if process_set is None or process_set.process_set_id == 0:
        return basics.size(), basics.rank()
    return process_set.size(), process_set.rank()


class _Bucket:
    """Parameters of one dtype reduced together in stage 2, with their owner ranks."""

    def __init__(self, index: int, params: list, owners: dict, size: int) -> None:
        self.index = index
        self.params = params
        self.by_rank = [[p for p in params if owners[p] == r] for r in range(size)]
        self.seg = max([sum(p.numel() for p in ps) for ps in self.by_rank] + [1])
        self.dtype = params[0].dtype
        self.ready: set = set()
        self.handle = None


def partition(params_in_order: list, size: int, bucket_bytes: int):
    """Buckets (in backward order, one dtype each) and the owner rank of every parameter.

    Inside a bucket, parameters go largest first to the rank with the fewest elements in that
    bucket (ties: fewest elements overall, then lowest rank), which keeps both the per-bucket
    reducescatter padding and the per-rank state small.
    """
    buckets_params: list[list] = []
    current: dict = {}
    current_bytes: dict = {}
    for p in reversed(params_in_order):
        dt = p.dtype
        b = current.setdefault(dt, [])
        if b and current_bytes[dt] + p.numel() * p.element_size() > bucket_bytes:
            buckets_params.append(b)
            b = current[dt] = []
            current_bytes[dt] = 0
        b.append(p)
        current_bytes[dt] = current_bytes.get(dt, 0) + p.numel() * p.element_size()
    buckets_params.extend(b for b in current.values() if b)
    owners: dict = {}
    total = [0] * size
    order = {p: i for i, p in enumerate(params_in_order)}
    for bp in buckets_params:
        load = [0] * size
        for p in sorted(bp, key=lambda q: (-q.numel(), order[q])):
            r = min(range(size), key=lambda k: (load[k], total[k], k))
            owners[p] = r
            load[r] += p.numel()
            total[r] += p.numel()
    buckets = [_Bucket(i, bp, owners, size) for i, bp in enumerate(buckets_params)]
    return buckets, owners


class ZeroOptimizer:
    """Mixin placed before the user's optimizer class in the dynamic subclass built by
    `DistributedOptimizer(..., zero_stage=1|2)`; `_hvd_base` is the user's class."""

    _hvd_base = torch.optim.Optimizer
    _hvd_distributed = True

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, process_set=global_process_set,
                 zero_stage=1, defaults=None):
        self._hvd_zero_ready = False
        self._hvd_base.__init__(self, params)
        if defaults is not None:
            self.defaults = dict(defaults)
        named_sorted, wire_prefix = named_parameters_of(self.param_groups, named_parameters)
        if op not in (Average, Sum):
            raise ValueError("zero_stage 1 and 2 support op=hvd.Average or hvd.Sum")
        if isinstance(compression, type) and is_stateful(compression):
            compression = compression()
        if zero_stage == 2 and is_stateful(compression):
            raise ValueError(f"zero_stage=2 reduce-scatters gradient buckets and supports "
                             f"compression none or fp16, not {type(compression).__name__}; use "
                             f"zero_stage=1 with it")
        self._compression = compression
        self.zero_stage = zero_stage
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self._parameter_names = {v: k for k, v in named_sorted}
        self._wire_names = {v: wire_prefix + k for k, v in named_sorted}
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named_sorted}
        self._handles: dict = {}
        self._synchronized = False
        self._should_synchronize = True
        self._group_signature = self._signature()
        self._shard()
        self._grad_accs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._grad_accs.append(p.register_post_accumulate_grad_hook(
                        self._make_hook(p)))
        weakref.finalize(self, remove_hooks, list(self._grad_accs))
        self._hvd_zero_ready = True

    # ------------------------------------------------------------------ sharding
    def _all_params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]

    def _signature(self):
        return [tuple(id(p) for p in g["params"]) for g in self.param_groups]

    def _shard(self) -> None:
        """(Re)compute ownership for the current size of the process set."""
        self._size, self._rank = _set_size_rank(self.process_set)
        self._buckets, self._owners = partition(self._all_params(), self._size, _bucket_bytes())
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._owned = [p for p in self._all_params() if self._owners[p] == self._rank]
        self._owned_set = set(self._owned)

    def reshard(self) -> None:
        """Recompute the shards after the process set changed size (elastic reset). Keeps the
        state of parameters this rank still owns; load a full state dict afterwards to fill in
        the rest (the elastic state handler does)."""
        self._handles = {}
        for b in getattr(self, "_buckets", []):
            b.ready.clear()
            b.handle = None
        self._shard()
        for p in list(self.state.keys()):
            if p not in self._owned_set:
                del self.state[p]

    def add_param_group(self, param_group):
        if getattr(self, "_hvd_zero_ready", False):
            raise RuntimeError("Cannot add a parameter group to a sharded (zero_stage=1/2) "
                               "DistributedOptimizer: the shards were computed when it was "
                               "built. Rebuild the optimizer (add the group to the wrapped "
                               "optimizer and wrap it again).")
        return self._hvd_base.add_param_group(self, param_group)

    def _check_groups(self) -> None:
        if self._signature() != self._group_signature:
            raise RuntimeError("The parameter groups of a sharded (zero_stage=1/2) "
                               "DistributedOptimizer changed after it was built (parameters "
                               "added, removed or moved between groups). Rebuild the optimizer "
                               "with hvd.DistributedOptimizer(...) so the shards are recomputed.")

    def owned_parameters(self) -> list:
        """The parameters whose optimizer state this rank keeps and updates."""
        return list(self._owned)

    # ------------------------------------------------------------------ gradients
    def _scale_factors(self):
        if self.op == Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _make_hook(self, p):
        ref = weakref.ref(self)

        def hook(*ignore):
            opt = ref()
            if opt is None:
                return
            if opt._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times "
                    "before call to step(). Increase backward_passes_per_step to "
                    "accumulate gradients locally.")
            opt._allreduce_delay[p] -= 1
            if opt._allreduce_delay[p] == 0:
                opt._submit(p)
        return hook

    def _submit(self, p) -> None:
        if self.zero_stage == 1:
            self._handles[p] = self._allreduce_one(p)
            return
        bucket = self._bucket_of[p]
        bucket.ready.add(p)
        self._handles.setdefault(bucket, None)
        if len(bucket.ready) == len(bucket.params):
            self._handles[bucket] = self._reducescatter_bucket(bucket)

    def _allreduce_one(self, p):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            raise ValueError(f"zero_stage 1/2 does not support sparse gradients (parameter "
                             f"'{self._parameter_names.get(p)}'); use zero_stage=0")
        name = self._wire_names[p]
        pre, post = self._scale_factors()
        if is_stateful(self._compression):
            return self._compression.reduce_async(p.grad, name, op=self.op,
                                                  process_set=self.process_set), "stateful"
        compressed, ctx = self._compression.compress(p.grad)
        return allreduce_async_(compressed, name=name, op=self.op, prescale_factor=pre,
                                postscale_factor=post, process_set=self.process_set), ctx

    def _reducescatter_bucket(self, bucket: _Bucket):
        buf = torch.zeros(self._size * bucket.seg, dtype=bucket.dtype,
                          device=bucket.params[0].device)
        for r, ps in enumerate(bucket.by_rank):
            off = r * bucket.seg
            for q in ps:
                n = q.numel()
                if q.grad is not None:
                    if q.grad.is_sparse:
                        raise ValueError(f"zero_stage 2 does not support sparse gradients "
                                         f"(parameter '{self._parameter_names.get(q)}')")
                    buf[off:off + n].copy_(q.grad.reshape(-1))
                off += n
        # Gradients this rank does not own are not needed any more: free them now, bucket by
        # bucket, which is where stage 2 saves memory.
        for q in bucket.params:
            if self._owners[q] != self._rank:
                q.grad = None
        compressed, ctx = self._compression.compress(buf)
        pre, post = self._scale_factors()
        h = reducescatter_async(compressed, name=f"zero2.bucket.{bucket.index}", op=self.op,
                                process_set=self.process_set, prescale_factor=pre,
                                postscale_factor=post)
        return h, ctx

    def synchronize(self) -> None:
        """Finish every gradient reduction: afterwards each owned parameter's `.grad` holds the
        averaged gradient (stage 1: every parameter's does; stage 2: non-owned ones are None)."""
        if self.process_set.included() is False:
            self._synchronized = True
            return
        if self.zero_stage == 1:
            for p in self._all_params():
                if p.requires_grad and self._handles.get(p) is None:
                    self._handles[p] = self._allreduce_one(p)
            drive_all([h for h, _ in self._handles.values()])
            for p, (h, ctx) in self._handles.items():
                if ctx == "stateful":
                    out = h.result()
                else:
                    out = self._compression.decompress(synchronize(h), ctx)
                if out.data_ptr() != p.grad.data_ptr():
                    p.grad.copy_(out.view_as(p.grad))
        else:
            for b in self._buckets:
                if self._handles.get(b) is None:
                    if not any(q.requires_grad for q in b.params):
                        continue
                    self._handles[b] = self._reducescatter_bucket(b)
            for b, (h, ctx) in self._handles.items():
                seg = self._compression.decompress(synchronize(h), ctx)
                off = 0
                for q in b.by_rank[self._rank]:
                    n = q.numel()
                    g = seg[off:off + n].view_as(q)
                    if q.grad is None:
                        q.grad = g.clone()
                    else:
                        q.grad.copy_(g)
                    off += n
                b.ready.clear()
                b.handle = None
        self._handles.clear()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Make `step()` skip synchronization after an explicit `synchronize()`."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, computed across the shards.

        Synchronizes first (if needed); the following `step()` does not synchronize again.
        Returns the total norm, as `torch.nn.utils.clip_grad_norm_`. With stage 1 every rank
        holds every averaged gradient after `synchronize()`, so `torch.nn.utils.clip_grad_norm_`
        on all parameters is also right; with stage 2 only this method is.
        """
        if not self._synchronized:
            self.synchronize()
        norm_type = float(norm_type)
        grads = [p.grad for p in self._owned if p.grad is not None]
        dev = self._all_params()[0].device
        if norm_type == float("inf"):
            local = max([g.detach().abs().max().double() for g in grads]
                        + [torch.zeros((), dtype=torch.float64, device=dev)])
            total = synchronize(allreduce_async_(local.reshape(1).clone(), name="zero.clip.norm",
                                                 op=Max, process_set=self.process_set))[0]
        else:
            local = sum([g.detach().double().abs().pow(norm_type).sum() for g in grads],
                        torch.zeros((), dtype=torch.float64, device=dev))
            total = synchronize(allreduce_async_(local.reshape(1).clone(), name="zero.clip.norm",
                                                 op=Sum, process_set=self.process_set))[0]
            total = total.pow(1.0 / norm_type)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for p in self._all_params():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return total.to(self._all_params()[0].dtype)

    # ------------------------------------------------------------------ update
    def _base_step(self, closure=None):
        base_step = self._hvd_base.step
        if getattr(base_step, "hooked", False):
            base_step = base_step.__wrapped__
        return base_step(self, closure)

    def step(self, closure=None):
        self._check_groups()
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
        self._synchronized = False
        stashed = [g["params"] for g in self.param_groups]
        try:
            for g in self.param_groups:
                g["params"] = [p for p in g["params"] if p in self._owned_set]
            loss = self._base_step(closure)
        finally:
            for saved, g in zip(stashed, self.param_groups):
                g["params"] = saved
        self._gather_params()
        return loss

    def _gather_params(self) -> None:
        """Allgather the updated parameters, one flat buffer per dtype."""
        if self._size == 1:
            return
        by_dtype: dict = {}
        for p in self._all_params():
            by_dtype.setdefault(p.dtype, []).append(p)
        pending = []
        for dt, ps in by_dtype.items():
            mine = [p for p in ps if self._owners[p] == self._rank]
            flat = (torch.cat([p.detach().reshape(-1) for p in mine]) if mine
                    else torch.zeros(0, dtype=dt, device=ps[0].device))
            name = f"zero.allgather.{str(dt).replace('torch.', '')}"
            pending.append((ps, allgather_async(flat, name=name, process_set=self.process_set)))
        with torch.no_grad():
            for ps, h in pending:
                out = synchronize(h)
                off = 0
                for r in range(self._size):
                    for p in ps:
                        if self._owners[p] == r:
                            n = p.numel()
                            if r != self._rank:
                                p.copy_(out[off:off + n].view_as(p))
                            off += n

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        return self._hvd_base.zero_grad(self, set_to_none)

    # ------------------------------------------------------------------ state dicts
    def _index_names(self) -> list:
        return [self._parameter_names.get(p, f"param{i}") for i, p in
                enumerate(self._all_params())]

    def local_state_dict(self) -> dict:
        """This rank's shard only, in torch's format (state for owned parameters)."""
        return self._hvd_base.state_dict(self)

    def state_dict(self) -> dict:
        """The full, consolidated optimizer state that plain torch can load.

        A collective: every rank of the process set must call it (as checkpointing and
        `hvd.elastic.TorchState.commit()` do); each contributes its shard."""
        local = self._hvd_base.state_dict(self)
        if self._size == 1:
            return local
        shards = allgather_object({k: {n: (v.cpu() if torch.is_tensor(v) else v)
                                       for n, v in s.items()}
                                   for k, s in local["state"].items()},
                                  name="zero.state_dict", process_set=self.process_set)
        device_of = {i: p.device for i, p in enumerate(self._all_params())}
        state = {}
        for shard in shards:
            for k, s in shard.items():
                state[k] = {n: (v.to(device_of[k]) if torch.is_tensor(v) and v.dim() > 0 else v)
                            for n, v in s.items()}
        return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]}

    def _check_shapes(self, state_dict: dict) -> None:
        params = self._all_params()
        names = self._index_names()
        for k, s in state_dict.get("state", {}).items():
            if not isinstance(k, int) or k >= len(params):
                raise ValueError(f"optimizer state dict has state for parameter index {k!r}, "
                                 f"but the optimizer has {len(params)} parameters")
            p = params[k]
            for n, v in s.items():
                if not torch.is_tensor(v) or v.dim() == 0 or v.dim() != p.dim():
                    continue
                if any(a != b and a != 1 for a, b in zip(v.shape, p.shape)):
                    raise ValueError(f"optimizer state '{n}' for parameter '{names[k]}' has "
                                     f"shape {tuple(v.shape)} but the parameter has shape "
                                     f"{tuple(p.shape)}; the state dict belongs to a different "
                                     f"model")

    def load_local_state_dict(self, state_dict: dict) -> None:
        """Load this rank's own shard (from `local_state_dict()`), no filtering."""
        self._handles = {}
        self._synchronized = False
        self._hvd_base.load_state_dict(self, state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full (consolidated) state dict, keeping only this rank's shard."""
        self._check_shapes(state_dict)
        owned_idx = {i for i, p in enumerate(self._all_params()) if p in self._owned_set}
        local = {"state": {k: v for k, v in state_dict.get("state", {}).items()
                           if k in owned_idx},
                 "param_groups": state_dict["param_groups"]}
        self._handles = {}
        self._synchronized = False
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._hvd_base.load_state_dict(self, local)
        if is_stateful(self._compression):
            self._compression.reset()

    def state_bytes(self) -> int:
        """Bytes of optimizer-state tensors held by this rank (for memory accounting)."""
        return sum(v.numel() * v.element_size() for s in self.state.values()
                   for v in s.values() if torch.is_tensor(v))


def make_zero_optimizer(optimizer, named_parameters, compression, backward_passes_per_step,
                        op, gradient_predivide_factor, groups, sparse_as_dense, process_set,
                        zero_stage):
    """Build the dynamic subclass (user's class name kept) for zero_stage 1 or 2."""
    if groups is not None:
        warnings.warn("groups is ignored with zero_stage 1/2: stage 1 relies on the engine's "
                      "fusion, stage 2 on its own buckets", stacklevel=3)
    if sparse_as_dense:
        raise ValueError("sparse_as_dense is not supported with zero_stage 1/2")
    base = optimizer.__class__
    attrs = {"_hvd_base": base}
    cls = type(base.__name__, (ZeroOptimizer, base), attrs)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, process_set, zero_stage,
               defaults=getattr(optimizer, "defaults", None))


__all__ = ["ZeroOptimizer", "check_zero_stage", "partition", "ZERO_STAGES"]
