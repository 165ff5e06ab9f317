"""Tensor-, pipeline- and data-parallel groups as hvdlite process sets, in Megatron's layout.

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)        (tensor parallel varies fastest)

so a tensor-parallel group is `tp` consecutive ranks (keep it inside one host), a data-parallel
group strides by `tp`, and a pipeline group strides by `tp * dp`. Hybrid sharding (`fully_shard`)
splits the data-parallel axis in two, shard fastest:

    dp_rank = dp_shard_rank + dp_shard * dp_replicate_rank

so a shard group is the nearer ranks (a host) and its replicas are the same place in the others.
`mesh()` registers every group of every rank, in one deterministic order, on every rank (adding a
process set is a collective over the whole job), reusing sets that already exist with the same
ranks.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ...common import basics as _basics
from ...common.process_sets import ProcessSet, global_process_set

_current_mesh: Optional["Mesh"] = None


# ---------------------------------------------------------------------- process set registry
def find_process_set(ranks: Sequence[int]) -> Optional[ProcessSet]:
    """The registered process set with exactly these global ranks, or None."""
    return _basics.find_process_set(ranks)


def ensure_process_sets(rank_lists: Sequence[Sequence[int]], purpose: str) -> list[ProcessSet]:
    """Return a registered process set for each rank list, adding the missing ones.

    A collective over the whole job when anything is missing: every rank must call it with the
    same lists in the same order (the registry is identical on every rank, so every rank finds
    the same sets missing)."""
    wanted = [sorted(int(r) for r in ranks) for ranks in rank_lists]
    missing: list[list[int]] = []
    for ranks in wanted:
        if find_process_set(ranks) is None and ranks not in missing:
            missing.append(ranks)
    if missing:
        if not _basics.dynamic_process_sets():
            shown = ", ".join(str(r) for r in missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise ValueError(
                f"{purpose} needs process sets that do not exist yet ({shown}) and this job was "
                f"started without dynamic process sets. Call hvd.init(process_sets='dynamic') "
                f"(or set HOROVOD_DYNAMIC_PROCESS_SETS=1), or register them at init with "
                f"hvd.init(process_sets=[hvd.ProcessSet(r) for r in "
                f"hvdlite.torch.parallel.mesh_groups(...)['all']]).")
        from ...common.ops import add_process_set
        for ranks in missing:
            add_process_set(ProcessSet(ranks))
    return [find_process_set(ranks) for ranks in wanted]


# ---------------------------------------------------------------------- layout
def _check_sizes(size: int, tp, pp, dp) -> tuple[int, int, int]:
    for label, v in (("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"mesh({label}={v!r}): {label} must be a positive integer")
    if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 1):
        raise ValueError(f"mesh(dp={dp!r}): dp must be a positive integer or None")
    if dp is None:
        if size % (tp * pp):
            raise ValueError(
                f"mesh(tp={tp}, pp={pp}) does not match the world size {size}: tp * pp = "
                f"{tp * pp} does not divide {size} ranks, so no data-parallel size fits. "
                f"Launch a multiple of {tp * pp} ranks or change tp/pp.")
        dp = size // (tp * pp)
    elif tp * pp * dp != size:
        raise ValueError(
            f"mesh(tp={tp}, pp={pp}, dp={dp}) needs tp * pp * dp = {tp * pp * dp} ranks but the "
            f"job has {size} (hvd.size()). Launch {tp * pp * dp} ranks, or leave dp=None to "
            f"derive it.")
    return tp, pp, dp


def _split_dp(size: int, tp: int, pp: int, dp: int | None, dp_shard: int | None,
              dp_replicate: int | None) -> tuple[int, int, int, int, int]:
    """(tp, pp, dp, dp_shard, dp_replicate); without dp_shard/dp_replicate the whole dp axis
    shards (dp_replicate = 1)."""
    for label, v in (("dp_shard", dp_shard), ("dp_replicate", dp_replicate)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"mesh({label}={v!r}): {label} must be a positive integer or None")
    if dp_shard is not None and dp_replicate is not None:
        if dp is not None and dp != dp_shard * dp_replicate:
            raise ValueError(f"mesh(dp={dp}, dp_shard={dp_shard}, dp_replicate={dp_replicate}):"
                             f" dp must be dp_shard * dp_replicate = {dp_shard * dp_replicate}")
        dp = dp_shard * dp_replicate
    tp, pp, dp = _check_sizes(size, tp, pp, dp)
    if dp_shard is None and dp_replicate is None:
        return tp, pp, dp, dp, 1
    if dp_shard is None:
        dp_shard = dp // dp_replicate
    if dp_replicate is None:
        dp_replicate = dp // dp_shard
    if dp_shard * dp_replicate != dp:
        raise ValueError(
            f"mesh(tp={tp}, pp={pp}, dp_shard={dp_shard}, dp_replicate={dp_replicate}) does not "
            f"fit {size} ranks: the data-parallel size is {dp} and dp_shard * dp_replicate = "
            f"{dp_shard * dp_replicate}; pick factors of {dp}")
    return tp, pp, dp, dp_shard, dp_replicate


def mesh_groups(size: int, tp: int = 1, pp: int = 1, dp: int | None = None, *,
                dp_shard: int | None = None, dp_replicate: int | None = None) -> dict:
    """Every group of a mesh as lists of global ranks, without registering anything:
    {'tp': [...], 'pp': [...], 'dp': [...], 'dp_shard': [...], 'dp_replicate': [...],
    'all': every group once}. 'dp_shard' is 'dp' and 'dp_replicate' is empty unless
    dp_replicate > 1. Useful for
    `hvd.init(process_sets=[hvd.ProcessSet(r) for r in mesh_groups(n, tp=2)['all']])` in jobs
    that cannot use dynamic process sets."""
    tp, pp, dp, ds, dr = _split_dp(size, tp, pp, dp, dp_shard, dp_replicate)

    def rank(t, d, p):
        return t + tp * (d + dp * p)

    tp_groups = [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)]
    dp_groups = [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)]
    pp_groups = [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]
    if dr > 1:
        shard_groups = [[rank(t, s + ds * r, p) for s in range(ds)]
                        for p in range(pp) for r in range(dr) for t in range(tp)]
        replicate_groups = [[rank(t, s + ds * r, p) for r in range(dr)]
                            for p in range(pp) for s in range(ds) for t in range(tp)]
    else:
        shard_groups, replicate_groups = dp_groups, []
    unique: list[list[int]] = []
    for g in tp_groups + pp_groups + dp_groups + shard_groups + replicate_groups:
        if g not in unique:
            unique.append(g)
    return {"tp": tp_groups, "pp": pp_groups, "dp": dp_groups, "dp_shard": shard_groups,
            "dp_replicate": replicate_groups, "all": unique}


class Mesh:
    """This rank's place in a tp x pp x dp grid, with the three process sets it belongs to.

    Attributes: `tp`, `pp`, `dp` (ProcessSet), `tp_size`, `pp_size`, `dp_size`, `tp_rank`,
    `pp_rank`, `dp_rank`, `rank`, `size`, and `groups` (every group of every axis, as rank
    lists). Hybrid sharding splits dp: `dp_shard` (ProcessSet; `dp` unless dp_replicate > 1),
    `dp_replicate` (ProcessSet, None unless dp_replicate > 1), `dp_shard_size`,
    `dp_replicate_size`, `dp_shard_rank`, `dp_replicate_rank`. `print(mesh)` shows the rank
    map."""

    def __init__(self, size: int, rank: int, tp: int, pp: int, dp: int, sets: dict,
                 dp_shard: int | None = None, dp_replicate: int = 1):
        self.size, self.rank = size, rank
        self.tp_size, self.pp_size, self.dp_size = tp, pp, dp
        self.dp_shard_size = dp if dp_shard is None else dp_shard
        self.dp_replicate_size = dp_replicate
        self.tp_rank, self.dp_rank, self.pp_rank = self.coords(rank)
        self.dp_shard_rank = self.dp_rank % self.dp_shard_size
        self.dp_replicate_rank = self.dp_rank // self.dp_shard_size
        self.groups = mesh_groups(size, tp, pp, dp, dp_shard=self.dp_shard_size,
                                  dp_replicate=dp_replicate)
        self.tp: ProcessSet = sets["tp"]
        self.pp: ProcessSet = sets["pp"]
        self.dp: ProcessSet = sets["dp"]
        self.dp_shard: ProcessSet = sets.get("dp_shard") or sets["dp"]
        self.dp_replicate: ProcessSet | None = sets.get("dp_replicate")

    # coordinates
    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside 0..{self.size - 1}")
        t = rank % self.tp_size
        d = (rank // self.tp_size) % self.dp_size
        p = rank // (self.tp_size * self.dp_size)
        return t, d, p

    def rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        """The global rank at these coordinates."""
        for label, v, n in (("tp", tp, self.tp_size), ("pp", pp, self.pp_size),
                            ("dp", dp, self.dp_size)):
            if not 0 <= v < n:
                raise ValueError(f"{label}={v} is outside 0..{n - 1}")
        return tp + self.tp_size * (dp + self.dp_size * pp)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def __repr__(self) -> str:
        hybrid = (f", dp_shard={self.dp_shard_size}, dp_replicate={self.dp_replicate_size}"
                  if self.dp_replicate_size > 1 else "")
        return (f"Mesh(tp={self.tp_size}, pp={self.pp_size}, dp={self.dp_size}{hybrid}, "
                f"rank={self.rank}: tp_rank={self.tp_rank}, pp_rank={self.pp_rank}, "
                f"dp_rank={self.dp_rank})")

    def __str__(self) -> str:
        t, p, d = self.tp_size, self.pp_size, self.dp_size
        w = max(len(f"tp{t - 1}"), len(str(self.size - 1))) + 1   # cell width (+ marker)
        lines = [f"Mesh(tp={t}, pp={p}, dp={d}) over {self.size} rank"
                 f"{'s' if self.size != 1 else ''}; "
                 f"rank = tp + {t}*(dp + {d}*pp)"]
        block = t * (w + 1)                                       # one dp column group
        if d > 1:
            lines.append(" " * 5 + "".join(f"{'dp' + str(j):<{block + 2}}" for j in range(d))
                         .rstrip())
        lines.append(" " * 5 + " | ".join(" ".join(f"{'tp' + str(i):<{w}}" for i in range(t))
                                          for _ in range(d)).rstrip())
        for s in range(p):
            groups = []
            for j in range(d):
                cells = []
                for i in range(t):
                    r = self.rank_of(tp=i, pp=s, dp=j)
                    cells.append(f"{str(r) + ('*' if r == self.rank else ''):<{w}}")
                groups.append(" ".join(cells))
            lines.append((f"{'pp' + str(s):<5}" + " | ".join(groups)).rstrip())
        axes = ("tp", "pp", "dp") + (("dp_shard", "dp_replicate")
                                     if self.dp_replicate_size > 1 else ())
        for axis in axes:
            lines.append(f"{axis} groups: " + " ".join(str(g) for g in self.groups[axis]))
        lines.append(f"this rank (*): {self.rank} -> tp_rank {self.tp_rank}, pp_rank "
                     f"{self.pp_rank}, dp_rank {self.dp_rank}")
        return "\n".join(lines)


def mesh(tp: int = 1, pp: int = 1, dp: int | None = None, *, dp_shard: int | None = None,
         dp_replicate: int | None = None) -> Mesh:
    """Split the job into tensor x pipeline x data parallel groups (Megatron's rank layout).

    A collective when it has to create process sets: call it on every rank, in the same order
    relative to other process-set changes. Needs `hvd.init(process_sets="dynamic")` unless the
    groups already exist. The returned mesh becomes the default for tensor-parallel layers and
    pipelines created with `process_set=None`.

        mesh = hvd.parallel.mesh(tp=2, pp=2)          # on 4 (or 8, 12, ...) ranks
        opt = hvd.DistributedOptimizer(opt, named_parameters=..., process_set=mesh.dp)

    dp_shard / dp_replicate split the data-parallel axis for hybrid sharding (`fully_shard`
    shards over `mesh.dp_shard` and averages the shards over `mesh.dp_replicate`); give one
    and the other is derived.
    """
    global _current_mesh
    size, me = _basics.size(), _basics.rank()
    tp, pp, dp, ds, dr = _split_dp(size, tp, pp, dp, dp_shard, dp_replicate)
    groups = mesh_groups(size, tp, pp, dp, dp_shard=ds, dp_replicate=dr)
    what = f"mesh(tp={tp}, pp={pp}, dp={dp}" + (f", dp_shard={ds}, dp_replicate={dr})"
                                                if dr > 1 else ")")
    ensure_process_sets(groups["all"], what)
    axes = ("tp", "pp", "dp") + (("dp_shard", "dp_replicate") if dr > 1 else ())
    mine = {axis: find_process_set(next(g for g in groups[axis] if me in g)) for axis in axes}
    m = Mesh(size, me, tp, pp, dp, mine, dp_shard=ds, dp_replicate=dr)
    _current_mesh = m
    return m


def current_mesh() -> Optional[Mesh]:
    """The mesh most recently built by `mesh()` in this process (None before that, or after
    hvd.shutdown())."""
    m = _current_mesh
    if m is not None and (not _basics.is_initialized()
                          or any(ps is not None and ps.process_set_id is None
                                 for ps in (m.tp, m.pp, m.dp, m.dp_shard, m.dp_replicate))):
        return None
    return m


def default_tp_set(process_set: Optional[ProcessSet]) -> ProcessSet:
    if process_set is not None:
        return process_set
    m = current_mesh()
    return m.tp if m is not None else global_process_set


def default_pp_set(process_set: Optional[ProcessSet]) -> ProcessSet:
    if process_set is not None:
        return process_set
    m = current_mesh()
    return m.pp if m is not None else global_process_set
