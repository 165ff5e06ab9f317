"""Skip connections for pipelines: `Stash(name)` keeps a value, `Pop(name)` takes it back
(sent straight from the stashing stage to every popping stage), and `SkipSequential`, the
single-process model with the same semantics."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from torch import nn


# ---------------------------------------------------------------------- skip connections
class Stash(nn.Module):
    """Identity layer that keeps its input under `name` for a later `Pop(name)`, possibly on
    another stage (a skip/residual connection across stages)."""

    def __init__(self, name: str):
        super().__init__()
        if not isinstance(name, str) or not name:
            raise ValueError("Stash needs a non-empty string name")
        self.skip_name = name

    def forward(self, x):
        return x

    def extra_repr(self) -> str:
        return repr(self.skip_name)


class Pop(nn.Module):
    """Combines the current activation with the tensor stashed under `name`:
    `combine(x, stashed)` (default `x + stashed`). `combine` may be an nn.Module (its parameters
    belong to this layer) or any callable."""

    def __init__(self, name: str, combine: Optional[Callable] = None):
        super().__init__()
        if not isinstance(name, str) or not name:
            raise ValueError("Pop needs a non-empty string name")
        self.skip_name = name
        self._fn = None
        if isinstance(combine, nn.Module):
            self.combine = combine
        elif combine is not None:
            if not callable(combine):
                raise TypeError("Pop(combine=...) must be callable")
            self._fn = combine

    def forward(self, x, stashed):
        if isinstance(getattr(self, "combine", None), nn.Module):
            return self.combine(x, stashed)
        if self._fn is not None:
            return self._fn(x, stashed)
        return x + stashed

    def extra_repr(self) -> str:
        return repr(self.skip_name)


def _skip_layout(layers: Sequence) -> tuple[dict, dict]:
    stash_at: dict = {}
    pops_at: dict = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, Stash):
            if layer.skip_name in stash_at:
                raise ValueError(f"Stash({layer.skip_name!r}) appears twice (layers "
                                 f"{stash_at[layer.skip_name]} and {i}); skip names must be "
                                 f"unique")
            stash_at[layer.skip_name] = i
        elif isinstance(layer, Pop):
            if layer.skip_name not in stash_at:
                raise ValueError(f"Pop({layer.skip_name!r}) at layer {i} comes before any "
                                 f"Stash({layer.skip_name!r})")
            pops_at.setdefault(layer.skip_name, []).append(i)
    unused = [n for n in stash_at if n not in pops_at]
    if unused:
        raise ValueError(f"Stash({unused[0]!r}) at layer {stash_at[unused[0]]} is never popped; "
                         f"add a Pop({unused[0]!r}) after it or remove it")
    return stash_at, pops_at


def _run_layers(layers: Sequence[tuple[int, nn.Module]], x, skips: dict):
    for _, layer in layers:
        if isinstance(layer, Stash):
            skips[layer.skip_name] = x
        elif isinstance(layer, Pop):
            x = layer(x, skips[layer.skip_name])
        else:
            x = layer(x)
    return x


class SkipSequential(nn.Module):
    """The dense, single-process form of a pipeline's layer list: runs the layers in order,
    honouring Stash/Pop. Parameter names match a Pipeline's (`layers.<index>.<name>`)."""

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        layers = list(layers)
        _skip_layout(layers)
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        return _run_layers(list(enumerate(self.layers)), x, {})
