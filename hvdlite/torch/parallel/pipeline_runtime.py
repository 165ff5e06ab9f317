"""Running a pipeline's schedule: each stage's send/receive program, micro-batch forwards and
backwards, receives posted ahead, and the step's timings."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import _comm, p2p, schedule as _schedule
from .random import checkpoint as _rng_checkpoint
from .pipeline_values import (_ACT, _LOOKAHEAD, PipelineError, _check_value, _detach_value, _rows,
                              _split, _tensors, _to)
from .skip import _run_layers


@dataclass
class PipelineStats:
    """Timings of the last train_step/forward on this stage (seconds)."""
    wall: float = 0.0
    compute: float = 0.0
    wait: float = 0.0
    actions: list = field(default_factory=list)     # (Action, start, end) relative to step start

    @property
    def idle(self) -> float:
        """Fraction of the step this stage did not compute (its share of the bubble, plus
        communication it could not hide)."""
        return 0.0 if self.wall <= 0 else max(0.0, 1.0 - self.compute / self.wall)


@dataclass
class _Record:
    received: dict = field(default_factory=dict)    # Msg -> values
    leaves: list = field(default_factory=list)      # (Msg, value index, slot, tensor)
    sent: dict = field(default_factory=dict)        # Msg -> values
    loss: Optional[torch.Tensor] = None


class _Step:
    def __init__(self):
        self.inbox: dict = {}
        self.outbox: dict = {}
        self.posted: dict = {}
        self.sends: list = []
        self.expect_grad: set = set()
        self.records: dict = {}
        self.loss: Optional[torch.Tensor] = None
        self.outputs: dict = {}
        self.keep_outputs = True
        self.stats = PipelineStats()


class _Runtime:
    """The schedule runtime (a mixin of `Pipeline`)."""

    def _device(self):
        for t in itertools.chain(self.parameters(), self.buffers()):
            return t.device
        return None

    def _msg_name(self, msg: _schedule.Msg) -> str:
        kind = "fwd" if msg.kind == "F" else "bwd"
        return f"pipe{self._uid}.{kind}.{msg.src}>{msg.dst}.mb{msg.mb}"

    def _pair(self, a: int, b: int):
        ra, rb = self.stage_ranks[a], self.stage_ranks[b]
        return self._pair_sets[frozenset((ra, rb))]

    def _run(self, training: bool, inputs, targets, loss_fn, keep_outputs: bool = True
             ) -> _Step:
        if self._broken is not None:
            raise PipelineError(f"this pipeline cannot run again: {self._broken}")
        m, s, p = self.chunks, self.stage, self.num_stages
        step = _Step()
        step.keep_outputs = keep_outputs
        device = self._device()
        mb_in = mb_tgt = None
        if s == 0:
            if inputs is None:
                raise ValueError("the first pipeline stage needs inputs")
            mb_in = _split(inputs, m, "inputs")
        weights = [1.0] * m
        if s == p - 1 and training:
            if targets is not None:
                mb_tgt = _split(targets, m, "targets")
                if self.loss_reduction == "mean":
                    rows = [_rows(t) for t in mb_tgt]
                    total = sum(rows)
                    weights = [r / total for r in rows]
            elif self.loss_reduction == "mean":
                weights = [1.0 / m] * m
        program = self._program if training else self._program_fwd
        params = [q for q in self.parameters() if q.requires_grad] if training else []
        grad_acc: dict = {}
        t_start = time.perf_counter()
        try:
            for idx, (kind, what) in enumerate(program):
                self._prefetch(step, program, idx, device)
                if kind == "recv":
                    if what.kind == "B" and what not in step.expect_grad:
                        continue
                    handle = step.posted.pop(what, None) or self._post(what, device)
                    t0 = time.perf_counter()
                    values = handle.wait(timeout=self.timeout, warn_after=self.warn_after,
                                         on_warn=self._warner(what, program, idx),
                                         on_timeout=self._timeouter(what, program, idx))
                    step.stats.wait += time.perf_counter() - t0
                    step.inbox[what] = self._check_received(what, values, step)
                elif kind == "send":
                    values = step.outbox.pop(what, None)
                    if values is None:
                        continue
                    dst = self.stage_ranks[what.dst]
                    step.sends.append(p2p.send(values, dst, self._msg_name(what),
                                               process_set=self._pair(what.src, what.dst)))
                else:
                    t0 = time.perf_counter()
                    if what.kind == "F":
                        self._forward(step, what.mb, training, mb_in, mb_tgt, loss_fn, weights,
                                      device)
                    else:
                        self._backward(step, what.mb, params, grad_acc)
                    t1 = time.perf_counter()
                    step.stats.compute += t1 - t0
                    step.stats.actions.append((what, t0 - t_start, t1 - t_start))
            t0 = time.perf_counter()
            for sh in step.sends:
                for h in sh._handles:
                    _comm.wait_handle(h, timeout=self.timeout, warn_after=self.warn_after,
                                      on_warn=self._send_warner(sh),
                                      on_timeout=self._send_timeouter(sh))
                sh._handles = []
            step.stats.wait += time.perf_counter() - t0
        except BaseException as exc:
            # Messages of this step may still be in flight under names the next step would
            # reuse: refuse to run again rather than pair them with the wrong step.
            self._broken = (f"an earlier step failed on this stage with {type(exc).__name__}: "
                            f"{exc}"[:600] + "; build a new Pipeline after fixing the cause "
                            "(every rank must)")
            raise
        step.stats.wall = time.perf_counter() - t_start
        for q, g in grad_acc.items():
            if q.grad is None:
                q.grad = g
            else:
                q.grad.add_(g)
        self.last_stats = step.stats
        return step

    # ------------------------------------------------------------------ messages
    def _post(self, msg, device):
        src = self.stage_ranks[msg.src]
        return p2p.irecv(src, self._msg_name(msg), process_set=self._pair(msg.src, msg.dst),
                         device=device)

    def _prefetch(self, step: _Step, program, idx: int, device) -> None:
        for kind, what in program[idx:idx + _LOOKAHEAD]:
            if kind != "recv" or what in step.posted or what in step.inbox:
                continue
            if what.kind == "B" and what not in step.expect_grad:
                continue
            if what.kind == "B" and what.mb not in step.records:
                continue       # its forward has not run yet here: we do not know if it comes
            step.posted[what] = self._post(what, device)

    def _check_received(self, msg, values, step: _Step):
        if msg.kind == "F":
            want = self._edge_items[(msg.src, msg.dst)]
            if not isinstance(values, list) or len(values) != len(want):
                got = len(values) if isinstance(values, list) else type(values).__name__
                raise PipelineError(f"stage {self.stage} expected {len(want)} values in "
                                    f"{msg.describe()} ({self._describe_items(want)}), got {got}")
            return values
        sent = step.records[msg.mb].sent[_schedule.Msg("F", msg.dst, msg.src, msg.mb)]
        if not isinstance(values, list) or len(values) != len(sent):
            raise PipelineError(f"stage {self.stage}: {msg.describe()} does not match the "
                                f"{len(sent)} values it sent forward")
        return values

    def _use_checkpoint(self, mb: int, training: bool) -> bool:
        if not training or self.checkpoint == "never":
            return False
        return self.checkpoint == "always" or mb != self.chunks - 1

    def _stage_fn(self, x, skips_in: dict):
        skips = dict(skips_in)
        y = _run_layers(self._local, x, skips)
        return y, {name: skips[name] for name in self._skip_out}

    def _forward(self, step: _Step, mb: int, training: bool, mb_in, mb_tgt, loss_fn, weights,
                 device) -> None:
        s = self.stage
        rec = _Record()
        x = None
        skips_in: dict = {}
        if s == 0:
            x = _to(mb_in[mb], device)
        for (a, b) in self._edges:
            if b != s:
                continue
            msg = _schedule.Msg("F", a, s, mb)
            values = step.inbox.pop(msg)
            rec.received[msg] = values
            for v_idx, (item, value) in enumerate(zip(self._edge_items[(a, b)], values)):
                if item == _ACT:
                    x = value
                else:
                    skips_in[item] = value
                for slot, t in _tensors(value):
                    if t.requires_grad:
                        rec.leaves.append((msg, v_idx, slot, t))
        if self._use_checkpoint(mb, training):
            y, skips_out = _rng_checkpoint(self._stage_fn, x, skips_in)
        else:
            y, skips_out = self._stage_fn(x, skips_in)
        _check_value(y, f"the output of stage {s} (layer {self.partition[s][1] - 1})")
        if s == self.num_stages - 1:
            if training:
                tgt = mb_tgt[mb] if mb_tgt is not None else None
                loss = loss_fn(y, _to(tgt, device)) if tgt is not None else loss_fn(y)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise PipelineError(f"loss_fn must return a scalar tensor, got "
                                        f"{type(loss).__name__}"
                                        + (f" of shape {list(loss.shape)}"
                                           if isinstance(loss, torch.Tensor) else ""))
                loss = loss.reshape(()) * weights[mb]
                rec.loss = loss
                step.loss = loss.detach() if step.loss is None else step.loss + loss.detach()
            if step.keep_outputs:
                step.outputs[mb] = _detach_value(y)
        for (a, b) in self._edges:
            if a != s:
                continue
            msg = _schedule.Msg("F", s, b, mb)
            values = [y if item == _ACT else skips_out[item] for item in self._edge_items[(a, b)]]
            for item, value in zip(self._edge_items[(a, b)], values):
                _check_value(value, f"stage {s}'s " + ("output" if item == _ACT
                                                       else f"skip {item!r}"))
            step.outbox[msg] = values
            if training:
                rec.sent[msg] = values
                if any(t.requires_grad for v in values for _, t in _tensors(v)):
                    step.expect_grad.add(_schedule.Msg("B", b, s, mb))
        if training:
            step.records[mb] = rec

    def _backward(self, step: _Step, mb: int, params: list, grad_acc: dict) -> None:
        s = self.stage
        rec = step.records.pop(mb)
        outs: list = []
        grads: list = []
        if rec.loss is not None and rec.loss.requires_grad:
            outs.append(rec.loss)
            grads.append(torch.ones_like(rec.loss))
        for msg_f, values in rec.sent.items():
            msg_b = _schedule.Msg("B", msg_f.dst, s, mb)
            if msg_b not in step.expect_grad:
                continue
            step.expect_grad.discard(msg_b)
            gvalues = step.inbox.pop(msg_b)
            for value, gvalue in zip(values, gvalues):
                for slot, t in _tensors(value):
                    g = gvalue if slot is None else (gvalue[slot] if gvalue is not None else None)
                    if g is not None and t.requires_grad:
                        outs.append(t)
                        grads.append(g)
        leaves = [t for _, _, _, t in rec.leaves]
        inputs = leaves + params
        if outs and inputs:
            res = torch.autograd.grad(outs, inputs, grads, allow_unused=True)
        else:
            res = [None] * len(inputs)
        for q, g in zip(params, res[len(leaves):]):
            if g is None:
                continue
            acc = grad_acc.get(q)
            if acc is None:
                grad_acc[q] = g
            else:
                acc.add_(g)
        leaf_grads = {id(t): g for t, g in zip(leaves, res[:len(leaves)])}
        for msg_f, values in rec.received.items():
            if not any(t.requires_grad for v in values for _, t in _tensors(v)):
                continue
            gvalues = []
            for value in values:
                if isinstance(value, torch.Tensor):
                    gvalues.append(leaf_grads.get(id(value)) if value.requires_grad else None)
                elif isinstance(value, (tuple, list)):
                    gvalues.append(tuple(leaf_grads.get(id(t)) if isinstance(t, torch.Tensor)
                                         and t.requires_grad else None for t in value))
                else:
                    gvalues.append(None)
            step.outbox[_schedule.Msg("B", s, msg_f.src, mb)] = gvalues

