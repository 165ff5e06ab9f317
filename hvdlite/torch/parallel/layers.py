"""Tensor-parallel layers (Megatron's ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding) on hvdlite process sets.

Initialisation is independent of the tensor-parallel size: every rank draws the full weight with
the same initialiser torch's own layer uses (nn.Linear / nn.Embedding, or `init_method`) from the
default generator, then keeps its slice. So with the same seed and construction order, the shard of
a tp=k layer is bit-identical to the matching slice of the tp=1 layer, and of the plain torch layer.
(The full weight exists once per rank during construction, as with Megatron's
`use_cpu_initialization`.)

Sharded parameters carry `tensor_parallel=True`, `partition_dim` and `tp_process_set`, which
`gather_state_dict` / `load_full_state_dict` use to move between sharded and full tensors.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import _comm
from .groups import default_tp_set
from .mappings import (copy_to_tensor_parallel_region, gather_from_tensor_parallel_region,
                       reduce_from_tensor_parallel_region, scatter_to_tensor_parallel_region)

_uids: dict = {}


def _collective_name(kind: str, ps) -> str:
    """A stable name prefix for one layer's collectives, identical on every rank of its
    tensor-parallel group (they construct the same layers in the same order). Stable names let
    the engine's response cache serve them every step."""
    key = (kind, ps.process_set_id)
    n = _uids.get(key, 0)
    _uids[key] = n + 1
    return f"tp.{kind}{n}"


def _divide(total: int, parts: int, what: str, layer: str, ps) -> int:
    if total % parts:
        raise ValueError(
            f"{layer}: {what}={total} is not divisible by the tensor-parallel size {parts} "
            f"(process set ranks {ps.ranks if ps.ranks else 'all'}). Choose a size that is a "
            f"multiple of {parts} (pad the vocabulary, or change tp).")
    return total // parts


def _mark(p: nn.Parameter, dim: int, ps) -> None:
    p.tensor_parallel = True
    p.partition_dim = dim
    p.tp_process_set = ps


def _linear_init(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """nn.Linear.reset_parameters on full-size tensors (same draws, same order)."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


def _full_linear(in_f: int, out_f: int, bias: bool, init_method, bias_init, dtype):
    w = torch.empty(out_f, in_f, dtype=dtype)
    b = torch.empty(out_f, dtype=dtype) if bias else None
    with torch.no_grad():
        if init_method is None and bias_init is None:
            _linear_init(w, b)
        else:
            if init_method is None:
                nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            else:
                init_method(w)
            if b is not None:
                if bias_init is None:
                    nn.init.zeros_(b)
                else:
                    bias_init(b)
    return w, b


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along the output features: rank i holds rows
    [i*out/k, (i+1)*out/k) of the weight and bias. The output stays sharded on its last dimension
    (feed it to a RowParallelLinear) unless `gather_output=True`.

    `init_method(weight)` / `bias_init(bias)` initialise the full tensors (default: nn.Linear's
    initialisation; with a custom `init_method` the bias defaults to zeros)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, process_set=None, *,
                 init_method: Optional[Callable] = None, bias_init: Optional[Callable] = None,
                 dtype: Optional[torch.dtype] = None, device=None, name: Optional[str] = None):
        super().__init__()
        ps = default_tp_set(process_set)
        k, r = _comm.set_size(ps), _comm.set_rank(ps)
        n = _divide(out_features, k, "out_features", "ColumnParallelLinear", ps)
        self.in_features, self.out_features = in_features, out_features
        self.out_features_per_partition = n
        self.gather_output = gather_output
        self.process_set = ps
        self.tp_size, self.tp_rank = k, r
        w, b = _full_linear(in_features, out_features, bias, init_method, bias_init, dtype)
        self.weight = nn.Parameter(w[r * n:(r + 1) * n].clone().to(device))
        _mark(self.weight, 0, ps)
        if b is not None:
            self.bias = nn.Parameter(b[r * n:(r + 1) * n].clone().to(device))
            _mark(self.bias, 0, ps)
        else:
            self.register_parameter("bias", None)
        self.collective_name = name or _collective_name("column", ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel_region(x, self.process_set, f"{self.collective_name}.in")
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.process_set,
                                                   f"{self.collective_name}.out")
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features_per_partition} on this rank, tp={self.tp_size}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along the input features: rank i holds columns
    [i*in/k, (i+1)*in/k) of the weight; the partial products are summed over the group and the
    (replicated, unsplit) bias is added after the sum. With `input_is_parallel=True` (default)
    the input is already sharded on its last dimension (a ColumnParallelLinear's output);
    otherwise this rank's slice is taken first."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, process_set=None, *,
                 init_method: Optional[Callable] = None, bias_init: Optional[Callable] = None,
                 dtype: Optional[torch.dtype] = None, device=None, name: Optional[str] = None):
        super().__init__()
        ps = default_tp_set(process_set)
        k, r = _comm.set_size(ps), _comm.set_rank(ps)
        n = _divide(in_features, k, "in_features", "RowParallelLinear", ps)
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_partition = n
        self.input_is_parallel = input_is_parallel
        self.process_set = ps
        self.tp_size, self.tp_rank = k, r
        w, b = _full_linear(in_features, out_features, bias, init_method, bias_init, dtype)
        self.weight = nn.Parameter(w[:, r * n:(r + 1) * n].clone().to(device))
        _mark(self.weight, 1, ps)
        if b is not None:
            self.bias = nn.Parameter(b.clone().to(device))
        else:
            self.register_parameter("bias", None)
        self.collective_name = name or _collective_name("row", ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.process_set,
                                                  f"{self.collective_name}.in")
        elif x.shape[-1] != self.in_features_per_partition:
            raise ValueError(
                f"RowParallelLinear expects its input sharded on the last dimension "
                f"({self.in_features_per_partition} = {self.in_features}/{self.tp_size} features "
                f"on this rank) but got shape {list(x.shape)}; pass input_is_parallel=False for "
                f"a full-width input.")
        y = F.linear(x, self.weight)
        y = reduce_from_tensor_parallel_region(y, self.process_set, f"{self.collective_name}.out")
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_features_per_partition} on this rank, "
                f"tp={self.tp_size}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding table split along the vocabulary: rank i holds rows
    [i*num/k, (i+1)*num/k). Ids outside this rank's range look up zeros, and the partial results
    are summed over the group, so the output is the full embedding on every rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, process_set=None, *,
                 init_method: Optional[Callable] = None, dtype: Optional[torch.dtype] = None,
                 device=None, name: Optional[str] = None):
        super().__init__()
        ps = default_tp_set(process_set)
        k, r = _comm.set_size(ps), _comm.set_rank(ps)
        n = _divide(num_embeddings, k, "num_embeddings", "VocabParallelEmbedding", ps)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = n
        self.vocab_start_index, self.vocab_end_index = r * n, (r + 1) * n
        self.process_set = ps
        self.tp_size, self.tp_rank = k, r
        w = torch.empty(num_embeddings, embedding_dim, dtype=dtype)
        with torch.no_grad():
            (init_method or nn.init.normal_)(w)
        self.weight = nn.Parameter(w[r * n:(r + 1) * n].clone().to(device))
        _mark(self.weight, 0, ps)
        self.collective_name = name or _collective_name("embedding", ps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.process_set,
                                                  f"{self.collective_name}.out")

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows "
                f"{self.vocab_start_index}..{self.vocab_end_index - 1} on this rank, "
                f"tp={self.tp_size})")


# ---------------------------------------------------------------------- full <-> sharded
def gather_tensor_parallel(t: torch.Tensor, dim: int, process_set=None,
                           name: Optional[str] = None) -> torch.Tensor:
    """Concatenate every tensor-parallel rank's shard of `t` along `dim` (a collective over the
    group; no autograd)."""
    ps = default_tp_set(process_set)
    return _comm.allgather_dim(t, dim, ps, name)


def _is_sharded(p) -> bool:
    return bool(getattr(p, "tensor_parallel", False))


def gather_state_dict(module: nn.Module, grads: bool = False, prefix: str = "") -> dict:
    """Every parameter of `module` at full size (sharded ones gathered from their tensor-parallel
    group), keyed by parameter name; with `grads=True`, their gradients instead (None where a
    parameter has no gradient on this rank). A collective over each sharded parameter's group:
    call it on every rank of the group."""
    out = {}
    for pname, p in module.named_parameters():
        t = p.grad if grads else p.data
        if t is None:
            out[prefix + pname] = None
            continue
        if _is_sharded(p):
            kind = "grad" if grads else "param"
            t = _comm.allgather_dim(t, p.partition_dim, p.tp_process_set,
                                    f"tp.gather_{kind}.{prefix}{pname}")
        out[prefix + pname] = t.detach().clone()
    return out


def shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a full-size tensor for a (possibly sharded) parameter."""
    if not _is_sharded(param):
        return full
    ps = param.tp_process_set
    k, r = _comm.set_size(ps), _comm.set_rank(ps)
    dim = param.partition_dim
    n = full.shape[dim] // k
    return full.narrow(dim, r * n, n)


def load_full_state_dict(module: nn.Module, full: dict, strict: bool = True) -> None:
    """Load full-size parameters (say, from a tp=1 checkpoint) into a tensor-parallel module,
    each rank keeping its slice. Local only: no communication."""
    params = dict(module.named_parameters())
    missing = [n for n in params if n not in full]
    unexpected = [n for n in full if n not in params]
    if strict and (missing or unexpected):
        raise KeyError(f"load_full_state_dict: missing {missing[:6]}, unexpected "
                       f"{unexpected[:6]}")
    with torch.no_grad():
        for n, p in params.items():
            if n not in full:
                continue
            part = shard_of(full[n], p)
            if tuple(part.shape) != tuple(p.shape):
                raise ValueError(f"load_full_state_dict: {n} has full shape {list(full[n].shape)},"
                                 f" which does not shard to this rank's {list(p.shape)}")
            p.copy_(part)


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "gather_tensor_parallel", "gather_state_dict", "load_full_state_dict", "shard_of"]
