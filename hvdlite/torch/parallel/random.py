"""Reproducible randomness for tensor parallelism (Megatron's RNG tracker, on CPU and CUDA).

Two streams:
* the default torch generator, seeded with the same `seed` on every rank of a tensor-parallel
  group: dropout on replicated activations (outside TP regions) draws the same mask on every
  tensor-parallel rank, so the replicas stay identical;
* a tracked "model-parallel" stream seeded with `seed + 2718 + tp_rank`: dropout on sharded
  activations (inside TP regions, e.g. attention probabilities of this rank's heads) draws a
  different mask on each tensor-parallel rank and the same one on every data-parallel replica.

    parallel.model_parallel_seed(1234)            # after mesh(); on every rank
    x = F.dropout(x, 0.1)                          # replicated region
    with parallel.get_rng_tracker().fork():
        probs = F.dropout(probs, 0.1)              # sharded region

`checkpoint(fn, *args)` recomputes `fn` during backward with both streams restored to what they
were in the forward pass, so recomputed dropout masks match.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

from . import _comm
from .groups import default_tp_set

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_state():
    return (torch.get_rng_state(), torch.cuda.get_rng_state_all() if _cuda_ready() else None)


def _set_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None and _cuda_ready():
        torch.cuda.set_rng_state_all(cuda)


class RNGStatesTracker:
    """Named random-number-generator states that `fork(name)` swaps in and out."""

    def __init__(self):
        self._states: dict = {}
        self._seeds: dict = {}

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict:
        """A snapshot of every tracked state (safe to keep: states are replaced, not mutated)."""
        return dict(self._states)

    def set_states(self, states: dict) -> None:
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Track a new stream `name` seeded with `seed`."""
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists (seeded with "
                             f"{self._seeds[name]}); call reset() first")
        for other, s in self._seeds.items():
            if s == seed:
                raise ValueError(f"seed {seed} is already used by RNG state {other!r}")
        # Fresh generators: seeding the global one would also queue a lazy CUDA re-seed.
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = None
        if _cuda_ready():
            cuda = [torch.Generator(device=f"cuda:{i}").manual_seed(seed).get_state()
                    for i in range(torch.cuda.device_count())]
        self._states[name] = (cpu, cuda)
        self._seeds[name] = seed

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Draw random numbers from stream `name` inside the block; the default stream is left
        exactly as it was."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} is not tracked; call "
                           f"hvdlite.torch.parallel.model_parallel_seed(seed) (or "
                           f"get_rng_tracker().add({name!r}, seed)) first")
        saved = _get_state()
        _set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state()
            _set_state(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Megatron's get_cuda_rng_tracker)."""
    return _TRACKER


def model_parallel_seed(seed: int, process_set=None) -> RNGStatesTracker:
    """Seed the default generator with `seed` (same on every rank) and the tracked model-parallel
    stream with `seed + 2718 + tp_rank` (Megatron's model_parallel_cuda_manual_seed)."""
    ps = default_tp_set(process_set)
    tp_rank = _comm.set_rank(ps)
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)
    return _TRACKER


def tracker_context_fn():
    """A `context_fn` for torch.utils.checkpoint that restores the tracked streams during
    recomputation to their state at the original forward pass."""
    snapshot = _TRACKER.get_states()

    @contextlib.contextmanager
    def recompute():
        current = _TRACKER.get_states()
        _TRACKER.set_states(snapshot)
        try:
            yield
        finally:
            _TRACKER.set_states(current)

    return contextlib.nullcontext(), recompute()


def checkpoint(function, *args, preserve_rng_state: bool = True, **kwargs):
    """Activation checkpointing that also replays the tracked RNG streams (non-reentrant
    torch.utils.checkpoint underneath: nested inputs/outputs and torch.autograd.grad work)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             preserve_rng_state=preserve_rng_state,
                                             context_fn=tracker_context_fn, **kwargs)
