"""`fully_shard(module)`: FSDP2's entry point on hvdlite's engine, and the checks it makes first.

Call it on each block, then on the root, and train with a plain torch.optim optimizer over
`model.parameters()` (the shards). The call is a collective over the whole job: every rank
reports what it is about to shard, so a mistake on one rank (a module sharded twice, a parameter
already sharded with another block, a process set the rank is not in, a model that differs)
fails on every rank with one message instead of leaving the others waiting.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...common import basics as _basics
from ...common import elastic as _elastic
from ...common.process_sets import ProcessSet, global_process_set
from ..functions import allgather_object
from .params import ShardedParam, ShardGroup
from .policies import check_policies
from .schedule import make_post_accumulate, post_forward, pre_forward
from .unit import FSDPUnit

_calls = {"n": 0}


class FSDPModule:
    """Mixed into the class of every module `fully_shard` was called on (as FSDP2 does), so
    the model keeps its own class and gains these methods."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: backward accumulates gathered gradients without reducing them (gradient
        accumulation); the next backward with True reduces the sum."""
        for u in _units_of(self) if recurse else [self._hvd_fsdp_unit]:
            u.requires_sync = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block (DDP's and FSDP1's name for
        `set_requires_gradient_sync(False)`); the first backward after it reduces them."""
        units = _units_of(self)
        before = [u.requires_sync for u in units]
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for u, b in zip(units, before):
                u.requires_sync = b

    def unshard(self) -> None:
        """Gather this module's parameters now (they stay gathered until `reshard()` or the
        next forward of the root)."""
        self._hvd_fsdp_unit.unshard()

    def reshard(self) -> None:
        """Free this module's gathered parameters."""
        self._hvd_fsdp_unit.reshard()


_classes: dict[type, type] = {}


def _units_of(module: nn.Module) -> list[FSDPUnit]:
    return [m._hvd_fsdp_unit for m in module.modules() if hasattr(m, "_hvd_fsdp_unit")]


def _fsdp_class(cls: type) -> type:
    if cls not in _classes:
        _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _classes[cls]


def _resolve_sets(process_set: Any) -> tuple[ProcessSet, ProcessSet | None]:
    """(shard set, replicate set): a ProcessSet shards over it; a Mesh (parallel.mesh) shards
    over its dp_shard groups and replicates over dp_replicate; None takes the current mesh's,
    else the whole job."""
    from ..parallel.groups import Mesh, current_mesh
    if process_set is None:
        process_set = current_mesh() or global_process_set
    if isinstance(process_set, Mesh):
        return process_set.dp_shard, (process_set.dp_replicate
                                      if process_set.dp_replicate_size > 1 else None)
    if isinstance(process_set, tuple) and len(process_set) == 2:
        return process_set[0], process_set[1]
    return process_set, None


def _own_params(module: nn.Module) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(name inside module, owning submodule, attribute, parameter) for every parameter slot of
    `module` outside the submodules sharded by their own call."""
    out = []

    def walk(prefix: str, m: nn.Module, top: bool) -> None:
        if not top and hasattr(m, "_hvd_fsdp_unit"):
            return
        for attr, p in m._parameters.items():
            if p is not None:
                out.append((prefix + attr, m, attr, p))
        for name, child in m._modules.items():
            if child is not None:
                walk(f"{prefix}{name}.", child, False)

    walk("", module, True)
    return out


def _local_problem(label: str, module: nn.Module, slots: list, shard: Any) -> str | None:
    if hasattr(module, "_hvd_fsdp_unit"):
        return (f"{label} is already sharded by fully_shard ({module._hvd_fsdp_unit.label}); "
                f"call fully_shard once per module (a call on a parent covers its children "
                f"that have no call of their own)")
    if not isinstance(shard, ProcessSet) or shard.process_set_id is None:
        return (f"fully_shard({label}, process_set={shard!r}): not a registered process set; "
                f"pass one from hvd.add_process_set / hvd.init(process_sets=...) or a mesh from "
                f"hvdlite.torch.parallel.mesh")
    if not shard.included():
        return (f"fully_shard({label}): rank {_basics.rank()} is not in its process_set (ranks "
                f"{shard.ranks}); pass a set this rank belongs to (each rank its own group's, "
                f"as parallel.mesh(...).dp_shard gives)")
    for fqn, _m, _a, p in slots:
        owner = getattr(p, "_hvd_fsdp_owner", None)
        if owner is not None:
            return (f"parameter {fqn!r} of {label} is already sharded by fully_shard on "
                    f"{owner}: a parameter shared by blocks sharded separately would be "
                    f"reduced twice; call fully_shard on a common parent of both blocks "
                    f"instead of on each of them (or untie the parameter)")
        if p.dim() == 0:
            return (f"parameter {fqn!r} of {label} is a scalar; fully_shard cuts parameters "
                    f"along dimension 0: make it a tensor of shape [1]")
    return None


def _agree(label: str, report: dict) -> None:
    """One allgather over the whole job; every rank raises the same error if any rank has a
    problem, or if ranks of one shard group differ in what they shard.

    In an elastic job the check is this rank's alone: a worker that joins later builds and
    shards its model while the others are already training, so no collective may be made."""
    if _elastic.is_elastic():
        if report["problem"]:
            raise ValueError(f"fully_shard({label}) refused: {report['problem']}")
        return
    reports = allgather_object(report, name=f"fsdp.check.{report['call']}",
                               process_set=global_process_set)
    problems = [f"rank {r}: {rep['problem']}" for r, rep in enumerate(reports) if rep["problem"]]
    if problems:
        raise ValueError(f"fully_shard({label}) refused on every rank:\n  " +
                         "\n  ".join(problems[:8]))
    by_group: dict = {}
    for r, rep in enumerate(reports):
        for key in ("shard", "replicate"):
            if rep[key]:
                by_group.setdefault((key, tuple(rep[key])), []).append(r)
    for (_key, ranks), members in sorted(by_group.items()):
        if sorted(members) != sorted(ranks):
            raise ValueError(
                f"fully_shard({label}): ranks {sorted(members)} shard over process set "
                f"{list(ranks)} but ranks {sorted(set(ranks) - set(members))} of that set "
                f"passed another one; every rank of a shard group must pass the same set")
        first = reports[members[0]]
        for r in members[1:]:
            if reports[r]["desc"] != first["desc"]:
                a, b = first["desc"], reports[r]["desc"]
                diff = next((f"{x} vs {y}" for x, y in zip(a, b) if x != y),
                            f"{len(a)} parameters vs {len(b)}")
                raise ValueError(
                    f"fully_shard({label}): rank {r}'s module differs from rank {members[0]}'s "
                    f"({first['module']} vs {reports[r]['module']}; first difference: {diff}); "
                    f"every rank must build the same model, with the same parameter shapes and "
                    f"dtypes, before sharding it")


def fully_shard(module: nn.Module, *, process_set: Any = None, reshard_after_forward: bool = True,
                mp_policy: Any = None, offload_policy: Any = None) -> nn.Module:
    """Shard `module`'s parameters along dimension 0 over `process_set` (ZeRO-3, FSDP2).

    Args:
        module: A block (call on each first) or the root (last).
        process_set: The ranks to shard over: a ProcessSet, a `parallel.mesh(...)` (shard over
            its dp_shard group, replicate over dp_replicate: hybrid sharding), or None for the
            current mesh or else every rank.
        reshard_after_forward: Free the gathered parameters after forward and gather them again
            for backward (less memory, one more allgather per block).
        mp_policy: A MixedPrecisionPolicy.
        offload_policy: CPUOffloadPolicy() keeps shards, gradients and optimizer state on the
            CPU (nothing changes on a CPU-only job).

    Returns:
        `module`, whose class now also derives from FSDPModule.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    _calls["n"] += 1
    call = _calls["n"]
    label = f"{type(module).__name__} (fully_shard call {call})"
    mp, offload = check_policies(label, mp_policy, offload_policy)
    shard, replicate = _resolve_sets(process_set)
    slots = [] if hasattr(module, "_hvd_fsdp_unit") else _own_params(module)
    problem = _local_problem(label, module, slots, shard)
    if problem is None and replicate is not None and not replicate.included():
        problem = f"rank {_basics.rank()} is not in the replicate set {replicate.ranks}"
    unique: dict[int, list] = {}
    for fqn, m, attr, p in slots:
        unique.setdefault(id(p), []).append((fqn, m, attr, p))
    desc = [(entries[0][0], tuple(entries[0][3].shape), str(entries[0][3].dtype))
            for entries in unique.values()]
    _agree(label, {"call": call, "problem": problem, "module": type(module).__name__,
                   "desc": desc, "shard": list(shard.ranks or []) if problem is None else None,
                   "replicate": list(replicate.ranks) if replicate is not None and problem is None
                   else None})

    group = ShardGroup(shard, replicate)
    params = []
    for entries in unique.values():
        p = entries[0][3]
        device = p.device
        storage = torch.device("cpu") if offload is not None else device
        sp = ShardedParam(entries[0][0], p, [(m, attr) for _f, m, attr, _p in entries], group,
                          mp.param_dtype, device, storage, offload is not None and
                          offload.pin_memory)
        p._hvd_fsdp_owner = label
        sp.sharded._hvd_fsdp = sp
        sp.uid = call
        sp.use_sharded()
        params.append(sp)
    unit = FSDPUnit(module, call, params, group, reshard_after_forward, mp, offload)
    for sp in params:
        sp.unit = unit
    for sp in unit.grad_params:
        sp.full.register_post_accumulate_grad_hook(make_post_accumulate(unit))
    module._hvd_fsdp_unit = unit
    module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(post_forward, prepend=False)
    module.__class__ = _fsdp_class(type(module))
    return module


def sharded_param_of(p: torch.Tensor) -> ShardedParam | None:
    """The ShardedParam behind a parameter the optimizer sees, or None for a plain one."""
    return getattr(p, "_hvd_fsdp", None)


def refuse_distributed_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """DistributedOptimizer over fully sharded parameters would reduce gradients a second time."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            sp = sharded_param_of(p)
            if sp is not None:
                raise ValueError(
                    f"hvd.DistributedOptimizer: parameter {sp.fqn!r} is sharded by fully_shard, "
                    f"whose backward already reduce-scatters its gradient; use the plain "
                    f"torch.optim optimizer over model.parameters() instead. For compressed "
                    f"gradients pass fully_shard(mp_policy=MixedPrecisionPolicy(reduce_dtype="
                    f"torch.float16 or torch.bfloat16)); int8 and PowerSGD need whole gradients "
                    f"and do not apply to sharded ones")
