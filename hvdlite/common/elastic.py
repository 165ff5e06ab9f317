"""Elastic training runtime shared by every frontend (Horovod's horovod/common/elastic.py).

A frontend builds its states on `State`/`ObjectState` and wraps the user's training function with
`run_fn(func, reset)`, where `reset` shuts its engine down and initialises it again. Everything
here is framework-independent: the few collectives it needs (agreeing on a sync, broadcasting
pickled objects) go straight through the common engine.

How a reset works, and how it differs from Horovod:

- A peer failure makes every survivor's collectives raise `HorovodInternalError`. `run_fn` rolls
  the state back to its last `commit()` (`restore()`), re-initialises (the driver assigns the
  new membership and a new round), and carries on.
- A change of hosts reaches every worker from the driver; `check_host_updates()` (called by
  `commit()`) turns it into a `HostsUpdatedInterrupt` on all ranks at the same step, because the
  ranks first agree on what they have heard through one small allgather.
- After every (re)initialisation, before the training function runs, every rank takes part in one
  allgather of `(needs_sync, commit_count)`. The ranks sync iff any rank needs it (a new worker,
  a rank that rolled back) or their commit counts differ, and the state comes from the rank with
  the most commits. All ranks see the same gathered values, so they can never disagree on whether
  to sync: the deadlock of horovod#3494 (survivors skipping the sync that new workers wait in)
  cannot happen.
"""
from __future__ import annotations

import copy
import functools
import inspect
import logging
import queue
import signal
import threading
from typing import Any, Callable, Iterable, Optional

from . import basics, config, rendezvous
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt
from .host_updates import HostUpdateResult  # noqa: F401  (public here, as in Horovod)

log = logging.getLogger(__name__)

__all__ = ["State", "ObjectState", "HostUpdateResult", "run_fn", "broadcast_object",
           "is_elastic", "HorovodInternalError", "HostsUpdatedInterrupt", "StopRequested",
           "STOP_SIGNALS"]

# Signals that ask a job with durable state to commit, save a checkpoint and exit (a scheduler's
# preemption notice or time limit, a user's kill).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequested(Exception):
    """A stop signal reached some rank; raised on every rank at the same commit."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

# Collective names used by the runtime; fixed, so that survivors and new workers agree.
_AGREE_NAME = "hvdlite.elastic.reset_agreement"
_HOSTS_NAME = "hvdlite.elastic.host_updates"


def is_elastic() -> bool:
    """True in a worker started by `hvdlite-run` in elastic mode."""
    return rendezvous.is_elastic_worker()


def may_resize() -> bool:
    """Whether the job was started elastic (HVDLITE_ELASTIC=1), so its size may change: the
    frontends then keep their reductions over a one-member set (torch's gradient hooks,
    TensorFlow's graph nodes), which skip at run time, instead of leaving them out as Horovod
    does in a job that cannot grow."""
    return config.env("ELASTIC") == "1"


# ---------------------------------------------------------------------- engine helpers
def _engine_allgather_int64(values: list[int], name: str) -> list[list[int]]:
    """Every rank's `values` (same length everywhere), in rank order."""
    import torch

    from . import ops

    t = torch.tensor([list(values)], dtype=torch.int64)
    (out,) = ops.allgather([t], names=name, cacheable=True).wait()
    return [list(map(int, row)) for row in out.reshape(-1, len(values)).tolist()]


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """Pickle `obj` on `root_rank` and return it on every rank (framework-independent)."""
    from . import ops

    if basics.size() == 1:
        return obj
    return ops.broadcast_object(obj, root_rank, name or "hvdlite.elastic.broadcast_object")


def takes_root(fn: Callable[..., Any], before: int = 0) -> bool:
    """Whether `fn` accepts a root rank after `before` positional arguments: hvdlite's
    `bcast_object(obj, root_rank)` and `StateHandler.sync(root_rank)`, against Horovod's
    `bcast_object(obj)` and `sync()`, which broadcast from rank 0.

    Why: Horovod's scripts pass their own one-argument broadcast to ObjectState and subclass
    StateHandler with a `sync(self)`, and after a failure the state must come from the rank
    with the most commits, which need not be rank 0. Callables whose signature cannot be read
    (builtins) are taken to accept it."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = 0
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional += 1
    return positional > before


# ---------------------------------------------------------------------- states
class State:
    """Training state that can be committed in memory, rolled back, and synced to new workers.

    Subclasses implement `save()` (copy the current values aside), `restore()` (go back to the
    copy) and `sync()` (make every rank's current values equal to those of rank
    `self.sync_root`), and may override `reset()` (adapt to a new world size, e.g. samplers).

    `bcast_object(obj, root_rank)` and `get_rank()` default to framework-independent ones;
    Horovod's one-argument `bcast_object(obj)`, which broadcasts from rank 0, works too
    (`broadcast`).
    """

    def __init__(self, bcast_object: Optional[Callable[..., Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None) -> None:
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or basics.rank
        self._host_messages: "queue.Queue[tuple[int, int]]" = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: list[Callable[[], Any]] = []
        # How many commits this state has seen. All ranks commit at the same steps, so equal
        # counts mean equal states; after a rollback the rank with the most commits is the
        # source of truth (one that finished a commit its peers did not reach).
        self._commit_count = 0
        self._sync_root = 0
        # Set by a state that saves checkpoints: the stop signals are then caught (by `run`)
        # and turned into a commit, a save and an exit at the same step on every rank.
        self._stop_watch = False
        self._stop_signal = 0

    # -- Horovod's public API ------------------------------------------------------------
    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Functions called after every reset, once the new membership is known (e.g. to
        scale the learning rate by the new `size()`)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by `run` after each re-initialisation."""
        self._floor_timestamp()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        """Listener for the driver's host updates (called from the notification thread)."""
        self._host_messages.put((int(timestamp), int(update_res)))

    def commit(self) -> None:
        """Save the state in memory (the point `restore()` goes back to), then check for host
        updates. A collective when elastic: every rank must commit at the same steps."""
        self._commit_count += 1
        self.save()
        self._after_commit()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise `HostsUpdatedInterrupt` on every rank when any rank has heard of a host change.

        A collective in an elastic job of more than one rank (one allgather of two integers).
        """
        self._floor_timestamp()
        previous = self._last_updated_timestamp
        latest, flags = previous, 0
        while True:
            try:
                timestamp, result = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > previous:
                latest = max(latest, timestamp)
                flags |= result
        stop = self._stop_signal
        if (is_elastic() or self._stop_watch) and basics.size() > 1:
            rows = _engine_allgather_int64([latest, flags, stop], _HOSTS_NAME)
            latest = max(row[0] for row in rows)
            flags = 0
            for ts, f, _ in rows:
                if ts > previous:
                    flags |= f
            stop = max(row[2] for row in rows)
        if stop:
            raise StopRequested(stop)
        if latest > previous:
            self._last_updated_timestamp = latest
            raise HostsUpdatedInterrupt(skip_sync=flags == HostUpdateResult.removed)

    @property
    def sync_root(self) -> int:
        """The rank `sync()` must broadcast from (chosen by the reset agreement)."""
        return self._sync_root

    # -- for subclasses ------------------------------------------------------------------
    def broadcast(self, obj: Any) -> Any:
        """`obj` as rank `sync_root` holds it, on every rank, through this state's
        `bcast_object`. A one-argument one (Horovod's signature) broadcasts from rank 0, so
        where the root is another rank its values first go to every rank through hvdlite's
        own broadcast: rank 0 then holds the root's, and the user's function still runs."""
        fn = self._bcast_object
        if takes_root(fn, 1):
            return fn(obj, self.sync_root)
        if self.sync_root != 0:
            obj = broadcast_object(obj, self.sync_root, "hvdlite.elastic.to_rank_0")
        return fn(obj)

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        pass

    # -- durable state (a state that saves checkpoints overrides these) --------------------
    def _after_commit(self) -> None:
        """Called by `commit()` after the in-memory save, on every rank at the same step."""

    def _resume(self) -> None:
        """Called by `run` when the job starts (or re-forms with no member holding the last
        commit): load the newest complete checkpoint, if any. No collective: in a round with
        survivors, only the new workers get here."""

    def _save_for_stop(self, signum: int) -> None:
        """Called on every rank when a stop signal was agreed on, after the last commit."""

    # -- runtime -------------------------------------------------------------------------
    def _floor_timestamp(self) -> None:
        """Updates the driver already reflected in the current round are not news."""
        link = rendezvous.driver_link()
        if link is not None and link.round_serial > self._last_updated_timestamp:
            self._last_updated_timestamp = link.round_serial

    def _agree_and_sync(self, need_sync: bool) -> bool:
        """The collective every rank runs after each (re)initialisation: agree on whether to
        sync and from which rank, then sync. Returns whether it synced."""
        if basics.size() == 1:
            return False
        rows = _engine_allgather_int64([1 if need_sync else 0, self._commit_count], _AGREE_NAME)
        counts = [row[1] for row in rows]
        best = max(counts)
        root = counts.index(best)
        if not any(row[0] for row in rows) and len(set(counts)) == 1:
            return False
        self._sync_root = root
        self.sync()
        self._commit_count = best
        self.save()
        return True


class ObjectState(State):
    """Plain Python attributes kept as state: `ObjectState(epoch=0, batch=0)` then
    `state.epoch += 1`. Values are deep-copied on save and restore, so a list mutated in place
    is rolled back too. Horovod's positional `(bcast_object, get_rank, **kwargs)` also works."""

    def __init__(self, bcast_object: Optional[Callable[..., Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr))
                             for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            current = {attr: getattr(self, attr) for attr in self._saved_state}
            synced = self.broadcast(current)
            for attr, value in synced.items():
                setattr(self, attr, value)
            self.save()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


# ---------------------------------------------------------------------- the run decorator
def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Wrap `func(state, *args, **kwargs)` so that it survives failures and host changes.

    `reset` must shut the frontend down and initialise it again (new membership).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        link = rendezvous.driver_link()
        if link is not None:
            link.add_listener(state.on_hosts_updated)
        need_sync = True
        reset_required = False
        previous = _watch_stop_signals(state)
        try:
            if link is None or link.round == 1 or link.from_checkpoint:
                state._resume()
            while True:
                try:
                    if reset_required:
                        reset()
                        state.on_reset()
                        reset_required = False
                    state._agree_and_sync(need_sync)
                    need_sync = False
                    return func(state, *args, **kwargs)
                except HorovodInternalError as exc:
                    if not is_elastic():
                        raise
                    log.warning("elastic: %s; rolling back to the last commit and re-forming "
                                "the job", exc)
                    state.restore()
                    need_sync = True
                except HostsUpdatedInterrupt as exc:
                    need_sync = need_sync or not exc.skip_sync
                except StopRequested as exc:
                    state._save_for_stop(exc.signum)
                    raise SystemExit(128 + exc.signum) from None
                reset_required = True
        finally:
            for signum, handler in previous.items():
                if handler is not None:
                    signal.signal(signum, handler)
            if link is not None:
                link.remove_listener(state.on_hosts_updated)

    return wrapper


def _watch_stop_signals(state: State) -> dict:
    """For a state that saves checkpoints: SIGTERM/SIGUSR1 only mark the state, which
    commits, saves and exits at its next `commit()` on every rank; more of them while that is
    pending change nothing (a launcher's SIGKILL after its grace period still ends a rank that
    never commits). A handler that was there before (the flight recorder's dump on SIGUSR1)
    still runs. Returns the handlers to put back."""
    if not state._stop_watch or threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}

    def on_signal(signum, frame):
        before = previous.get(signum)
        if callable(before) and signum != signal.SIGTERM:
            before(signum, frame)
        if state._stop_signal:
            return
        state._stop_signal = signum
        log.warning("elastic: %s received: committing, saving a checkpoint and exiting at the "
                    "next commit", signal.Signals(signum).name)

    for signum in STOP_SIGNALS:
        previous[signum] = signal.signal(signum, on_signal)
    return previous
