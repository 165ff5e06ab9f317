"""Gradients as views of one flat buffer per dtype: a step's CPU gradients reduced by one
allreduce, in place, where the engine sends them as one bucket anyway.

Why: on a host with no core to spare per rank (ops.whole_pass) the optimizer already submits a
step's gradients together when backpropagation ends, but each is still its own collective: the
engine fuses them, and on MPI reduces each large one in place with a call of its own and copies
the small ones into a fusion buffer and back (over gloo's TCP, all of them), and each costs an
entry, a handle and a result to write back. Kept in one flat buffer, the gradients need none of
that: one blocking allreduce of the buffer, on the express lane, is the whole reduction, as in
the benchmarks' serial floor. torch DDP's `gradient_as_bucket_view` does the same. On 2 MPI
ranks, one core each (`mpiexec -n 2 python benchmarks/train_step.py --models cnn,mlp`, three
alternating runs against per-gradient allreduces): the CNN's step 26.0-26.4 ms against
26.3-28.4 (0.75-0.79 x DDP's against 0.79-0.85), the MLP's 15.7-16.0 against 15.7-17.7.
Through shared memory, which fuses with no buffer (ops.fuses_in_place), the copies into the
views cost more than the fusion saved, and the flat path is not taken there.

How, and how the ranks stay in step:
1. Each step until the ranks agree goes the per-parameter way: each gradient its own named
   allreduce, fully negotiated, so a rank whose model differs still gets the per-tensor error.
   At the end of the first synchronize() with an engine (after init, or after an elastic
   reset), the ranks of the optimizer's process set agree once, with a blocking Min-allreduce
   named AGREE_NAME, on whether every rank takes the flat path (the engine sends whole passes
   on every rank's host, its transport fuses through a buffer, HVDLITE_FLAT_GRADIENTS is on)
   and whether every rank has the same layout (a digest of the members' wire names, shapes
   and dtypes, in wire-name order).
   Either all ranks take it or none does: a rank alone on the flat path would wait for a
   collective nobody else submits. A rank that has joined (hvd.join) adds zeros to the
   agreement instead of its vote; the others then agree again at their next step, so that
   all of them agree at the first step after the join, the joined rank included.
2. Once they agree, each member's `.grad` becomes a view of its flat buffer. A member is a
   contiguous CPU parameter whose gradient was dense then (synchronize() leaves every
   parameter one, zeros where it had none); a sparse gradient or a GPU tensor stays on the
   per-parameter path.
3. From then on the member's hook copies a fresh gradient into its view while the caches are
   warm (after `zero_grad()`, which sets gradients to None as torch does), or finds the view
   already holding it (gradients accumulate in place when they were zeroed, not set to None).
   `synchronize()` then reduces each flat buffer with one blocking allreduce named after its
   dtype and digest; a member with no gradient this step contributes zeros, as Horovod gives
   an unused parameter, and `.grad` of every member is its view of the result.
4. A member whose parameter no longer matches its view (its dtype or shape changed) sends the
   step back to the per-parameter path and the ranks agree again; so does a new engine.
"""
from __future__ import annotations

import hashlib
import struct

import torch

from ..common import config as _config
from ..common import ops as _ops
from ..common.messages import MIN

# The agreement's collective: one name for every optimizer of a process set. The agreements of
# two optimizers never overlap (each is a blocking call); if two ranks ran them in different
# orders, their digests differ and neither takes the flat path.
AGREE_NAME = "hvdlite.flat_gradients.agree"


def reduce_flat(buffer: torch.Tensor, name: str, op: int, prescale: float, postscale: float,
                process_set) -> None:
    """One flat buffer's allreduce, in place and blocking (the express lane where it is open)."""
    _ops.allreduce_now(buffer, buffer, name=name, op=op, prescale=prescale,
                       postscale=postscale, process_set=process_set)


def _member(p: torch.Tensor) -> bool:
    g = p.grad
    return (g is not None and p.is_cpu and p.is_contiguous() and g.is_cpu and not g.is_sparse
            and g.is_contiguous() and g.dtype == p.dtype and g.shape == p.shape
            and not g.requires_grad)


def _fits(p: torch.Tensor, view: torch.Tensor, address: int) -> bool:
    """Whether p and its gradient (if any) still match its view: same dtype and shape, dense,
    on the CPU, and the view still at `address` in its flat buffer (`module.double()` and the
    like give an existing gradient new data: the same object, elsewhere)."""
    g = p.grad
    return (view.data_ptr() == address and p.dtype == view.dtype and p.shape == view.shape
            and p.is_cpu
            and (g is None or g is view or (g.dtype == view.dtype and g.shape == view.shape
                                            and g.is_cpu and not g.is_sparse)))


def _digest(members: list, wire_names: dict) -> bytes:
    h = hashlib.blake2b(digest_size=8)
    for p in members:
        h.update(f"{wire_names[p]}|{tuple(p.shape)}|{p.dtype};".encode())
    return h.digest()


class FlatGradients:
    """One optimizer's flat gradient buffers (module docstring). `active`: the ranks agreed and
    every member's gradient lives in its view; `views`: member -> its view."""

    def __init__(self):
        self.active = False
        self.views: dict = {}
        self._addresses: dict = {}     # member -> its view's data_ptr() in the flat buffer
        self.buffers: list[tuple[str, torch.Tensor]] = []
        self._engine = None          # the engine the ranks agreed with

    def owns(self, p) -> bool:
        return self.active and p in self.views

    def gradient_ready(self, p) -> None:
        """From p's hook: keep p's gradient in its view (a copy, unless it is already there)."""
        view = self.views[p]
        g = p.grad
        if g is view:
            return
        if not _fits(p, view, self._addresses[p]):
            self._leave()
            return
        view.copy_(g)
        p.grad = view

    def _leave(self) -> None:
        """Off the flat path: this step goes per parameter, and the ranks agree again at its
        end (needs_agreement)."""
        self.active = False
        self._engine = None

    def usable(self) -> bool:
        """At synchronize(): whether this step's members go flat. False after a new engine
        (elastic reset) or a stale layout, which also sends the ranks to agree again."""
        if self.active and (self._engine is not _ops.engine_token() or not all(
                _fits(p, v, self._addresses[p]) for p, v in self.views.items())):
            self._leave()
        return self.active

    def reduce(self, op: int, prescale: float, postscale: float, process_set) -> None:
        """Every member's gradient (zeros where it has none) into its view, then one allreduce
        per flat buffer. `usable()` said True."""
        for p, view in self.views.items():
            g = p.grad
            if g is view:
                continue
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
            p.grad = view
        for name, buffer in self.buffers:
            reduce_flat(buffer, name, op, prescale, postscale, process_set)

    def needs_agreement(self) -> bool:
        """Whether the ranks have yet to agree with this engine: after init, after an elastic
        reset (a new engine: the survivors agree again beside the new workers, whether or not
        they took the flat path before), or after a stale layout."""
        return self._engine is not _ops.engine_token()

    def agree(self, candidates, wire_names: dict, process_set) -> None:
        """Step 1 of the module docstring, at the end of a per-parameter synchronize(): every
        rank of `process_set` calls this at the same step, so the Min-allreduce pairs up."""
        members = sorted((p for p in candidates if p in wire_names and _member(p)),
                         key=lambda p: wire_names[p])
        digest = _digest(members, wire_names)
        lo, hi = struct.unpack("<II", digest)
        # 31 bits each, so their negations fit too, and never 0, so a rank that has joined
        # (hvd.join: it adds zeros to the others' allreduces) shows in the result.
        lo, hi = (lo >> 1) | 1, (hi >> 1) | 1
        want = int(bool(members) and _ops.whole_pass()
                   and not _ops.fuses_in_place(process_set)
                   and _config.env_bool("FLAT_GRADIENTS", True))
        votes = torch.tensor([want, lo, -lo, hi, -hi], dtype=torch.int64)
        _ops.allreduce_now(votes, votes, name=AGREE_NAME, op=MIN, process_set=process_set)
        self.active = False
        if int(votes[1]) == 0:
            # A joined rank took part with zeros and has yet to agree itself: agree again at
            # the next step, which every rank takes together once the join is over.
            return
        self._engine = _ops.engine_token()
        same_layout = int(votes[1]) == -int(votes[2]) and int(votes[3]) == -int(votes[4])
        if int(votes[0]) == 1 and same_layout:
            self._build(members, wire_names, digest.hex())
            self.active = True

    def _build(self, members: list, wire_names: dict, digest: str) -> None:
        """Allocate a flat buffer per dtype (on huge pages where the kernel offers them:
        collectives.host_buffer), and make every member's gradient its view, values kept.
        A new agreement (elastic reset, stale layout) builds new buffers."""
        by_dtype: dict = {}
        for p in members:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.views, self.buffers, self._addresses = {}, [], {}
        for dtype, ps in by_dtype.items():
            numel = sum(p.numel() for p in ps)
            itemsize = torch.empty((), dtype=dtype).element_size()
            flat = _ops.flat_buffer(numel * itemsize)[:numel * itemsize].view(dtype)
            offset = 0
            for p in ps:
                view = flat[offset:offset + p.numel()].view_as(p)
                view.copy_(p.grad)
                p.grad = view
                self.views[p] = view
                self._addresses[p] = view.data_ptr()
                offset += p.numel()
            name = f"allreduce.hvdlite.flat.{str(dtype).replace('torch.', '')}.{digest}"
            self.buffers.append((name, flat))

