"""Whole and sharded state of a fully sharded model and its optimizer.

`full_state_dict` / `full_optimizer_state_dict` gather (collectives over each block's shard
group) and return what a plain, unsharded model and optimizer load. `sharded_state_dict` is
local: every sharded value is a `LocalShard` (this rank's rows and where they sit in the whole
tensor), keyed by the model's parameter names, so the pieces saved on any number of ranks can be
loaded on any other (`load_sharded_state_dict` with every saved rank's dict, or a checkpoint
library reading the boxes it needs).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import mpi_ops as _mpi
from ..shard import LocalShard
from .params import ShardedParam


def _named_sharded(model: nn.Module) -> dict[str, ShardedParam]:
    """Every name under which `model.state_dict()` holds a sharded parameter (a tied weight
    has several)."""
    out: dict[str, ShardedParam] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            sp = getattr(p, "_hvd_fsdp", None) if p is not None else None
            if sp is not None:
                out[f"{mname}.{attr}" if mname else attr] = sp
    return out


def _units(model: nn.Module) -> list:
    seen, out = set(), []
    for m in model.modules():
        u = getattr(m, "_hvd_fsdp_unit", None)
        if u is not None and id(u) not in seen:
            seen.add(id(u))
            out.append(u)
    return out


def _gather_rows(pairs: list[tuple[ShardedParam, torch.Tensor]], name: str) -> list[torch.Tensor]:
    """Whole tensors from tensors shaped like each parameter's shard (padded rows gathered over
    its shard group), in one grouped allgather per shard group."""
    if not pairs:
        return []
    group = pairs[0][0].group
    send = []
    for sp, t in pairs:
        padded = t.new_zeros((sp.rows, *sp.rest))
        padded[:sp.valid].copy_(t)
        if padded.device != sp.compute_device:
            padded = padded.to(sp.compute_device)
        send.append(padded)
    whole = _mpi.synchronize(_mpi.grouped_allgather_async(send, name=name,
                                                          process_set=group.shard))
    return [w[:sp.dim0].to(t.device) for (sp, t), w in zip(pairs, whole)]


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """The whole model's state dict, on every rank (a collective over every shard group):
    `plain_model.load_state_dict(full_state_dict(model))` loads it."""
    sd = model.state_dict()
    names = _named_sharded(model)
    for u in _units(model):
        keys = [k for k, sp in names.items() if sp in u.params]
        whole = _gather_rows([(names[k], names[k].sharded.detach()) for k in keys],
                             f"fsdp.{u.uid}.state")
        for k, w in zip(keys, whole):
            sd[k] = w
    return sd


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _sharded_of(optimizer: torch.optim.Optimizer) -> list[ShardedParam | None]:
    return [getattr(p, "_hvd_fsdp", None) for p in _optimizer_params(optimizer)]


def _is_sharded_state(sp: ShardedParam | None, v: Any) -> bool:
    """An optimizer state tensor shaped like its parameter's shard (exp_avg, momentum_buffer),
    as opposed to a scalar such as Adam's step."""
    return sp is not None and torch.is_tensor(v) and v.dim() > 0 and \
        tuple(v.shape) == tuple(sp.sharded.shape)


def full_optimizer_state_dict(model: nn.Module | None,
                              optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict as a plain optimizer over the unsharded model would hold it
    (same parameter order), on every rank; a collective over every shard group (one grouped
    allgather per block, in the order of the optimizer's parameters). `model` may be None: the
    shards know their blocks."""
    osd = optimizer.state_dict()
    sps = _sharded_of(optimizer)
    state = {k: dict(v) for k, v in osd["state"].items()}
    units: list = []
    for sp in sps:
        if sp is not None and sp.unit not in units:
            units.append(sp.unit)
    for u in units:
        pairs, where = [], []
        for i, sp in enumerate(sps):
            if sp is None or sp.unit is not u or i not in state:
                continue
            for key, v in sorted(state[i].items()):
                if _is_sharded_state(sp, v):
                    pairs.append((sp, v))
                    where.append((i, key))
        for (i, key), w in zip(where, _gather_rows(pairs, f"fsdp.{u.uid}.optim")):
            state[i][key] = w
    return {"state": state, "param_groups": osd["param_groups"]}


def load_full_optimizer_state_dict(optimizer: torch.optim.Optimizer, full: dict[str, Any]) -> None:
    """Load a whole optimizer state dict (`full_optimizer_state_dict`'s, or a plain optimizer's
    over the unsharded model): each rank keeps its rows; no communication."""
    sps = _sharded_of(optimizer)
    state = {}
    for i, entry in full["state"].items():
        sp = sps[int(i)]
        state[i] = {k: (sp.my_rows(v).clone() if sp is not None and torch.is_tensor(v)
                        and v.dim() > 0 and tuple(v.shape) == sp.orig_shape else v)
                    for k, v in entry.items()}
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})


def sharded_state_dict(model: nn.Module,
                       optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """This rank's part of the model (and optimizer) state, with no communication.

    Returns:
        {"model": {name: LocalShard | tensor}} and, with `optimizer`, "optimizer": {"state":
        {param name: {key: LocalShard | value}}, "param_groups": [... "params": [param names]]}.
        Buffers and unsharded parameters are whole tensors (the same on every rank).
    """
    names = _named_sharded(model)
    out_model: dict[str, Any] = {}
    for k, v in model.state_dict().items():
        out_model[k] = names[k].local_shard() if k in names else v
    out: dict[str, Any] = {"model": out_model}
    if optimizer is None:
        return out
    fqn_of = _param_names(model)
    osd = optimizer.state_dict()
    params = _optimizer_params(optimizer)
    state: dict[str, Any] = {}
    for i, p in enumerate(params):
        if i not in osd["state"]:
            continue
        sp = getattr(p, "_hvd_fsdp", None)
        state[fqn_of[id(p)]] = {key: (sp.local_shard(v) if _is_sharded_state(sp, v) else v)
                                for key, v in osd["state"][i].items()}
    groups = []
    for g in osd["param_groups"]:
        groups.append({**g, "params": [fqn_of[id(params[i])] for i in g["params"]]})
    out["optimizer"] = {"state": state, "param_groups": groups}
    return out


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether `model` holds fully_shard's shards (its state dict then is `sharded_state_dict`'s
    and loads with `load_sharded_state_dict`)."""
    return bool(_named_sharded(model))


def optimizer_state_shard(param: torch.Tensor, value: Any) -> Any:
    """One optimizer state value of `param` (exp_avg, step) as a checkpoint writes it: a
    `LocalShard` of the whole parameter's shape where it is cut like the parameter's shard,
    else `value` itself (a scalar such as Adam's step, or a parameter not fully sharded)."""
    sp = getattr(param, "_hvd_fsdp", None)
    return sp.local_shard(value) if _is_sharded_state(sp, value) else value


def optimizer_state_box(param: torch.Tensor, global_shape: Sequence[int],
                        dtype: torch.dtype) -> LocalShard | None:
    """The empty box of a saved optimizer state tensor of `global_shape` that this rank holds
    for `param` (its own rows, on any number of ranks): what a checkpoint reads it into. None
    where `param` is not fully sharded or the tensor is not shaped like the whole parameter."""
    sp = getattr(param, "_hvd_fsdp", None)
    if sp is None or len(global_shape) == 0 or tuple(global_shape) != tuple(sp.orig_shape):
        return None
    return sp.local_shard(torch.empty(tuple(sp.sharded.shape), dtype=dtype))


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in `model` (tied parameters once)."""
    return {id(p): n for n, p in reversed(list(model.named_parameters()))}


def _assemble(sp: ShardedParam, pieces: list[LocalShard], what: str) -> torch.Tensor:
    """This rank's rows [start, start + valid) of a tensor saved as dim-0 boxes (any number of
    ranks, replicas allowed)."""
    out = torch.empty_like(sp.sharded.detach())
    covered = torch.zeros(sp.valid, dtype=torch.bool)
    lo, hi = sp.start, sp.start + sp.valid
    for piece in pieces:
        if tuple(piece.global_shape) != sp.orig_shape:
            raise ValueError(f"load_sharded_state_dict: {what} was saved with shape "
                             f"{tuple(piece.global_shape)} but the model's is {sp.orig_shape}")
        if any(piece.offsets[1:]) or tuple(piece.local.shape[1:]) != sp.rest:
            raise ValueError(f"load_sharded_state_dict: {what} was saved cut along another "
                             f"dimension than 0 (offsets {piece.offsets}); load it with the "
                             f"library that saved it")
        a, b = piece.offsets[0], piece.offsets[0] + piece.local.shape[0]
        s, e = max(a, lo), min(b, hi)
        if s < e:
            out[s - lo:e - lo].copy_(piece.local[s - a:e - a])
            covered[s - lo:e - lo] = True
    if not bool(covered.all()):
        missing = (~covered).nonzero().flatten()
        raise ValueError(f"load_sharded_state_dict: rows {lo + int(missing[0])}.. of {what} are "
                         f"in none of the given state dicts; pass every saved rank's dict")
    return out


def _as_list(state: dict | Sequence[dict]) -> list[dict]:
    return [state] if isinstance(state, dict) else list(state)


def load_sharded_state_dict(model: nn.Module, state: dict | Sequence[dict],
                            optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load what `sharded_state_dict` returned, on this or another number of ranks.

    Args:
        state: This rank's dict (same number of ranks), or every saved rank's dict (any number:
            each rank takes the rows it now holds from the boxes that cover them).
        optimizer: Also load the optimizer's part (saved with one).
    """
    dicts = _as_list(state)
    names = _named_sharded(model)
    model_sd = {}
    for k, v in dicts[0]["model"].items():
        if k in names:
            model_sd[k] = _assemble(names[k], [d["model"][k] for d in dicts], k)
        else:
            model_sd[k] = v.local if isinstance(v, LocalShard) else v
    with torch.no_grad():
        model.load_state_dict(model_sd)
    if optimizer is None:
        return
    if "optimizer" not in dicts[0]:
        raise ValueError("load_sharded_state_dict(optimizer=...): the state was saved without "
                         "an optimizer (sharded_state_dict(model, optimizer))")
    fqn_of = _param_names(model)
    params = _optimizer_params(optimizer)
    index = {fqn_of[id(p)]: i for i, p in enumerate(params)}
    saved = dicts[0]["optimizer"]
    state_out: dict[int, dict] = {}
    for fqn, entry in saved["state"].items():
        if fqn not in index:
            raise ValueError(f"load_sharded_state_dict: optimizer state for {fqn!r}, which this "
                             f"optimizer does not hold")
        i = index[fqn]
        sp = getattr(params[i], "_hvd_fsdp", None)
        state_out[i] = {key: (_assemble(sp, [d["optimizer"]["state"][fqn][key] for d in dicts],
                                        f"optimizer state {key!r} of {fqn}")
                              if isinstance(v, LocalShard) else v)
                        for key, v in entry.items()}
    groups = []
    for g in saved["param_groups"]:
        groups.append({**g, "params": [index[f] for f in g["params"]]})
    optimizer.load_state_dict({"state": state_out, "param_groups": groups})


def load_full_state_dict(model: nn.Module, full: dict[str, Any]) -> None:
    """Load a whole (unsharded) state dict: each rank keeps its rows; no communication."""
    names = _named_sharded(model)
    sd = {k: (names[k].my_rows(v) if k in names else v) for k, v in full.items()}
    with torch.no_grad():
        model.load_state_dict(sd)
