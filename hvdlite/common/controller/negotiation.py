"""Cross-rank validation: turn every rank's request for one name into one Response (or an ERROR).

This is where a mismatch becomes a clear message instead of a hang or silent corruption.
"""
from __future__ import annotations

from ..messages import (ADD_PROCESS_SET, ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, ERROR,
                       REDUCE_OP_NAMES, REDUCING_TYPES, REMOVE_PROCESS_SET, TYPE_NAMES, Request,
                       Response)

_FIX = ("Every rank must submit the same tensors, under the same names, in the same way; "
        "check for data-dependent control flow or a rank that skips a step.")


def _error(name: str, req: Request, message: str) -> Response:
    # A grouped op's member keeps its group: the coordinator releases a group once every member
    # has a response, failed or not. Without it, the rest of a group with one bad member waited
    # for that member forever.
    return Response(type=ERROR, names=[name], process_set_id=req.process_set_id,
                    error=message, dtype=req.dtype, group=req.group)


def _grouping(req: Request) -> str:
    return "alone" if req.group is None else \
        f"in group '{req.group}' of {req.group_size} tensors"


def group_count_error(rtype: int, group: str, a: int, call_a: tuple, b: int,
                      call_b: tuple) -> str:
    """The error of a grouped call whose ranks `a` and `b` (global ranks) passed different
    numbers of tensors; `call_a`, `call_b`: (that rank's count, one member's name), a count
    of 0 for an empty list (controller.Coordinator._note_group)."""
    def part(call: tuple) -> str:
        n, member = call
        return "with no tensors (an empty list)" if n == 0 else \
            f"with {n} tensors (one of them: '{member}')"

    return (f"Mismatched grouped {TYPE_NAMES[rtype]} in group '{group}': rank {a} submitted it "
            f"{part(call_a)} but rank {b} {part(call_b)}. A grouped call must pass the same "
            f"number of tensors on every rank, in the same order (the same model, or the same "
            f"list, on every rank).")


def group_names_error(rtype: int, group: str, a: int, name_a: str, b: int, name_b: str) -> str:
    """The error of a grouped call whose ranks `a` and `b` (global ranks) passed as many
    tensors under different names: `name_a` only `a` submitted, `name_b` only `b`."""
    return (f"Mismatched grouped {TYPE_NAMES[rtype]} in group '{group}': rank {a} submitted "
            f"'{name_a}', which rank {b} did not, and rank {b} submitted '{name_b}', which rank "
            f"{a} did not. A grouped call must pass the same tensors, under the same names, on "
            f"every rank (a model wrapped or compiled on some ranks only has its parameter "
            f"names prefixed there: 'module.', '_orig_mod.').")


def _dev(d: int) -> str:
    return "CPU" if d < 0 else f"GPU {d}"


def construct_response(name: str, requests: dict[int, Request], set_ranks: list[int],
                       joined: frozenset = frozenset()) -> Response:
    """Validate the requests that every (non-joined) rank of a process set made for `name`.

    `requests` maps set rank -> request; `set_ranks` maps set rank -> global rank (for messages).
    """
    order = sorted(requests)
    first_rank = order[0]
    first = requests[first_rank]
    g = set_ranks  # set rank -> global rank
    op = TYPE_NAMES[first.type]

    for r in order:
        if requests[r].invalid:
            return _error(name, requests[r],
                          f"{TYPE_NAMES[requests[r].type]} of tensor '{name}' was called with "
                          f"invalid arguments on rank {g[r]}: {requests[r].invalid}")
    for r in order[1:]:
        req = requests[r]
        if req.type != first.type:
            return _error(name, first,
                          f"Mismatched operations on tensor '{name}': rank {g[first_rank]} requested "
                          f"{op} but rank {g[r]} requested {TYPE_NAMES[req.type]}. {_FIX}")
    for r in order[1:]:
        req = requests[r]
        if req.group != first.group or req.group_size != first.group_size:
            return _error(name, first,
                          f"Mismatched grouped {op} on tensor '{name}': rank {g[first_rank]} "
                          f"submitted it {_grouping(first)} but rank {g[r]} "
                          f"{_grouping(req)}. A grouped call must pass the same number of "
                          f"tensors on every rank, in the same order.")
    for r in order[1:]:
        req = requests[r]
        if req.dtype != first.dtype:
            return _error(name, first,
                          f"Mismatched {op} data types on tensor '{name}': rank {g[first_rank]} sent "
                          f"{first.dtype} but rank {g[r]} sent {req.dtype}. Cast the tensor to one "
                          f"dtype on every rank.")
    for r in order[1:]:
        req = requests[r]
        if (req.device < 0) != (first.device < 0):
            return _error(name, first,
                          f"Mismatched {op} devices on tensor '{name}': rank {g[first_rank]} sent a "
                          f"{_dev(first.device)} tensor but rank {g[r]} sent a {_dev(req.device)} "
                          f"tensor. Put the tensor on the same kind of device on every rank.")
    if first.type in REDUCING_TYPES or first.type == BROADCAST:
        for r in order[1:]:
            req = requests[r]
            if req.shape != first.shape:
                return _error(name, first,
                              f"Mismatched {op} tensor shapes on tensor '{name}': rank "
                              f"{g[first_rank]} sent shape {list(first.shape)} but rank {g[r]} sent "
                              f"shape {list(req.shape)}. {op} needs the same shape on every rank.")
    if first.type in (ALLGATHER, ALLTOALL):
        for r in order[1:]:
            req = requests[r]
            if len(req.shape) != len(first.shape) or req.shape[1:] != first.shape[1:]:
                return _error(name, first,
                              f"Mismatched {op} tensor shapes on tensor '{name}': rank "
                              f"{g[first_rank]} sent shape {list(first.shape)} but rank {g[r]} sent "
                              f"shape {list(req.shape)}. Only the first dimension may differ "
                              f"between ranks.")
        if len(first.shape) == 0:
            return _error(name, first, f"{op} of tensor '{name}' needs at least one dimension; "
                                       f"got a scalar. Reshape it to [1].")
    if first.type in REDUCING_TYPES:
        for r in order[1:]:
            req = requests[r]
            if req.reduce_op != first.reduce_op:
                return _error(name, first,
                              f"Mismatched {op} reduce ops on tensor '{name}': rank {g[first_rank]} "
                              f"asked for {REDUCE_OP_NAMES.get(first.reduce_op)} but rank {g[r]} for "
                              f"{REDUCE_OP_NAMES.get(req.reduce_op)}.")
            if req.prescale != first.prescale or req.postscale != first.postscale:
                return _error(name, first,
                              f"Mismatched {op} scale factors on tensor '{name}': rank "
                              f"{g[first_rank]} used prescale={first.prescale}, "
                              f"postscale={first.postscale} but rank {g[r]} used "
                              f"prescale={req.prescale}, postscale={req.postscale}.")
    if first.type == BROADCAST:
        for r in order[1:]:
            req = requests[r]
            if req.root_rank != first.root_rank:
                return _error(name, first,
                              f"Mismatched BROADCAST root ranks on tensor '{name}': rank "
                              f"{g[first_rank]} named root {first.root_rank} but rank {g[r]} named "
                              f"root {req.root_rank}.")
        if first.root_rank not in set_ranks:
            return _error(name, first, f"BROADCAST of tensor '{name}': root rank {first.root_rank} "
                                       f"is not a member of the process set (ranks {set_ranks}).")
    if joined and first.type != ALLREDUCE:
        return _error(name, first,
                      f"{op} of tensor '{name}' is not supported after ranks "
                      f"{sorted(g[r] for r in joined)} called join(): only allreduce can complete "
                      f"with joined ranks (for sparse gradients use sparse_as_dense=True).")

    resp = Response(type=first.type, names=[name], process_set_id=first.process_set_id,
                    dtype=first.dtype, shapes=[first.shape], reduce_op=first.reduce_op,
                    prescale=first.prescale, postscale=first.postscale,
                    root_rank=set_ranks.index(first.root_rank) if first.type == BROADCAST else -1,
                    device=first.device, group=first.group,
                    joined=tuple(sorted(joined)), extra=first.extra)
    size = len(set_ranks)
    if first.type == ALLGATHER:
        resp.rank_dims = [[requests[r].shape[0] for r in range(size)]]
    elif first.type == ALLTOALL:
        matrix = []
        for r in range(size):
            req = requests[r]
            splits = req.splits
            if splits is None:
                dim0 = req.shape[0]
                if dim0 % size:
                    return _error(name, first,
                                  f"ALLTOALL of tensor '{name}': rank {g[r]} sent a first "
                                  f"dimension of {dim0}, which does not divide evenly among "
                                  f"{size} ranks; pass splits=.")
                splits = [dim0 // size] * size
            splits = list(splits)
            if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != req.shape[0]:
                return _error(name, first,
                              f"ALLTOALL of tensor '{name}': rank {g[r]} passed splits {splits}, "
                              f"which must have {size} non-negative entries summing to the first "
                              f"dimension {req.shape[0]}.")
            matrix.append(splits)
        resp.splits = [matrix]
    elif first.type in (ADD_PROCESS_SET, REMOVE_PROCESS_SET):
        for r in order[1:]:
            if requests[r].extra != first.extra:
                what = "add_process_set" if first.type == ADD_PROCESS_SET else "remove_process_set"
                return _error(name, first,
                              f"Mismatched {what}() calls: rank {g[first_rank]} passed "
                              f"{first.extra} but rank {g[r]} passed {requests[r].extra}. Every "
                              f"rank must call it with the same arguments in the same order.")
    return resp
