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

from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from ...common import basics as _basics
from ...common.config import Settings
from . import _comm, balance as _balance, p2p, schedule as _schedule
from .groups import default_pp_set
from .pipeline_values import _ACT, PipelineError, PipelineTimeoutError, _cat, _pipeline_ids
from .skip import Pop, SkipSequential, Stash, _skip_layout
from .pipeline_build import _Construction
from .pipeline_runtime import PipelineStats, _Runtime
from .pipeline_stall import _StallDiagnostics


# ---------------------------------------------------------------------- the pipeline
BalanceSpec = Union[None, str, Sequence[int]]


class Pipeline(_Construction, _Runtime, _StallDiagnostics, nn.Module):
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
        timeout: seconds a stage waits for one message before it raises
            PipelineTimeoutError (default: the engine's HOROVOD_STALL_SHUTDOWN_TIME_SECONDS;
            0 = never).
        warn_after: seconds a stage waits for one message before it logs which message it
            waits for (default: HOROVOD_STALL_CHECK_TIME_SECONDS; 0 = never).

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


__all__ = ["Pipeline", "PipelineError", "PipelineStats", "PipelineTimeoutError", "Pop",
           "SkipSequential", "Stash"]
