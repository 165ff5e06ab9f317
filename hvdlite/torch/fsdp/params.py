"""One parameter cut into dim-0 shards, as FSDP2 lays it out, and the groups it is cut over.

Every rank of the shard group holds `rows = ceil(dim0 / n)` rows of the padded parameter (the last
ranks' rows past `dim0` are zero padding, so every rank's piece has the same shape and the
allgather and reduce-scatter move equal chunks). The optimizer sees only the unpadded rows: the
`sharded` Parameter is a view of them, and updating it updates the padded storage in place.

The gathered (unsharded) parameter is one Parameter per sharded parameter, kept for the life of the
model, whose storage is freed between uses (`untyped_storage().resize_(0)`) and refilled before
the next: autograd's saved tensors and views of it follow the same storage, so a block gathered
again for backward needs no second graph.
"""
from __future__ import annotations

import torch
from torch import nn

from ...common.process_sets import ProcessSet
from ..shard import LocalShard


class ShardGroup:
    """The ranks a block is sharded over, and (hybrid sharding) those it is replicated over.

    Attributes:
        shard: Process set whose ranks each hold one shard.
        replicate: Process set of the ranks holding the same shard (one per shard group), or None.
    """

    def __init__(self, shard: ProcessSet, replicate: ProcessSet | None):
        self.shard, self.replicate = shard, replicate
        self.size = int(shard.size())
        self.rank = int(shard.rank())
        self.replicas = int(replicate.size()) if replicate is not None else 1

    def describe(self) -> str:
        rep = f", replicated over {self.replicate.ranks}" if self.replicate is not None else ""
        return f"sharded over ranks {self.shard.ranks}{rep}"


def _free(t: torch.Tensor) -> None:
    if t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() != nbytes:
        t.untyped_storage().resize_(nbytes)


class ShardedParam:
    """A parameter of one `fully_shard` block: its shard, its gathered form and its slots.

    Attributes:
        fqn: The name of the parameter inside the block (the first of its slots).
        slots: Every (module, attribute) that holds this parameter (a weight tied inside a block
            has several).
        orig_shape: The whole parameter's shape.
        rows: Rows of the padded parameter each rank holds.
        valid: Rows of real data this rank holds (0 for a rank past a short parameter's end).
        padded: This rank's `rows` rows, padding included (what the allgather sends).
        sharded: The Parameter the optimizer sees: `padded[:valid]`.
        full: The gathered Parameter the forward and backward use; its storage is freed
            between uses.
    """

    def __init__(self, fqn: str, param: nn.Parameter, slots: list, group: ShardGroup,
                 param_dtype: torch.dtype | None, compute_device: torch.device,
                 storage_device: torch.device, pin: bool):
        self.fqn, self.slots, self.group = fqn, slots, group
        self.orig_shape = tuple(param.shape)      # at least one dimension (api checks)
        self.dim0, self.rest = self.orig_shape[0], self.orig_shape[1:]
        self.rows = max(1, -(-self.dim0 // group.size))
        self.start = min(self.dim0, group.rank * self.rows)
        self.valid = max(0, min(self.rows, self.dim0 - self.start))
        self.compute_device, self.storage_device = compute_device, storage_device
        self.param_dtype = param_dtype or param.dtype
        with torch.no_grad():
            whole = param.detach()
            padded = torch.zeros((self.rows, *self.rest), dtype=param.dtype, device=storage_device,
                                 pin_memory=pin and storage_device.type == "cpu"
                                 and compute_device.type != "cpu")
            padded[:self.valid].copy_(whole[self.start:self.start + self.valid])
        self.padded = padded
        self.sharded = nn.Parameter(padded[:self.valid], requires_grad=param.requires_grad)
        self.full = nn.Parameter(torch.empty(self.orig_shape, dtype=self.param_dtype,
                                             device=compute_device),
                                 requires_grad=param.requires_grad)
        _free(self.full)
        self.gathered = False

    # ------------------------------------------------------------------ the gathered form
    def shard_to_send(self) -> torch.Tensor:
        """This rank's padded rows on the compute device in the compute dtype (the allgather's
        input)."""
        t = self.padded
        if t.device != self.compute_device:
            t = t.to(self.compute_device, non_blocking=True)
        return t.to(self.param_dtype) if t.dtype != self.param_dtype else t

    def fill(self, gathered: torch.Tensor) -> None:
        """Copy the allgather's result (every rank's padded rows) into the gathered Parameter.

        The version counter is kept: autograd checks it on tensors saved for backward, and the
        refilled values are the very ones the forward used."""
        _alloc(self.full)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
            self.full.copy_(gathered[:self.dim0])
        self.gathered = True

    def free(self) -> None:
        _free(self.full)
        self.gathered = False

    def use_full(self) -> None:
        for module, attr in self.slots:
            module._parameters[attr] = self.full

    def use_sharded(self) -> None:
        for module, attr in self.slots:
            module._parameters[attr] = self.sharded

    def relayout(self, group: ShardGroup) -> None:
        """Cut again over `group` (an elastic job's new membership), keeping the Parameter the
        optimizer and the module hold; the rows are zeros until a state dict is loaded."""
        self.group = group
        self.rows = max(1, -(-self.dim0 // group.size))
        self.start = min(self.dim0, group.rank * self.rows)
        self.valid = max(0, min(self.rows, self.dim0 - self.start))
        self.padded = torch.zeros((self.rows, *self.rest), dtype=self.padded.dtype,
                                  device=self.storage_device)
        self.sharded.data = self.padded[:self.valid]
        self.sharded.grad = None
        self.full.grad = None
        self.free()

    # ------------------------------------------------------------------ gradients
    def grad_to_reduce(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The gathered gradient padded to `rows * n` rows, in `dtype` (the reduce-scatter's
        input), or None if backward produced none."""
        g = self.full.grad
        if g is None:
            return None
        padded_rows = self.rows * self.group.size
        if padded_rows != self.dim0:
            out = torch.zeros((padded_rows, *self.rest), dtype=dtype, device=g.device)
            out[:self.dim0].copy_(g)
            return out
        return g.to(dtype) if g.dtype != dtype else g.contiguous()

    def add_grad(self, reduced: torch.Tensor) -> None:
        """Accumulate this rank's reduced rows into the sharded gradient (master dtype, storage
        device), as autograd accumulates a plain parameter's."""
        # Blocking into host memory: a non-blocking copy to the CPU may land after the
        # optimizer (on the CPU, outside any stream) has read the gradient.
        g = reduced[:self.valid].to(device=self.storage_device, dtype=self.sharded.dtype,
                                    non_blocking=self.storage_device.type != "cpu")
        if self.sharded.grad is None:
            self.sharded.grad = g.clone() if g.data_ptr() == reduced.data_ptr() else g
        else:
            self.sharded.grad.add_(g)

    # ------------------------------------------------------------------ state
    def local_shard(self, t: torch.Tensor | None = None) -> LocalShard:
        """`t` (the sharded parameter by default, or a tensor shaped like it, say optimizer
        state) as the box of the whole parameter this rank holds."""
        t = self.sharded.detach() if t is None else t
        return LocalShard(t, self.orig_shape, (self.start,) + (0,) * len(self.rest))

    def my_rows(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole tensor shaped like the parameter."""
        return whole[self.start:self.start + self.valid]
