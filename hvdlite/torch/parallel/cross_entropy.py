"""Cross-entropy on vocabulary-sharded logits, without ever gathering them.

Forward: two collectives on the tensor-parallel group: a MAX of the per-rank logit maxima, then
one SUM of [target logit, sum of exp, (sum of logits, with label smoothing)] packed into one
tensor (Megatron uses three separate all-reduces). Backward: none; each rank's gradient is
softmax - target distribution on its own slice.

Semantics follow `torch.nn.functional.cross_entropy(logits.view(-1, V), target.view(-1),
ignore_index=..., label_smoothing=..., reduction=...)` on the full logits.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _comm
from .. import mpi_ops
from .groups import default_tp_set


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, ps, name):
        k, r = _comm.set_size(ps), _comm.set_rank(ps)
        compute_dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) \
            else logits.dtype
        x = logits.to(compute_dtype)
        v_local = x.shape[-1]
        vocab = v_local * k
        start = r * v_local
        local_max = x.max(dim=-1).values
        global_max = _comm.allreduce(local_max, ps, f"{name}.max", op=mpi_ops.Max)
        shifted = x - global_max.unsqueeze(-1)
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + v_local)
        local_t = (target - start).masked_fill(~mine, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = shifted.exp()
        parts = [picked, exp.sum(dim=-1)]
        if label_smoothing > 0:
            parts.append(shifted.sum(dim=-1))
        packed = _comm.allreduce(torch.stack(parts, dim=-1), ps, f"{name}.sum")
        log_z = packed[..., 1].log()
        loss = log_z - packed[..., 0]
        if label_smoothing > 0:
            smooth = log_z - packed[..., 2] / vocab
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        loss = loss.masked_fill(~valid, 0.0)
        exp.div_(packed[..., 1].unsqueeze(-1))        # softmax, in place
        ctx.save_for_backward(exp, local_t, mine, valid)
        ctx.label_smoothing, ctx.vocab, ctx.in_dtype = label_smoothing, vocab, logits.dtype
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax.clone()
        onehot = torch.zeros_like(grad).scatter_(-1, local_t.unsqueeze(-1),
                                                 mine.unsqueeze(-1).to(grad.dtype))
        grad.sub_(onehot, alpha=1.0 - eps)
        if eps > 0:
            grad.sub_(eps / ctx.vocab)
        scale = (grad_loss.to(grad.dtype) * valid.to(grad.dtype)).unsqueeze(-1)
        grad.mul_(scale)
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 process_set=None, *, label_smoothing: float = 0.0,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 name: Optional[str] = None) -> torch.Tensor:
    """Cross-entropy of `logits[..., V/k]` (this rank's vocabulary slice, as produced by a
    ColumnParallelLinear with gather_output=False) against `target[...]` (full-vocabulary ids).

    `reduction`: "mean" over the non-ignored targets (torch's default), "sum", or "none" (per
    target, 0 where ignored)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"vocab_parallel_cross_entropy: logits {list(logits.shape)} need targets "
                         f"of shape {list(logits.shape[:-1])}, got {list(target.shape)}")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError("vocab_parallel_cross_entropy takes class indices (an integer tensor) "
                         "as targets")
    ps = default_tp_set(process_set)
    loss = _VocabParallelCrossEntropy.apply(logits, target, float(label_smoothing),
                                            int(ignore_index), ps,
                                            name or _comm.site_name("tp.cross_entropy"))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    count = (target != ignore_index).sum()
    return loss.sum() / count.to(loss.dtype)
