"""When each block is gathered, freed and reduced: the hooks `fully_shard` installs.

Forward: a block's pre-hook gathers it (waiting for its prefetch) and starts the allgather of the
block that came next in the previous step's forward; its post-hook frees it again
(reshard_after_forward) and hooks the gradients of its outputs. Backward: the first gradient
reaching a block's outputs gathers it again and prefetches the block before it; once every
gradient of the block is accumulated its reduce-scatter starts (the previous block's is finished
first, so one reduction overlaps the backward of the next block at a time). At the end of
backward a callback reduces what is left, finishes every reduction and frees every block.

The root (the outermost sharded module, the first whose forward runs) keeps its parameters
gathered from its forward to its backward, where they are needed first.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from .unit import FSDPUnit


class Schedule:
    """The step-by-step state shared by the blocks under one root."""

    def __init__(self, root: FSDPUnit, units: list[FSDPUnit]):
        self.root, self.units = root, units
        self.order: list[FSDPUnit] = []        # this step's forward order
        self.last_order: list[FSDPUnit] = []   # the previous step's (forward prefetch)
        self.depth = 0
        self.callback_queued = False
        self.reducing: FSDPUnit | None = None

    def begin(self) -> None:
        """A new forward of the root: whatever the last one left gathered (a forward without
        backward) is freed first, so an optimizer step in between is never missed."""
        if self.order:
            self.last_order = self.order
        self.order = []
        for u in self.units:
            u.reshard()

    def record(self, unit: FSDPUnit) -> None:
        if unit not in self.order:
            self.order.append(unit)

    def prefetch_forward(self, unit: FSDPUnit) -> None:
        order = self.last_order
        if unit in order:
            i = order.index(unit) + 1
            if i < len(order) and order[i] is not self.root:
                order[i].start_unshard()

    def prefetch_backward(self, unit: FSDPUnit) -> None:
        """Start gathering the block whose backward comes next: the last block of the forward
        after the root, else the one before `unit`."""
        rest = [u for u in self.order if u is not self.root]
        if unit is self.root:
            nxt = rest[-1] if rest else None
        else:
            i = rest.index(unit) if unit in rest else 0
            nxt = rest[i - 1] if i > 0 else None
        if nxt is not None:
            nxt.start_unshard()

    def reduce(self, unit: FSDPUnit) -> None:
        """Start `unit`'s reduce-scatter after finishing the one before it."""
        if self.reducing is not None and self.reducing is not unit:
            self.reducing.finish_reduce()
        unit.start_reduce()
        self.reducing = unit

    def queue_final(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        try:
            for u in self.units:
                if u.requires_sync and u.has_unreduced_grads():
                    self.reduce(u)
            for u in self.units:
                u.finish_reduce()
                u.reshard()
        finally:
            self.reducing = None
            self.callback_queued = False


# ---------------------------------------------------------------------- hooks
def _cast(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree
    return tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point()
                    and t.dtype != dtype else t, tree)


def _attach_schedule(unit: FSDPUnit) -> Schedule:
    """The first forward of a block with no schedule makes it a root, over the blocks below."""
    units = [m._hvd_fsdp_unit for m in unit.module.modules() if hasattr(m, "_hvd_fsdp_unit")]
    sched = Schedule(unit, units)
    for u in units:
        if u.schedule is None or u.schedule.root is u:
            u.schedule = sched
    unit.reshard_after_forward = False
    return sched


def pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict):
    unit: FSDPUnit = module._hvd_fsdp_unit
    sched = unit.schedule
    if sched is None:
        sched = _attach_schedule(unit)
    if sched.depth == 0 and sched.root is unit:
        sched.begin()
    sched.depth += 1
    unit.unshard()
    if torch.is_grad_enabled():
        sched.prefetch_forward(unit)
    sched.record(unit)
    unit.use_full()
    if unit.mp.cast_forward_inputs and unit.mp.param_dtype is not None:
        args, kwargs = _cast((args, kwargs), unit.mp.param_dtype)
    return args, kwargs


def post_forward(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    unit: FSDPUnit = module._hvd_fsdp_unit
    sched: Schedule = unit.schedule
    sched.depth = max(0, sched.depth - 1)
    unit.use_sharded()
    if torch.is_grad_enabled():
        if unit.reshard_after_forward:
            unit.reshard()
        tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads, unit=unit: pre_backward(unit), mode="any")
    elif unit is not sched.root or sched.depth == 0:
        unit.reshard()
    return _cast(output, unit.mp.output_dtype)


def pre_backward(unit: FSDPUnit) -> None:
    sched: Schedule = unit.schedule
    sched.queue_final()
    unit.fired = 0
    unit.unshard()
    sched.prefetch_backward(unit)


def make_post_accumulate(unit: FSDPUnit):
    """The hook on each gathered parameter: once the block's last gradient is in, free the block
    and start its reduce-scatter (the end-of-backward callback catches a block some of whose
    parameters got no gradient)."""
    def hook(_param: torch.Tensor) -> None:
        unit.fired += 1
        if unit.fired == len(unit.grad_params) and unit.schedule is not None:
            unit.reshard()
            unit.schedule.reduce(unit)
    return hook
