"""Building a pipeline: balancing layers over stages (uniform, by parameters, by measured
time), the skip-connection layout, and the cross-rank agreement check that every stage was
built from the same arguments."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import mpi_ops
from . import balance as _balance
from .pipeline_values import _ACT, PipelineError
from .skip import Pop, Stash


class _Construction:
    """Pipeline construction and agreement (a mixin of `Pipeline`)."""

    def _balance(self, spec, layers, p: int, sample) -> Optional[list[int]]:
        """Layer counts per stage, or None for balance='time' (measured after agreement)."""
        n = len(layers)
        if n < p:
            raise ValueError(f"{n} layers cannot fill {p} pipeline stages (each stage needs at "
                             f"least one layer)")
        if spec is None or spec == "uniform":
            return _balance.uniform(n, p)
        if isinstance(spec, str):
            if spec not in ("params", "time"):
                raise ValueError(f"balance={spec!r}: use None, 'uniform', 'params', 'time' or a "
                                 f"list of layer counts per stage")
            lazy = [i for i, layer in enumerate(layers) if not isinstance(layer, nn.Module)]
            if lazy:
                raise ValueError(f"balance={spec!r} needs constructed modules, but layer "
                                 f"{lazy[0]} is a factory; pass modules or an explicit balance")
            if spec == "params":
                return _balance.by_cost(_balance.param_costs(layers), p)
            if sample is None:
                raise ValueError("balance='time' needs sample= (one micro-batch of inputs) to "
                                 "time each layer")
            return None
        try:
            counts = [int(c) for c in spec]
        except (TypeError, ValueError):
            raise ValueError(f"balance={spec!r}: use None, 'uniform', 'params', 'time' or a list "
                             f"of layer counts per stage") from None
        if any(isinstance(c, bool) or c != int(c) for c in spec):
            raise ValueError(f"balance={list(spec)}: layer counts must be integers")
        if len(counts) != p:
            raise ValueError(f"balance={counts} has {len(counts)} entries but the pipeline has "
                             f"{p} stages (process set ranks {self.stage_ranks})")
        if any(c < 1 for c in counts):
            raise ValueError(f"balance={counts}: every stage needs at least one layer")
        if sum(counts) != n:
            raise ValueError(f"balance={counts} sums to {sum(counts)} but there are {n} layers; "
                             f"the counts must add up to the number of layers")
        return counts

    @staticmethod
    def _layout(counts, stash_at: dict, pops_at: dict, p: int) -> dict:
        """{(src stage, dst stage): items it carries} for a given split."""
        stage_of = [k for k, c in enumerate(counts) for _ in range(c)]
        items: dict = {(k, k + 1): [_ACT] for k in range(p - 1)}
        for name, si in stash_at.items():
            for pi in pops_at[name]:
                a, b = stage_of[si], stage_of[pi]
                if a != b:
                    lst = items.setdefault((a, b), [])
                    if name not in lst:
                        lst.append(name)
        return {e: ([_ACT] if _ACT in v else []) + sorted(x for x in v if x != _ACT)
                for e, v in items.items()}

    def _time_costs(self, layers, sample) -> list[float]:
        def run_layer(i, layer, x, skips):
            if isinstance(layer, Stash):
                skips[layer.skip_name] = x
                return x
            if isinstance(layer, Pop):
                return layer(x, skips[layer.skip_name])
            return layer(x)

        costs = _balance.time_costs(run_layer, layers, sample)
        # Every rank must pick the same split: use the job-wide average.
        avg = mpi_ops.allreduce(torch.tensor(costs, dtype=torch.float64), op=mpi_ops.Average,
                                name=f"hvdlite.parallel.pipeline{self._uid}.time")
        return avg.tolist()

    @staticmethod
    def _check_layouts(infos: list, fields: list, key: str) -> None:
        """Every rank of a group must have built the same pipeline; groups must not overlap."""
        by_rank = {i["rank"]: i for i in infos}
        for info in infos:
            for member in info["group"]:
                other = by_rank.get(member)
                if other is None or other["group"] != info["group"]:
                    raise PipelineError(
                        f"ranks disagree on the pipeline groups: rank {info['rank']} builds its "
                        f"pipeline over ranks {list(info['group'])} but rank {member} over "
                        f"{list(other['group']) if other else '?'}; every rank of a pipeline "
                        f"must pass the same process set (e.g. mesh.pp)")
                a, b = info[key], other[key]
                if a != b:
                    if key == "counts":
                        k, va, vb = 0, a, b
                    else:
                        k = next(j for j in range(len(a)) if a[j] != b[j])
                        va, vb = a[k], b[k]
                    raise PipelineError(
                        f"the stages of pipeline {list(info['group'])} were built differently: "
                        f"rank {info['rank']} has {fields[k]} {va!r} but rank {member} has "
                        f"{vb!r}; build the Pipeline from the same layers with the same "
                        f"arguments on every rank")

    # ------------------------------------------------------------------ properties
