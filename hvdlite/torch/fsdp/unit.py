"""The collectives of one `fully_shard` block: gather its parameters, reduce its gradients.

Both go through hvdlite.torch's grouped async ops, one grouped call per block, so the engine
negotiates, fuses and times them like any other collective, and a failure on one rank reaches
every rank's handle. Names are fixed per block (`fsdp.<id>.<class>.<what>`), so from the second
step on every call is a response-cache hit.
"""
from __future__ import annotations

import torch

from .. import mpi_ops as _mpi
from .params import ShardedParam, ShardGroup
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy


class FSDPUnit:
    """The state `fully_shard(module)` attaches to `module`.

    Attributes:
        module: The sharded module.
        label: Its class name and the order of the fully_shard call, for names and messages.
        params: Its parameters (those of its submodules that are not sharded by their own call).
        group: The ranks it is sharded (and replicated) over.
        reshard_after_forward: Free the gathered parameters after forward (gather again for
            backward); the root never does, its parameters are needed first in backward.
        requires_sync: False inside `no_sync()`: gradients stay gathered and accumulate.
    """

    def __init__(self, module: torch.nn.Module, uid: int, params: list[ShardedParam],
                 group: ShardGroup, reshard_after_forward: bool, mp: MixedPrecisionPolicy,
                 offload: CPUOffloadPolicy | None):
        self.module, self.uid, self.params, self.group = module, uid, params, group
        self.label = f"{type(module).__name__}#{uid}"
        self.reshard_after_forward = bool(reshard_after_forward)
        self.mp, self.offload = mp, offload
        self.requires_sync = True
        self.schedule = None          # set by the root at its first forward (schedule.Schedule)
        self._gather: int | None = None
        self._reduce: tuple[int, list[ShardedParam]] | None = None
        self.grad_params = [p for p in params if p.sharded.requires_grad]
        self.fired = 0
        base = f"fsdp.{uid}.{type(module).__name__}"
        self._names = {w: f"{base}.{w}" for w in ("unshard", "grad", "replicas")}

    # ------------------------------------------------------------------ parameters
    @property
    def gathered(self) -> bool:
        return bool(self.params) and all(p.gathered for p in self.params)

    def start_unshard(self) -> None:
        """Start the allgather of this block's shards unless it is gathered or under way."""
        if self._gather is not None or not self.params or self.gathered:
            return
        self._gather = _mpi.grouped_allgather_async([p.shard_to_send() for p in self.params],
                                                    name=self._names["unshard"],
                                                    process_set=self.group.shard)

    def unshard(self) -> None:
        """Gather the block's parameters (waiting for a prefetch that is under way)."""
        self.start_unshard()
        if self._gather is None:
            return
        handle, self._gather = self._gather, None
        for p, whole in zip(self.params, _mpi.synchronize(handle)):
            p.fill(whole)

    def reshard(self) -> None:
        """Free the gathered parameters (a prefetch under way is finished first: its name must
        not stay in flight into the next step)."""
        if self._gather is not None:
            _mpi.synchronize(self._gather)
            self._gather = None
        for p in self.params:
            p.free()

    def use_full(self) -> None:
        for p in self.params:
            p.use_full()

    def use_sharded(self) -> None:
        for p in self.params:
            p.use_sharded()

    def recover(self, group: ShardGroup | None = None) -> None:
        """After a failed step (elastic rollback): drop the collectives the failure left,
        free the gathered parameters and put the shards back in the module; with `group`, cut
        every parameter again over it."""
        self._gather, self._reduce, self.fired = None, None, 0
        for p in self.params:
            p.full.grad = None
            p.free()
            if group is not None:
                p.relayout(group)
            p.use_sharded()
        if group is not None:
            self.group = group
        if self.schedule is not None:
            self.schedule.depth, self.schedule.reducing = 0, None
            self.schedule.callback_queued = False

    # ------------------------------------------------------------------ gradients
    def reduce_dtype(self, p: ShardedParam) -> torch.dtype:
        return self.mp.reduce_dtype or self.mp.param_dtype or p.sharded.dtype

    def has_unreduced_grads(self) -> bool:
        return any(p.full.grad is not None for p in self.params)

    def start_reduce(self) -> None:
        """Reduce-scatter the gathered gradients (averaged over the shard group), asynchronously;
        `finish_reduce` adds them to the sharded gradients. Inside no_sync they stay."""
        if not self.requires_sync or self._reduce is not None:
            return
        todo = [(p, p.grad_to_reduce(self.reduce_dtype(p))) for p in self.params]
        todo = [(p, g) for p, g in todo if g is not None]
        for p in self.params:
            p.full.grad = None
        if not todo:
            return
        handle = _mpi.grouped_reducescatter_async([g for _, g in todo], name=self._names["grad"],
                                                  op=_mpi.Average, process_set=self.group.shard)
        self._reduce = (handle, [p for p, _ in todo])

    def finish_reduce(self) -> None:
        if self._reduce is None:
            return
        (handle, params), self._reduce = self._reduce, None
        reduced = list(_mpi.synchronize(handle))
        if self.group.replicate is not None:
            reduced = list(_mpi.synchronize(_mpi.grouped_allreduce_async(
                reduced, name=self._names["replicas"], op=_mpi.Average,
                process_set=self.group.replicate)))
        for p, g in zip(params, reduced):
            p.add_grad(g)
