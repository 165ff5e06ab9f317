"""What `fully_shard` computes, reduces and stores in: FSDP2's two policies, by the same names.

`MixedPrecisionPolicy` keeps the sharded (master) parameters in their own dtype and gathers them
cast to `param_dtype`; gradients are cast to `reduce_dtype` before the reduce-scatter and to the
master dtype after it. `CPUOffloadPolicy` keeps the shards (and so their gradients and the
optimizer state) in host memory and moves a block's shards to its device only to gather them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the gathered parameters, of the gradient reduction and of the outputs.

    Attributes:
        param_dtype: Dtype the forward and backward compute in (the gathered parameters); None
            keeps each parameter's own dtype. The allgather moves this dtype, so bf16 halves it.
        reduce_dtype: Dtype gradients are reduce-scattered in; None means `param_dtype` (FSDP2's
            default). float32 with a bf16 `param_dtype` sums low-precision gradients exactly
            enough for training.
        output_dtype: Dtype the module's floating-point outputs are cast to; None leaves them.
        cast_forward_inputs: Cast floating-point forward inputs to `param_dtype`.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for label in ("param_dtype", "reduce_dtype", "output_dtype"):
            v = getattr(self, label)
            if v is not None and (not isinstance(v, torch.dtype) or not v.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy({label}={v!r}): must be a floating-point "
                                 f"torch.dtype (torch.bfloat16, torch.float16, torch.float32) "
                                 f"or None")


class OffloadPolicy:
    """No offload: shards live on the parameters' device (FSDP2's base class)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep shards, their gradients and the optimizer state in host memory.

    The optimizer then steps on the CPU. On a CPU-only job there is nothing to move, so the
    policy is accepted and changes nothing.

    Attributes:
        pin_memory: Pin the host shards, so the copies to and from the GPU run asynchronously.
    """

    pin_memory: bool = True


def check_policies(module_name: str, mp_policy: Any, offload_policy: Any
                   ) -> tuple[MixedPrecisionPolicy, CPUOffloadPolicy | None]:
    """The policies to use, refusing values of other types (say, torch's own policy objects,
    which look alike and would be silently ignored)."""
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard({module_name}): mp_policy must be "
                        f"hvdlite.torch.MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard({module_name}): offload_policy must be "
                        f"hvdlite.torch.CPUOffloadPolicy or OffloadPolicy, got "
                        f"{type(offload_policy).__name__}")
    offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
    return mp_policy, offload


__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy", "check_policies"]
