"""The single-process reference of a conformance program (program.py): every rank's inputs
from (seed, op, member, repetition, rank), and what each rank must get back.

Inputs are small integers (Adasum: normal draws), so every reduction is exact in every dtype
before its last factor; results compare with torch.equal. That factor (Average's 1/size times
the postscale) multiplies the sum in the tensor's own dtype, as Horovod's ScaleBuffer does (it
casts the factor to float for float32 buffers): on 3 ranks float32's Average is
sum * float32(1/3), not the correctly rounded sum / 3. Adasum compares against the NumPy
formula (adasum_ref.py) within its dtype's tolerance.
"""
from __future__ import annotations

import numpy as np
import torch
from adasum_ref import adasum as adasum_ref
from ops_common import gen, my_rows, reduce_ref, salt_id

import hvdlite.torch as hvd

OPS = {"Average": hvd.Average, "Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product, "Adasum": hvd.Adasum}
ADASUM_TOL = {torch.float16: (2e-3, 2e-3), torch.float32: (1e-5, 1e-6),
              torch.float64: (1e-12, 1e-12)}
_NP = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def shape_for(op: dict, m: int, index: int, n: int) -> list[int]:
    """Member `m`'s shape on the rank at `index` of the op's set of `n` ranks."""
    kind = op["kind"]
    if kind in ("allgather", "grouped_allgather"):
        return [op["rows"][m][index]] + op["tails"][m]
    if kind == "alltoall":
        rows = op["per"] * n if op["splits"] is None else sum(op["splits"][index])
        return [rows] + op["tails"][0]
    return op["shapes"][m]


def tensor_input(op: dict, salt: tuple, m: int, rank: int, members: list[int]) -> torch.Tensor:
    """Rank `rank`'s input for member `m` of `op` (salt: seed, op index, position, rep)."""
    dtype = dtype_of(op["dtypes"][m])
    shape = shape_for(op, m, members.index(rank), len(members))
    key = salt + (m,)
    if op.get("op") == "Adasum":
        g = torch.Generator().manual_seed(5000 + rank + 7919 * salt_id(key))
        return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)
    lo, hi = (-2, 2) if op.get("op") == "Product" else (-4, 4)
    return gen(rank, shape, dtype, key, lo, hi)


def object_input(seed: int, i: int, rank: int) -> dict:
    """Rank `rank`'s object for op `i`: nested, of a size that differs by rank."""
    return {"seed": seed, "op": i, "rank": rank, "data": list(range(rank + i % 5)),
            "pair": (rank, str(rank) * (1 + i % 3))}


def reduce_scaled(inputs: list[torch.Tensor], op, pre: float, post: float,
                  divisor: int) -> torch.Tensor:
    """Horovod's result of a reduction: op over (pre * x_r), then times the factor (post, and
    1/divisor for Average) in the dtype; integers truncate (ops_common.reduce_ref)."""
    dtype = inputs[0].dtype
    if not dtype.is_floating_point:
        return reduce_ref(inputs, op, pre, post, divisor=divisor)
    unscaled = reduce_ref(inputs, hvd.Sum if op == hvd.Average else op, pre, 1.0)
    factor = post / divisor if op == hvd.Average else post
    return unscaled if factor == 1.0 else unscaled * factor


def _adasum(inputs: list[torch.Tensor], pre: float, post: float) -> torch.Tensor:
    dtype = inputs[0].dtype
    scaled = [(x.to(torch.float64) * pre).to(dtype).numpy() for x in inputs]
    out = adasum_ref(scaled, _NP[dtype]).astype(np.float64) * post
    return torch.from_numpy(np.asarray(out, dtype=_NP[dtype]).reshape(inputs[0].shape))


def expected(op: dict, salt: tuple, rank: int, members: list[int],
             joined: frozenset = frozenset()) -> list:
    """What `rank` must get from `op` on the set `members`: one tensor per member (alltoall:
    the output, then the received splits as a list). Ranks in `joined` have joined and
    contribute zeros to allreduces."""
    kind = op["kind"]
    n, index = len(members), members.index(rank)

    def inputs(m: int) -> list[torch.Tensor]:
        xs = [tensor_input(op, salt, m, r, members) for r in members]
        return [x * 0 if r in joined else x for r, x in zip(members, xs)]

    count = 1 if kind in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter") \
        else len(op["dtypes"])
    out = []
    for m in range(count):
        if kind in ("allreduce", "grouped_allreduce"):
            if op["op"] == "Adasum":
                out.append(_adasum(inputs(m), op["pre"], op["post"]))
            else:
                out.append(reduce_scaled(inputs(m), OPS[op["op"]], op["pre"], op["post"], n))
        elif kind in ("allgather", "grouped_allgather"):
            out.append(torch.cat(inputs(m)))
        elif kind == "broadcast":
            out.append(tensor_input(op, salt, 0, op["root"], members))
        elif kind == "alltoall":
            xs = inputs(0)
            if op["splits"] is None:
                per = op["per"]
                out.append(torch.cat([x[per * index:per * (index + 1)] for x in xs]))
                out.append([per] * n)
            else:
                s = op["splits"]
                start = [sum(s[src][:index]) for src in range(n)]
                out.append(torch.cat([x[start[src]:start[src] + s[src][index]]
                                      for src, x in enumerate(xs)]))
                out.append([s[src][index] for src in range(n)])
        elif kind in ("reducescatter", "grouped_reducescatter"):
            full = reduce_scaled(inputs(m), OPS[op["op"]], op["pre"], op["post"], n)
            out.append(my_rows(full, n, index))
        else:
            raise ValueError(kind)
    return out
