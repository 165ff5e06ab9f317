"""Splitting a layer list into pipeline stages.

`uniform`: equal layer counts (the first n % p stages get one more). `params` and `time`: the
contiguous split that minimises the most expensive stage, with a layer's cost its parameter count
or its measured forward+backward time on a sample micro-batch (averaged over every rank of the job
so every rank computes the same split).
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
from torch import nn


def uniform(n: int, p: int) -> list[int]:
    return [n // p + (1 if s < n % p else 0) for s in range(p)]


def by_cost(costs: Sequence[float], p: int) -> list[int]:
    """Layer counts per stage (each >= 1) of the contiguous split minimising the largest stage
    cost; among equally good splits, the one with the most even layer counts. Deterministic."""
    n = len(costs)
    if p > n:
        raise ValueError(f"cannot split {n} layers into {p} stages")
    if all(c == 0 for c in costs):
        return uniform(n, p)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    target = uniform(n, p)
    inf = float("inf")
    # best[k][i]: (max stage cost, imbalance) splitting layers[:i] into k stages.
    best = [[(inf, inf)] * (n + 1) for _ in range(p + 1)]
    choice = [[-1] * (n + 1) for _ in range(p + 1)]
    best[0][0] = (0.0, 0)
    for k in range(1, p + 1):
        for i in range(k, n - (p - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev[0] == inf:
                    continue
                cand = (max(prev[0], prefix[i] - prefix[j]),
                        prev[1] + abs((i - j) - target[k - 1]))
                if cand < best[k][i]:
                    best[k][i] = cand
                    choice[k][i] = j
    counts = []
    i = n
    for k in range(p, 0, -1):
        j = choice[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def param_costs(layers: Sequence[nn.Module]) -> list[float]:
    out = []
    for layer in layers:
        seen = set()
        total = 0
        for q in layer.parameters():
            if id(q) not in seen:
                seen.add(id(q))
                total += q.numel()
        out.append(float(total))
    return out


def _floats(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if (value.is_floating_point() and value.requires_grad) else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _floats(v)]
    return []


def _detach(value):
    if isinstance(value, torch.Tensor):
        t = value.detach()
        return t.requires_grad_(True) if t.is_floating_point() else t
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value


def time_costs(run_layer, layers: Sequence[nn.Module], sample, repeat: int = 3) -> list[float]:
    """Median forward+backward seconds of each layer, feeding each the previous one's output
    (starting from `sample`). `run_layer(i, layer, x, skips)` runs layer i (handling skip
    connections through the `skips` dict)."""
    costs = []
    for _ in range(repeat):
        x = sample
        skips: dict = {}
        row = []
        for i, layer in enumerate(layers):
            x_in = _detach(x)
            skips = {k: _detach(v) for k, v in skips.items()}
            t0 = time.perf_counter()
            y = run_layer(i, layer, x_in, skips)
            outs = _floats(y) + [t for v in skips.values() for t in _floats(v)]
            params = [q for q in layer.parameters() if q.requires_grad]
            leaves = _floats(x_in) + params
            if outs and leaves:
                torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs],
                                    allow_unused=True)
            row.append(time.perf_counter() - t0)
            x = y
        costs.append(row)
    return [statistics.median(col) for col in zip(*costs)]
