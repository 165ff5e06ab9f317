"""Tensor fusion: pack compatible responses into one transport call (Horovod's FuseResponses).

Decided once, by the coordinator, so every rank runs the identical fused list.
"""
from __future__ import annotations

import copy
from typing import Callable

from .messages import ALLGATHER, BROADCAST, FUSABLE_TYPES, Response


def split_list(lst: list, n: int) -> list[list]:
    """Split `lst` into `n` chunks of nearly equal length (the first ones one longer): Horovod's
    `groups=n` for a DistributedOptimizer's gradients, in every frontend."""
    d, r = divmod(len(lst), n)
    return [lst[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def group_positions(indices: list, variables: list, groups, key: Callable = id) -> list[list]:
    """A DistributedOptimizer's gradient positions `indices` (into `variables`), grouped as
    Horovod's `groups` says: None, one group of all; an int n, n groups of nearly equal size
    (split_list); a list of lists of variables (matched by `key`), those groups, in their
    order, then every other gradient on its own."""
    if groups is None:
        return [indices]
    if isinstance(groups, int):
        return [g for g in split_list(indices, groups) if g]
    pos = {key(variables[i]): i for i in indices}
    out, used = [], set()
    for group in groups:
        members = [pos[key(v)] for v in group if key(v) in pos]
        members = [i for i in members if i not in used]
        used.update(members)
        if members:
            out.append(sorted(members))
    out.extend([i] for i in indices if i not in used)
    return out


def resolve_groups(groups, num_groups: int = 0, member: str = "tensors"):
    """Horovod's `groups` argument of a DistributedOptimizer, with its deprecated alias
    `num_groups` (a warning; `groups` wins when both are given), checked: None, an int > 0, or a
    list of lists of `member`. Returns `groups`."""
    if num_groups != 0:
        import warnings
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or
                                   (isinstance(groups, int) and groups > 0)):
        raise ValueError(f"groups should be a non-negative integer or a list of list of "
                         f"{member}.")
    return groups


def _compatible(a: Response, b: Response, group_fusion: bool) -> bool:
    if a.type != b.type or a.type not in FUSABLE_TYPES or a.error or b.error:
        return False
    # reduce_op is part of the key: Adasum responses (reduced tensor by tensor by
    # collectives.Executor.adasum) fuse only with other Adasum responses, never with Sum/Average.
    if (a.process_set_id, a.dtype, a.device < 0, a.reduce_op, a.prescale, a.postscale) != \
            (b.process_set_id, b.dtype, b.device < 0, b.reduce_op, b.prescale, b.postscale):
        return False
    if a.joined != b.joined:
        return False
    if a.type == BROADCAST and a.root_rank != b.root_rank:
        return False
    if not group_fusion and a.group != b.group:
        return False
    return True


def _merge(into: Response, other: Response) -> None:
    into.names.extend(other.names)
    into.shapes.extend(other.shapes)
    if into.type == ALLGATHER:
        into.rank_dims.extend(other.rank_dims)
    into.cache_bits.extend(other.cache_bits)


def fuse_responses(responses: list[Response], threshold: int,
                   group_fusion: bool = True) -> list[Response]:
    """Greedy fusion in order, with bounded look-ahead past non-matching responses.

    A response that does not match is skipped (kept for later, in order) while the skipped bytes stay
    under the threshold, so interleaved fp16/fp32 gradients still fuse per dtype.
    """
    pending = list(responses)
    out: list[Response] = []
    while pending:
        head = pending.pop(0)
        if head.type not in FUSABLE_TYPES or head.error or threshold <= 0:
            out.append(head)
            continue
        fused = copy.copy(head)
        fused.names = list(head.names)
        fused.shapes = list(head.shapes)
        fused.rank_dims = list(head.rank_dims) if head.rank_dims is not None else None
        fused.cache_bits = list(head.cache_bits) if head.cache_bits is not None else \
            [-1] * len(head.names)
        total = head.nbytes()
        skipped_bytes = 0
        rest: list[Response] = []
        for i, cand in enumerate(pending):
            size = 0 if cand.error else cand.nbytes()     # an error moves no bytes
            if _compatible(fused, cand, group_fusion) and total + size <= threshold:
                if cand.cache_bits is None:
                    cand.cache_bits = [-1] * len(cand.names)
                _merge(fused, cand)
                total += size
            else:
                skipped_bytes += size
                rest.append(cand)
                if skipped_bytes > threshold:
                    rest.extend(pending[i + 1:])
                    break
        pending = rest
        out.append(fused)
    return out
