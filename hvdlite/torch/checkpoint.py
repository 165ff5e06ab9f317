"""Sharded, asynchronous checkpoints in torch.distributed.checkpoint's (DCP) format.

Why: elastic state survives the loss of some workers in memory, but not the loss of the whole
job (every host preempted, a time limit, a bug on every rank). `torch.save` on rank 0 stops
training for the whole write, cannot hold sharded state, and cannot be loaded on another number
of ranks. Here every rank writes its own part in parallel, on a background thread, in DCP's
on-disk format: `torch.distributed.checkpoint.load` reads what hvdlite writes, hvdlite loads what
DCP writes, and a load on any number of ranks reads just the pieces each rank needs.

    from hvdlite.torch import checkpoint

    checkpoint.save(state, "ckpt/commit-000100", keep=3)     # returns at once
    checkpoint.load("ckpt", state)                           # newest complete one

What is written:
- replicated values (a model's parameters, a plain optimizer's state) once, spread over the
  ranks by DCP's de-duplication (each rank writes about 1/N of them);
- sharded values as their shards: a ZeRO 1/2 optimizer's state by the rank that owns each
  parameter, and `hvdlite.torch.shard.LocalShard` values (a `fully_shard` state dict) as
  chunks of their global tensor; a `fully_shard` model and its optimizer, passed as themselves,
  the same way. Loading on another number of ranks reshards them all.

A save is atomic: rank 0 writes the manifest, DCP's `.metadata` (then hvdlite's `hvdlite.json`
with the save's time and extras), only after every rank has written its part. A directory
without it is a save that did not finish; `load` and `latest` skip it, with a warning, for the
one before.

Asynchronous saves copy the state to host memory (the step goes on once the copy is made) and
write on one background thread per rank. At most one save is in flight: a second one waits for
the first (`if_busy="wait"`, the default) or is skipped on every rank (`if_busy="skip"`).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import pickle
import shutil
import socket
import threading
import time
import warnings
from typing import Any, Optional

import torch

from ..common.config import env_float
from .shard import LocalShard

log = logging.getLogger(__name__)

__all__ = ["save", "load", "latest", "wait", "CheckpointError", "MANIFEST"]

MANIFEST = "hvdlite.json"          # written last, by rank 0: the checkpoint is complete
_DCP_METADATA = ".metadata"
_RESULTS = "__{rank}.hvdlite-results"
_FINISH_TIMEOUT_ENV = "HVDLITE_CHECKPOINT_TIMEOUT"   # declared in common/config.py


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded (raised on every rank alike)."""


# ---------------------------------------------------------------------- sharded values
class _Chunk:
    """A `LocalShard` as DCP's planners see it: one chunk of a global tensor (the protocol DCP's
    own DTensor implements: `__create_write_items__` and `__create_chunk_list__`)."""

    def __init__(self, shard: LocalShard) -> None:
        self.shard = shard

    def size(self) -> torch.Size:
        return torch.Size(self.shard.global_shape)

    def _chunk(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(offsets=torch.Size(self.shard.offsets),
                                    sizes=self.shard.local.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                          WriteItemType)

        if self.shard.local.numel() == 0:
            return []  # a rank with no rows of a short tensor writes nothing
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(self.shard.offsets)),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=self._chunk(),
                              properties=TensorProperties.create_from_tensor(self.shard.local),
                              size=self.size()))]

    def __create_chunk_list__(self) -> list:
        return [self._chunk()] if self.shard.local.numel() else []


def _planners():
    """DCP's default planners, taught that a `_Chunk` stands for its local tensor."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            obj = self.state_dict[index.fqn]
            return obj.shard.local if isinstance(obj, _Chunk) else super().lookup_object(index)

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # DCP's set-up replaces values of types it does not know by None, in place.
            chunks = _chunks_in(state_dict)
            super().set_up_planner(state_dict, metadata, is_coordinator)
            if chunks:
                from torch.distributed.checkpoint._nested_dict import flatten_state_dict

                for container, key, chunk in chunks:
                    container[key] = chunk
                self.state_dict, self.mappings = flatten_state_dict(state_dict)

        def lookup_tensor(self, index):
            obj = self.state_dict[index.fqn]
            return obj.shard.local if isinstance(obj, _Chunk) else super().lookup_tensor(index)

    return SavePlanner, LoadPlanner


def _chunks_in(value: Any) -> list:
    found = []
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, v in items:
        if isinstance(v, _Chunk):
            found.append((value, key, v))
        else:
            found.extend(_chunks_in(v))
    return found


# ---------------------------------------------------------------------- state <-> dict
def _param_names(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]) -> list:
    """Each parameter's name, in the optimizer's order: DCP keys optimizer state by name, so a
    checkpoint does not depend on how parameters were grouped or numbered."""
    names: dict = {}
    if model is not None:
        names = {p: n for n, p in model.named_parameters()}
    names = {**getattr(optimizer, "_parameter_names", {}), **names}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [names.get(p, f"param{i}") for i, p in enumerate(params)]


def _is_zero(optimizer: Any) -> bool:
    return hasattr(optimizer, "local_state_dict") and hasattr(optimizer, "owned_parameters")


def _optimizer_to_dict(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]):
    """torch's optimizer state dict keyed by parameter name (DCP's `get_state_dict` layout);
    a ZeRO optimizer gives only the state of the parameters this rank owns."""
    from .fsdp.state_dict import optimizer_state_shard

    names = _param_names(optimizer, model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sd = optimizer.local_state_dict() if _is_zero(optimizer) else optimizer.state_dict()
    groups = []
    for g in sd["param_groups"]:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [names[i] for i in g["params"]]})
    # Over fully_shard's shards, state cut like a shard is written as its chunk of the whole.
    return {"state": {names[i]: {k: _to_saveable(optimizer_state_shard(params[i], v), model)
                                 for k, v in s.items()}
                      for i, s in sd["state"].items()},
            "param_groups": groups}


def _parts(state: Any) -> tuple[dict, Optional[torch.nn.Module]]:
    """The named values of a TorchState-like object or a dict, and the model (for names)."""
    handlers = getattr(state, "_handlers", None)
    if handlers is not None:
        values = {name: h.value for name, h in handlers.items()}
        attrs = {name: getattr(state, name) for name in getattr(state, "_saved_state", {})}
        values["attrs"] = attrs
        values["hvdlite"] = {"commit_count": getattr(state, "_commit_count", 0)}
    elif isinstance(state, dict):
        values = state
    else:
        raise TypeError(f"hvdlite.torch.checkpoint: expected a TorchState or a dict, got "
                        f"{type(state).__name__}")
    models = [v for v in values.values() if isinstance(v, torch.nn.Module)]
    return values, models[0] if len(models) == 1 else None


def _to_saveable(value: Any, model: Optional[torch.nn.Module]) -> Any:
    if isinstance(value, torch.nn.Module):
        from .fsdp.state_dict import is_fully_sharded, sharded_state_dict

        if is_fully_sharded(value):  # its shards, as chunks of the whole parameters
            return _to_saveable(sharded_state_dict(value)["model"], model)
        return value.state_dict()
    if isinstance(value, torch.optim.Optimizer):
        return _optimizer_to_dict(value, model)
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict") \
            and not torch.is_tensor(value):
        return value.state_dict()   # a sampler, an LR scheduler
    if isinstance(value, LocalShard):
        return _Chunk(value)
    if isinstance(value, dict):
        return {k: _to_saveable(v, model) for k, v in value.items()}
    return value


def _stage(value: Any) -> Any:
    """A copy in host memory: what the background thread writes while training goes on."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, _Chunk):
        s = value.shard
        return _Chunk(LocalShard(s.local.detach().to("cpu", copy=True), s.global_shape,
                                 s.offsets))
    if isinstance(value, dict):
        return {k: _stage(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_stage(v) for v in value]
    return copy.deepcopy(value)


# ---------------------------------------------------------------------- the writer
class _Save:
    """One checkpoint being written by this rank (and finished by rank 0)."""

    def __init__(self, path: str, rank: int, size: int) -> None:
        self.path, self.rank, self.size = path, rank, size
        self.error: Optional[str] = None        # this rank's write (rank 0: also the finish)
        self.thread: Optional[threading.Thread] = None
        self.finisher: Optional[threading.Thread] = None
        self.started = time.time()


class _Writer:
    """Per-process: the save in flight and the last failure, to be reported on every rank."""

    def __init__(self) -> None:
        self.current: Optional[_Save] = None
        self.unreported: Optional[str] = None
        self.lock = threading.Lock()


_writer = _Writer()


def _rank_size() -> tuple[int, int]:
    from . import mpi_ops

    try:
        return mpi_ops.rank(), mpi_ops.size()
    except ValueError:  # not initialised: a single process
        return 0, 1


def _allgather(obj: Any, name: str) -> list:
    from .functions import allgather_object

    _, size = _rank_size()
    return [obj] if size == 1 else allgather_object(obj, name=name)


def _probe(path: str, rank: int) -> Optional[str]:
    """Why this rank cannot write under `path`, or None: found before anything is planned, so
    that every rank learns of it in the same collective."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".hvdlite-probe-{rank}")
        with open(probe, "wb") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as exc:
        return f"{exc.strerror or exc} ({exc.filename or path})"
    return None


def save(state_or_dict: Any, path: str, *, async_: bool = True, keep: Optional[int] = None,
         if_busy: str = "wait", extra: Optional[dict] = None,
         on_complete: Optional[Any] = None) -> bool:
    """Save on every rank (a collective) to the checkpoint directory `path`.

    Args:
        state_or_dict: a `hvd.elastic.TorchState`, or a dict of modules, optimizers, tensors,
            `LocalShard`s, objects with `state_dict()`, and plain values.
        path: the checkpoint's directory (the same on every rank, on a shared file system).
        async_: return once the state is copied to host memory; a background thread writes.
        keep: after this save completes, delete all but the newest `keep` complete
            checkpoints in `path`'s parent directory.
        if_busy: when the previous save is still being written: "wait" for it, or "skip"
            this one (on every rank alike).
        extra: JSON-able values for the manifest (e.g. the step).
        on_complete: called with the path on rank 0 once the checkpoint is complete (from
            the background thread).

    Returns:
        True if the save started (or, with `async_=False`, completed); False if skipped.

    Raises:
        CheckpointError: on every rank, when a rank cannot write under `path` (naming the
            rank, the path and the reason), or a synchronous save failed. Nothing was saved;
            the training state is untouched, so training can go on.
    """
    if if_busy not in ("wait", "skip"):
        raise ValueError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
    from torch.distributed.checkpoint import FileSystemWriter

    rank, size = _rank_size()
    path = os.path.abspath(path)
    busy = False
    previous = _writer.current
    if previous is not None and previous.thread is not None and previous.thread.is_alive():
        if if_busy == "wait":
            previous.thread.join()
        else:
            busy = True
    values, model = _parts(state_or_dict)
    sd = _to_saveable(values, model)
    SavePlanner, _ = _planners()
    planner = SavePlanner()
    writer = FileSystemWriter(path, thread_count=1)
    problem = None if busy else _probe(path, rank)
    local_plan = None
    if problem is None and not busy:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overwriting an existing checkpoint"
            planner.set_up_planner(sd, storage_meta=writer.storage_meta(),
                                   is_coordinator=rank == 0)
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            local_plan = writer.prepare_local_plan(planner.create_local_plan())
    with _writer.lock:
        earlier, _writer.unreported = _writer.unreported, None
    rows = _allgather((busy, problem, earlier, socket.gethostname(), local_plan),
                      "hvdlite.checkpoint.plan")
    for r, row in enumerate(rows):
        if row[2]:
            log.error("hvdlite checkpoint: an earlier save failed on rank %d (host %s): %s",
                      r, row[3], row[2])
    failed = [(r, row[3], row[1]) for r, row in enumerate(rows) if row[1]]
    if failed:
        r, host, why = failed[0]
        raise CheckpointError(f"checkpoint {path}: rank {r} (host {host}) cannot write there: "
                              f"{why}; nothing was saved, the training state is unchanged")
    if any(row[0] for row in rows):
        log.warning("hvdlite checkpoint: skipping the save to %s: the previous save is still "
                    "being written (if_busy='skip')", path)
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans, metadata = planner.create_global_plan([row[4] for row in rows])
        plans = writer.prepare_global_plan(plans)
        final = planner.finish_plan(plans[rank])
        staged = _stage(sd) if async_ else sd
        planner.set_up_planner(staged, storage_meta=writer.storage_meta(),
                               is_coordinator=rank == 0)
    job = _Save(path, rank, size)
    manifest = {"format": "torch.distributed.checkpoint", "writer": "hvdlite",
                "world_size": size, "started": job.started, **(extra or {})}

    def write() -> None:
        try:
            future = writer.write_data(final, planner)
            future.wait()
            results: Any = future.value()
        except Exception as exc:  # a full disk, a lost mount
            results = f"{type(exc).__name__}: {exc}"
            job.error = f"writing {path}: {results}"
            with _writer.lock:
                _writer.unreported = job.error
        try:
            tmp = os.path.join(path, _RESULTS.format(rank=rank) + ".tmp")
            with open(tmp, "wb") as f:
                pickle.dump(results, f)
            os.replace(tmp, os.path.join(path, _RESULTS.format(rank=rank)))
        except OSError as exc:
            job.error = job.error or f"writing {path}: {exc}"
        if rank == 0:
            # Apart from the write: a peer that died mid-save holds rank 0's finish up (until
            # the timeout), but never its next save.
            job.finisher = threading.Thread(target=_finish, name="hvdlite-checkpoint-finish",
                                            args=(job, writer, metadata, manifest, keep,
                                                  on_complete),
                                            daemon=True)
            job.finisher.start()

    job.thread = threading.Thread(target=write, name="hvdlite-checkpoint", daemon=True)
    _writer.current = job
    job.thread.start()
    if not async_:
        wait()
        errors = _allgather(job.error, "hvdlite.checkpoint.done")
        with _writer.lock:
            _writer.unreported = None
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            raise CheckpointError(f"checkpoint {path} failed on rank {bad[0][0]}: {bad[0][1]}")
    return True


def _finish(job: _Save, writer: Any, metadata: Any, manifest: dict,
            keep: Optional[int], on_complete: Optional[Any] = None) -> None:
    """Rank 0: once every rank's part is written, DCP's metadata, then the manifest (last)."""
    timeout = env_float("CHECKPOINT_TIMEOUT", 600.0)
    deadline = time.monotonic() + timeout
    names = [os.path.join(job.path, _RESULTS.format(rank=r)) for r in range(job.size)]
    while not all(os.path.exists(n) for n in names):
        if time.monotonic() > deadline:
            missing = [r for r, n in enumerate(names) if not os.path.exists(n)]
            job.error = (f"checkpoint {job.path}: ranks {missing} did not finish writing within "
                         f"{timeout:.0f} s ({_FINISH_TIMEOUT_ENV}); left incomplete")
            with _writer.lock:
                _writer.unreported = job.error
            return
        time.sleep(0.05)
    try:
        results = []
        for r, n in enumerate(names):
            with open(n, "rb") as f:
                part = pickle.load(f)
            if isinstance(part, str):
                raise CheckpointError(f"rank {r}: {part}")
            results.append(part)
        writer.finish(metadata=metadata, results=results)
        manifest = dict(manifest, finished=time.time())
        tmp = os.path.join(job.path, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(job.path, MANIFEST))
        for n in names:
            os.remove(n)
    except Exception as exc:
        job.error = f"checkpoint {job.path} left incomplete: {exc}"
        with _writer.lock:
            _writer.unreported = job.error
        return
    if keep is not None:
        _prune(os.path.dirname(job.path), keep, job.started)
    if on_complete is not None:
        try:
            on_complete(job.path)
        except Exception:  # a callback's bug must not hide that the checkpoint is complete
            log.exception("hvdlite checkpoint: the on_complete callback failed")


def _complete(path: str) -> Optional[dict]:
    """The manifest of a complete checkpoint, else None. DCP's `.metadata` is written only
    after every part (by DCP itself, and here by rank 0 once every rank reported), so it marks
    a complete checkpoint; one written by DCP alone has no hvdlite manifest beside it."""
    metadata = os.path.join(path, _DCP_METADATA)
    if not os.path.exists(metadata):
        return None
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"finished": os.path.getmtime(metadata)}


def _checkpoints(root: str) -> tuple[list[tuple[float, str]], list[str]]:
    """(finish time, path) of the complete checkpoints under `root`, oldest first, and the
    paths of the incomplete ones."""
    done, partial = [], []
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return [], []
    for name in entries:
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        manifest = _complete(path)
        if manifest is not None:
            done.append((float(manifest.get("finished", 0.0)), path))
        elif any(n.endswith(".distcp") or n.endswith(".hvdlite-results")
                 for n in os.listdir(path)):
            partial.append(path)
    done.sort()
    return done, partial


def _prune(root: str, keep: int, started: float) -> None:
    done, partial = _checkpoints(root)
    for _, path in done[:max(0, len(done) - keep)]:
        shutil.rmtree(path, ignore_errors=True)
    for path in partial:
        # Older than the save that just finished: no save of this job still writes there.
        try:
            if os.path.getmtime(path) < started:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def latest(root: str) -> Optional[str]:
    """The newest complete checkpoint under `root` (or `root` itself if it is one), or None.
    Newer incomplete ones (a save that did not finish) are skipped with a warning."""
    root = os.path.abspath(root)
    if os.path.exists(os.path.join(root, _DCP_METADATA)):
        return root
    done, partial = _checkpoints(root)
    newest = done[-1][1] if done else None
    for path in partial:
        if newest is None or os.path.getmtime(path) >= os.path.getmtime(newest):
            log.warning("hvdlite checkpoint: skipping %s: it has no manifest (%s), a save that "
                        "did not finish; using %s instead", path, _DCP_METADATA,
                        newest or "no checkpoint")
    return newest


def wait() -> Optional[str]:
    """Wait for this rank's save in flight (and, on rank 0, its completion); returns this
    rank's error, if any."""
    job = _writer.current
    if job is None:
        return None
    if job.thread is not None:
        job.thread.join()
    if job.finisher is not None:
        job.finisher.join()
    return job.error


# ---------------------------------------------------------------------- the loader
def _template(values: dict, model: Optional[torch.nn.Module], metadata: Any,
              path: str) -> dict:
    """What this rank loads into: its own tensors (filled in place) and, for optimizers, the
    state the checkpoint holds for the parameters this rank keeps."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .fsdp.state_dict import optimizer_state_box

    paths = getattr(metadata, "planner_data", None) or {}
    out: dict = {}
    for name, value in values.items():
        if isinstance(value, torch.optim.Optimizer):
            names = _param_names(value, model)
            params = [p for g in value.param_groups for p in g["params"]]
            param_of = dict(zip(names, params))
            wanted = set(names)
            if _is_zero(value):
                owned = set(value.owned_parameters())
                wanted = {n for n, p in zip(names, params) if p in owned}
            tmpl: dict = {}
            for key, obj_path in paths.items():
                if not obj_path or obj_path[0] != name:
                    continue
                if len(obj_path) > 2 and obj_path[1] == "state" and obj_path[2] not in wanted:
                    continue
                md = metadata.state_dict_metadata.get(key)
                if isinstance(md, TensorStorageMetadata):
                    # A fully sharded parameter's state: only the rows this rank holds.
                    box = optimizer_state_box(param_of[obj_path[2]], md.size,
                                              md.properties.dtype) \
                        if len(obj_path) > 3 and obj_path[1] == "state" \
                        and obj_path[2] in param_of else None
                    leaf: Any = _Chunk(box) if box is not None else \
                        torch.empty(md.size, dtype=md.properties.dtype)
                else:
                    leaf = None
                _set(tmpl, obj_path[1:], leaf)
            tmpl.setdefault("state", {})
            out[name] = tmpl
        else:
            out[name] = _to_saveable(value, model)
    return out


def _set(root: dict, path: tuple, value: Any) -> None:
    cur: Any = root
    for key, nxt in zip(path, path[1:]):
        default: Any = {} if isinstance(nxt, str) else []
        if isinstance(cur, list):
            while len(cur) <= key:
                cur.append(None)
            if cur[key] is None:
                cur[key] = default
            cur = cur[key]
        else:
            cur = cur.setdefault(key, default)
    if isinstance(cur, list):
        while len(cur) <= path[-1]:
            cur.append(None)
    cur[path[-1]] = value


def _check_match(template: dict, metadata: Any, path: str) -> None:
    """One error naming the first key that differs (the same on every rank: the model is)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = flatten_state_dict(template)
    saved = metadata.state_dict_metadata
    for key, value in flat.items():
        if key not in saved:
            raise CheckpointError(f"checkpoint {path} does not match this state: it has no "
                                  f"'{key}' (another model's checkpoint?)")
        md = saved[key]
        shape = value.size() if (torch.is_tensor(value) or isinstance(value, _Chunk)) else None
        if shape is not None and isinstance(md, TensorStorageMetadata) and md.size != shape:
            raise CheckpointError(f"checkpoint {path} does not match this state: '{key}' has "
                                  f"shape {tuple(md.size)} there but {tuple(shape)} here "
                                  f"(another model's checkpoint?)")
    # Keys of the checkpoint's modules that this model lacks.
    modules = {k for k, v in template.items() if isinstance(v, dict) and k != "attrs"}
    paths = getattr(metadata, "planner_data", None) or {}
    for key in saved:
        top = paths.get(key, (key.split(".", 1)[0],))[0]
        if top in modules and key not in flat and not _optimizer_key(template, paths, key):
            raise CheckpointError(f"checkpoint {path} does not match this state: it has "
                                  f"'{key}', which this state lacks (another model's "
                                  f"checkpoint?)")


def _optimizer_key(template: dict, paths: dict, key: str) -> bool:
    p = paths.get(key)
    return bool(p) and len(p) > 1 and p[1] in ("state", "param_groups") \
        and isinstance(template.get(p[0]), dict) and "state" in template[p[0]]


def load(path: str, state_or_dict: Any) -> str:
    """Load a checkpoint into `state_or_dict` on this rank (every rank can call it alone).

    `path` is a checkpoint directory, or a directory of them (the newest complete one is
    used; incomplete ones are skipped with a warning). Each rank reads only what it holds:
    the whole model, its own ZeRO shard of the optimizer state, the chunks of its
    `LocalShard`s, whatever number of ranks wrote the checkpoint. Returns the path loaded.

    Raises:
        CheckpointError: no complete checkpoint under `path`, or one of another model (the
            first key that differs is named).
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    found = latest(path)
    if found is None:
        raise CheckpointError(f"no complete checkpoint under {os.path.abspath(path)}")
    reader = FileSystemReader(found)
    metadata = reader.read_metadata()
    values, model = _parts(state_or_dict)
    template = _template(values, model, metadata, found)
    _check_match({k: v for k, v in template.items()
                  if not isinstance(values.get(k), torch.optim.Optimizer)}, metadata, found)
    _, LoadPlanner = _planners()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp_load(template, storage_reader=reader, planner=LoadPlanner(), no_dist=True)
    _apply(state_or_dict, values, model, template)
    return found


def _optimizer_from_dict(optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module],
                         loaded: dict) -> None:
    names = _param_names(optimizer, model)
    index = {n: i for i, n in enumerate(names)}
    state = {index[n]: {k: v.shard.local if isinstance(v, _Chunk) else v for k, v in s.items()}
             for n, s in loaded.get("state", {}).items() if n in index}
    groups = []
    for saved, current in zip(loaded.get("param_groups", []), optimizer.param_groups):
        g = {k: v for k, v in saved.items() if k != "params"} if isinstance(saved, dict) else {}
        g["params"] = [index[n] for n in (saved.get("params") or []) if n in index] \
            if isinstance(saved, dict) else []
        if len(g["params"]) != len(current["params"]):
            g["params"] = [index[names[i]] for i in range(len(names))][:len(current["params"])]
        groups.append(g)
    if not groups:
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": list(range(len(g["params"])))} for g in optimizer.param_groups]
    sd = {"state": state, "param_groups": groups}
    if _is_zero(optimizer):
        optimizer.load_local_state_dict(sd)
    else:
        optimizer.load_state_dict(sd)


def _apply(state: Any, values: dict, model: Optional[torch.nn.Module], loaded: dict) -> None:
    for name, value in values.items():
        got = loaded.get(name)
        if isinstance(value, torch.nn.Module):
            from .fsdp.state_dict import is_fully_sharded, load_sharded_state_dict

            if is_fully_sharded(value):
                load_sharded_state_dict(value, {"model": _unchunk(got)})
            else:
                value.load_state_dict(got)
        elif isinstance(value, torch.optim.Optimizer):
            _optimizer_from_dict(value, model, got)
        elif hasattr(value, "load_state_dict") and not torch.is_tensor(value):
            value.load_state_dict(got)
        elif name == "attrs" and getattr(state, "_handlers", None) is not None:
            for attr, v in (got or {}).items():
                setattr(state, attr, v)
        elif name == "hvdlite" and getattr(state, "_handlers", None) is not None:
            state._commit_count = int((got or {}).get("commit_count", 0))
        elif isinstance(value, (torch.Tensor, LocalShard)):
            pass  # filled in place
        elif isinstance(state, dict):
            state[name] = _unchunk(got)
    if getattr(state, "_handlers", None) is not None:
        # The loaded state is the point a rollback goes back to. Not a ZeRO optimizer's save
        # (a collective: in a round with survivors only new workers load); hvd.elastic.run's
        # sync that follows every start saves it on every rank.
        from ..common.elastic import ObjectState
        from .elastic.state import ShardedOptimizerStateHandler

        for handler in state._handlers.values():
            if not isinstance(handler, ShardedOptimizerStateHandler):
                handler.save()
        ObjectState.save(state)


def _unchunk(value: Any) -> Any:
    if isinstance(value, _Chunk):
        return value.shard
    if isinstance(value, dict):
        return {k: _unchunk(v) for k, v in value.items()}
    return value
