"""Pipeline parallelism: a layer list split into stages, one stage per rank of a process set,
trained micro-batch by micro-batch with a GPipe or 1F1B schedule.

    layers = [Embed(), Stash("emb"), Block(), Block(), Pop("emb"), Head()]
    pipe = Pipeline(layers, balance="uniform", chunks=8, schedule="1f1b",
                    process_set=mesh.pp)             # every rank builds it, same arguments
    loss = pipe.train_step(tokens, targets, loss_fn)  # loss on the last stage, None elsewhere
    opt.step()                                        # this stage's parameters only

Stages exchange activations and gradients as named point-to-point messages (see p2p.py) over
two-rank process sets; a Stash/Pop pair is a skip connection, sent straight from the stage that
stashes to every stage that pops, without passing through the stages between. The schedule is
lowered to every stage's send/receive program and simulated before anything runs (schedule.py),
and a stage that waits too long for a message names it.

Gradients are accumulated into `.grad` once per `train_step` (summed over micro-batches), without
firing per-micro-batch gradient hooks, so `hvd.DistributedOptimizer(..., process_set=mesh.dp)`
reduces each gradient once, at `step()`.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from .. import mpi_ops
from ...common import basics as _basics
from ...common.config import Settings
from ...common.exceptions import HorovodInternalError
from . import _comm, balance as _balance, p2p, schedule as _schedule
from .groups import default_pp_set
from .random import checkpoint as _rng_checkpoint

log = logging.getLogger(__name__)

_ACT = "\x00act"               # the edge item that carries the main activation
_LOOKAHEAD = 8                 # program ops ahead of the current one whose receives are posted
_pipeline_ids = itertools.count()


class PipelineError(RuntimeError):
    """A pipeline was used in a way it cannot run (bad arguments at run time, broken state)."""


class PipelineTimeoutError(HorovodInternalError):
    """A stage waited longer than its timeout for a message; the text names the message."""


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


# ---------------------------------------------------------------------- helpers
def _split(x, m: int, what: str) -> list:
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or x.shape[0] < m:
            raise ValueError(f"{what}: chunks={m} needs at least {m} rows along dimension 0 "
                             f"(one per micro-batch), got shape {list(x.shape)}")
        return list(torch.tensor_split(x, m, dim=0))
    if isinstance(x, (tuple, list)):
        if not x:
            raise ValueError(f"{what} is an empty {type(x).__name__}")
        parts = [_split(v, m, f"{what}[{k}]") for k, v in enumerate(x)]
        rows = {tuple(q.shape[0] for q in part) for part in parts}
        if len(rows) != 1:
            raise ValueError(f"{what}: every tensor must have the same number of rows along "
                             f"dimension 0 to be split into micro-batches")
        return [type(x)(col) for col in zip(*parts)]
    raise TypeError(f"{what} must be a tensor or a tuple/list of tensors, not "
                    f"{type(x).__name__}")


def _rows(x) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.shape[0]) if x.dim() else 1
    return _rows(x[0])


def _to(x, device):
    if device is None:
        return x
    if isinstance(x, torch.Tensor):
        return x if x.device == device else x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    return x


def _tensors(value) -> list[tuple[Any, torch.Tensor]]:
    """(slot, tensor) for each tensor of a message value; slot None for a bare tensor."""
    if isinstance(value, torch.Tensor):
        return [(None, value)]
    if isinstance(value, (tuple, list)):
        return [(j, t) for j, t in enumerate(value) if isinstance(t, torch.Tensor)]
    return []


def _check_value(value, where: str) -> None:
    if value is None or isinstance(value, torch.Tensor):
        return
    if isinstance(value, (tuple, list)):
        for j, t in enumerate(value):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}[{j}] is a {type(t).__name__}; stage boundaries carry "
                                f"tensors or tuples of tensors")
        return
    raise TypeError(f"{where} is a {type(value).__name__}; stage boundaries carry tensors or "
                    f"tuples of tensors")


def _cat(parts: list):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    return type(first)(_cat([p[k] for p in parts]) for k in range(len(first)))


def _detach_value(v):
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, (tuple, list)):
        return type(v)(_detach_value(x) for x in v)
    return v


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


# ---------------------------------------------------------------------- the pipeline
BalanceSpec = Union[None, str, Sequence[int]]


class Pipeline(nn.Module):
    """Pipeline-parallel training of `layers` over the ranks of `process_set` (stage s runs on
    the set's s-th rank).

    Args:
        layers: modules run in order (an nn.Sequential or a list); each takes one argument, the
            previous layer's output (a tensor or a tuple of tensors). `Stash(name)`/`Pop(name)`
            make skip connections. An element may also be a zero-argument factory returning a
            module, called only on the rank that owns the layer (with an explicit or "uniform"
            balance).
        balance: layers per stage: None or "uniform" (equal counts), a list of counts, "params"
            (even parameter counts) or "time" (even measured forward+backward time on `sample`).
        chunks: micro-batches per step (inputs are split along dimension 0; uneven splits are
            fine: torch.tensor_split).
        schedule: "1f1b" (default; at most p-s micro-batches held by stage s), "gpipe" (all
            forwards then all backwards), or a custom list of per-stage action lists ("F0",
            "B0", ...), validated and simulated before use.
        checkpoint: "never", "except_last" (recompute all but the last micro-batch in backward)
            or "always"; recomputation replays the default and tracked RNG streams.
        process_set: the pipeline group; None means the current mesh's pp group, else every rank.
        loss_reduction: "mean" (default): the returned loss and the gradients are those of the
            whole batch's mean, each micro-batch's loss weighted by its share of the targets'
            rows (loss_fn should return a mean); "sum": micro-batch losses are added.
        sample: one micro-batch of inputs, needed by balance="time".
        timeout / warn_after: seconds a stage waits for one message before it raises
            PipelineTimeoutError / logs which message it waits for (defaults: the engine's
            HOROVOD_STALL_SHUTDOWN_TIME_SECONDS and HOROVOD_STALL_CHECK_TIME_SECONDS; 0 = never).

    Constructing a Pipeline is a collective over the whole job (it registers the two-rank
    process sets the stages talk on): every rank builds its pipeline at the same point, with the
    same layer list and arguments as the other ranks of its group. Bad arguments raise the same
    error on every rank before any communication.
    """

    def __init__(self, layers, balance: BalanceSpec = None, chunks: int = 1,
                 schedule: Union[str, Sequence] = "1f1b", checkpoint: str = "never",
                 process_set=None, *, loss_reduction: str = "mean", sample=None,
                 timeout: Optional[float] = None, warn_after: Optional[float] = None):
        super().__init__()
        if isinstance(layers, nn.Sequential):
            layers = list(layers.children())
        elif isinstance(layers, nn.Module):
            raise TypeError("Pipeline(layers) takes an nn.Sequential or a list of modules, not a "
                            "single module")
        else:
            layers = list(layers)
        if not layers:
            raise ValueError("Pipeline needs at least one layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, nn.Module) and not callable(layer):
                raise TypeError(f"layer {i} is a {type(layer).__name__}: pass modules or "
                                f"zero-argument factories that return one")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an integer >= 1 (micro-batches per step), got "
                             f"{chunks!r}")
        if checkpoint not in ("never", "except_last", "always"):
            raise ValueError(f"checkpoint must be 'never', 'except_last' or 'always', not "
                             f"{checkpoint!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', not {loss_reduction!r}")
        ps = default_pp_set(process_set)
        p, s = _comm.set_size(ps), _comm.set_rank(ps)
        self.process_set = ps
        self.num_stages, self.stage = p, s
        self.stage_ranks = list(ps.ranks) if ps.ranks else list(range(_basics.size()))
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.loss_reduction = loss_reduction
        n = len(layers)
        stash_at, pops_at = _skip_layout(layers)
        self.schedule_name = schedule if isinstance(schedule, str) else "custom"
        if isinstance(schedule, str):
            _schedule.build(schedule, p, chunks)           # rejects unknown names now
        settings = Settings.from_env()
        self.timeout = settings.stall_shutdown_s if timeout is None else float(timeout)
        self.warn_after = (0.0 if settings.stall_check_disable else settings.stall_warning_s) \
            if warn_after is None else float(warn_after)

        # Layer counts per stage; "time" is measured later, after every rank agreed to it.
        counts = self._balance(balance, layers, p, sample)
        spec = ("time" if balance == "time" else
                "uniform" if balance is None or balance == "uniform" else
                "params" if balance == "params" else "list",
                chunks, self.schedule_name,
                None if isinstance(schedule, str) else
                [[str(a) for a in acts] for acts in _schedule.build(schedule, p, chunks)],
                checkpoint, loss_reduction, n,
                tuple(sorted((k, v) for k, v in stash_at.items())),
                tuple(sorted((k, tuple(v)) for k, v in pops_at.items())))
        if counts is not None:
            # Check the schedule now, before any communication, so a bad one fails alike
            # everywhere (it is checked again below for balance='time').
            _schedule.simulate(_schedule.build(schedule, p, chunks), chunks,
                               sorted(self._layout(counts, stash_at, pops_at, p)))
        self._uid = next(_pipeline_ids)
        from ..functions import allgather_object
        info = {"rank": _basics.rank(), "group": tuple(self.stage_ranks), "spec": spec,
                "counts": None if counts is None else tuple(counts)}
        infos = allgather_object(info, name=f"hvdlite.parallel.pipeline{self._uid}.layout")
        self._check_layouts(infos, ["balance", "chunks", "schedule", "custom schedule",
                                    "checkpoint", "loss_reduction", "number of layers",
                                    "Stash layers", "Pop layers"], "spec")
        timed = [i["rank"] for i in infos if i["spec"][0] == "time"]
        if timed and len(timed) != len(infos):
            others = sorted(set(i["rank"] for i in infos) - set(timed))
            raise PipelineError(
                f"balance='time' measures layers on every rank of the job and must be used by "
                f"all of them: ranks {timed[:8]} use it but ranks {others[:8]} do not")
        if counts is None:
            counts = _balance.by_cost(self._time_costs(layers, sample), p)
        self._check_layouts(infos, ["balance (layer counts per stage)"], "counts")
        for i in infos:
            # Every group's edges, from its own split and skip layout ("time" splits are the
            # same everywhere: the costs are a job-wide average).
            c = list(counts) if i["counts"] is None else list(i["counts"])
            i["edges"] = sorted(self._layout(c, dict(i["spec"][7]),
                                             {k: list(v) for k, v in i["spec"][8]},
                                             len(i["group"])))
        edges_items = self._layout(counts, stash_at, pops_at, p)
        self.balance = list(counts)
        starts = [sum(counts[:k]) for k in range(p)]
        self.partition = [(a, a + c) for a, c in zip(starts, counts)]
        self._edge_items = edges_items
        self._edges = sorted(edges_items)
        self._skip_out = sorted({x for (a, _), v in edges_items.items() if a == s
                                 for x in v if x != _ACT})

        # The schedule: built, validated and simulated (raises on every rank alike).
        actions = _schedule.build(schedule, p, chunks)
        self.schedule_report = _schedule.simulate(actions, chunks, self._edges)
        self._actions = actions
        self._program = _schedule.lower(actions[s], s, self._edges)
        self._program_fwd = _schedule.lower(_schedule.forward_only(p, chunks)[s], s, self._edges)

        pairs = sorted({tuple(sorted((i["group"][a], i["group"][b])))
                        for i in infos for (a, b) in i["edges"]})
        self._pair_sets = p2p.connect(pairs) if pairs else {}

        # Build (factories) and keep only this stage's layers.
        lo, hi = self.partition[s]
        local = {}
        for i in range(lo, hi):
            layer = layers[i]
            if not isinstance(layer, nn.Module):
                layer = layer()
                if not isinstance(layer, nn.Module):
                    raise TypeError(f"the factory of layer {i} returned a "
                                    f"{type(layer).__name__}, not an nn.Module")
                if isinstance(layer, (Stash, Pop)):
                    raise TypeError(f"the factory of layer {i} returned a {type(layer).__name__}; "
                                    f"put Stash/Pop layers in the list directly")
            local[str(i)] = layer
        self.layers = nn.ModuleDict(local)
        self._local = [(int(k), v) for k, v in local.items()]
        self._broken: Optional[str] = None
        self.last_stats: Optional[PipelineStats] = None

    # ------------------------------------------------------------------ construction helpers
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
    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def edges(self) -> list[tuple[int, int]]:
        """(src stage, dst stage) pairs that exchange activations: neighbours and skips."""
        return list(self._edges)

    def simulate(self, t_f=1.0, t_b=2.0) -> _schedule.ScheduleReport:
        """Simulate this pipeline's schedule with the given per-stage forward/backward times."""
        return _schedule.simulate(self._actions, self.chunks, self._edges, t_f, t_b)

    def extra_repr(self) -> str:
        lo, hi = self.partition[self.stage]
        return (f"stage {self.stage}/{self.num_stages} (ranks {self.stage_ranks}), layers "
                f"{lo}..{hi - 1}, balance={self.balance}, chunks={self.chunks}, "
                f"schedule={self.schedule_name!r}, checkpoint={self.checkpoint!r}")

    # ------------------------------------------------------------------ running
    def train_step(self, inputs=None, targets=None, loss_fn: Optional[Callable] = None, *,
                   return_outputs: bool = False):
        """Forward and backward of one batch, split into `chunks` micro-batches.

        Every stage calls it. `inputs` are read on the first stage and `targets` and `loss_fn`
        (`loss_fn(output, target) -> scalar`, or `loss_fn(output)` without targets) on the last;
        other stages may pass None. Gradients are added to this stage's parameters' `.grad`.
        Returns the batch loss (a detached scalar) on the last stage, None on the others; with
        `return_outputs=True`, `(loss, outputs)` where outputs are the last stage's outputs for
        the whole batch (None on other stages)."""
        if self.is_last_stage and loss_fn is None:
            raise ValueError("train_step needs loss_fn on the last stage")
        step = self._run(True, inputs, targets, loss_fn, keep_outputs=return_outputs)
        loss = step.loss if self.is_last_stage else None
        if return_outputs:
            outs = None
            if self.is_last_stage:
                outs = _cat([step.outputs[i] for i in range(self.chunks)])
            return loss, outs
        return loss

    def forward(self, inputs=None):
        """Forward only (no gradients), micro-batched: the whole batch's outputs on the last
        stage, None on the others. Every stage calls it."""
        with torch.no_grad():
            step = self._run(False, inputs, None, None)
        if not self.is_last_stage:
            return None
        return _cat([step.outputs[i] for i in range(self.chunks)])

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

    @staticmethod
    def _describe_items(items) -> str:
        return ", ".join("the activation" if x == _ACT else f"skip {x!r}" for x in items)

    def _where(self, program, idx: int) -> str:
        nxt = next((w for k, w in program[idx:] if k == "compute"), None)
        done = sum(1 for k, _ in program[:idx] if k == "compute")
        total = sum(1 for k, _ in program if k == "compute")
        return (f"after {done} of {total} actions of its {self.schedule_name} schedule"
                + (f", before {nxt}" if nxt is not None else ""))

    def _wait_text(self, msg, waited: float, program, idx: int) -> str:
        what = "activations" if msg.kind == "F" else "gradients"
        return (f"pipeline stage {self.stage} (rank {_basics.rank()}) has waited {waited:.1f} s "
                f"for message '{self._msg_name(msg)}': the {what} of micro-batch {msg.mb} from "
                f"stage {msg.src} (rank {self.stage_ranks[msg.src]}), "
                f"{self._where(program, idx)}")

    def _warner(self, msg, program, idx):
        def warn(waited: float) -> None:
            log.warning("%s. Is that stage running the same schedule, or stuck itself?",
                        self._wait_text(msg, waited, program, idx))
        return warn

    def _timeouter(self, msg, program, idx):
        def make(waited: float) -> Exception:
            return PipelineTimeoutError(self._wait_text(msg, waited, program, idx)
                                        + f"; giving up after the {self.timeout:g} s timeout")
        return make

    def _send_warner(self, sh):
        def warn(waited: float) -> None:
            log.warning("pipeline stage %d (rank %d) has waited %.1f s for rank %d to receive "
                        "message '%s'", self.stage, _basics.rank(), waited, sh.dst, sh.name)
        return warn

    def _send_timeouter(self, sh):
        def make(waited: float) -> Exception:
            return PipelineTimeoutError(
                f"pipeline stage {self.stage} (rank {_basics.rank()}): rank {sh.dst} did not "
                f"receive message '{sh.name}' within {self.timeout:g} s")
        return make

    # ------------------------------------------------------------------ compute
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


__all__ = ["Pipeline", "PipelineError", "PipelineTimeoutError", "PipelineStats", "Stash", "Pop",
           "SkipSequential"]
