"""Every environment variable hvdlite reads, declared once, and the settings read from them.

`VARIABLES` is the registry: name, type, default and meaning of each `HVDLITE_*`/`HOROVOD_*`
variable (and the docs' table is generated from it: `python -m hvdlite.common.config`). Code
reads through `env`/`env_int`/`env_float`/`env_bool` (a knob answering to both `HVDLITE_X` and
Horovod's `HOROVOD_X`; the `HVDLITE_*` name wins when both are set) or `raw` (one exact name).
A set `HVDLITE_*` variable that is not declared but close to one that is draws one warning at
start-up (`warn_misspelled`), and a declared number or boolean set to something else stops the
job before it starts (`check_values`). This module imports nothing but the standard library, so the
launcher can use it.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

BOTH = ("HVDLITE_", "HOROVOD_")


@dataclass(frozen=True)
class Var:
    """One declared variable. `name` is the suffix after the prefixes it answers to."""

    name: str
    type: str                       # "int", "float", "bool", "str"
    default: Any
    doc: str
    prefixes: tuple[str, ...] = BOTH
    group: str = "tuning"
    # A "str" variable that takes one of these words (any case, spaces around ignored), or,
    # with `or_size`, a size in MB (>= 0) instead; empty: any text.
    choices: tuple[str, ...] = ()
    or_size: bool = False

    @property
    def full_names(self) -> tuple[str, ...]:
        return tuple(p + self.name for p in self.prefixes)


def _v(name: str, type_: str, default: Any, doc: str, prefixes: tuple[str, ...] = BOTH,
       group: str = "tuning", choices: tuple[str, ...] = (), or_size: bool = False) -> Var:
    return Var(name, type_, default, doc, prefixes, group, choices, or_size)


_H, _L = ("HOROVOD_",), ("HVDLITE_",)
VARIABLES: tuple[Var, ...] = (
    # engine tuning
    _v("FUSION_THRESHOLD", "int", 128 * 1024 * 1024,
       "bytes per fused transport call; 0 disables fusion"),
    _v("CYCLE_TIME", "float", 1.0, "ms between two negotiation sends of one rank"),
    _v("CACHE_CAPACITY", "int", 1024, "response cache entries; 0 disables the cache. The "
       "steady state needs every collective of a step cached: a model with more gradient "
       "tensors than this never reaches it (rank 0 warns)"),
    _v("STEADY_STATE", "bool", True, "0 keeps every cycle on the coordinator in rank 0 (no "
       "decentralised steady state)"),
    _v("STEADY_ROUNDS", "str", "auto", "`auto` or `peers`: where the steady state's rounds run; "
       "auto: one small allreduce on the transport where it can (MPI), else messages between "
       "the ranks; peers: always messages", _L, choices=("auto", "peers")),
    _v("BUCKET_CAP_MB", "float", 25.0, "steady-state gradient buckets: an allreduce waits until "
       "its bucket (about this many MB, in the order the last step submitted them) is complete; "
       "0 sends each as soon as every rank has it (Horovod's behaviour). With neither this nor "
       "FIRST_BUCKET_MB set, a host with no more cores than ranks sends a step's CPU "
       "gradients as one bucket, and a one-host job through shared memory whose ranks have two "
       "cores or more cuts them at 4 MB", _L),
    _v("FIRST_BUCKET_MB", "float", 1.0, "size of the first bucket of a step (small, so transfer "
       "starts early)", _L),
    _v("FLAT_GRADIENTS", "bool", True, "torch `DistributedOptimizer` where a step's CPU "
       "gradients go as one bucket (no more cores than ranks) over MPI or TCP (not shared "
       "memory): after the first step, keep them as views of one flat buffer per dtype, "
       "reduced by one allreduce (the ranks agree first; 0 on any rank keeps each gradient "
       "its own allreduce everywhere)", _L),
    _v("MPI_WAIT", "str", "auto", "`spin`, `yield` or `auto`: how MPI waits use the core; auto "
       "yields when a host runs more ranks than cores", choices=("spin", "yield", "auto")),
    _v("MPI_SHM_MIN_MB", "float", 32.0, "MPI ranks on one host whose waits spin move "
       "allreduce, reducescatter, allgather and broadcast data of this size and more through "
       "hvdlite's shared memory (faster than MPICH's there), smaller ones through MPI, except "
       "fused allreduces of two tensors or more and of min(256 KiB, this) or more, which the "
       "channel takes too; 0: MPI for all. The ranks agree: the largest value any rank sets, "
       "or 0 if one sets 0", _L),
    _v("SHM", "str", "auto", "`auto`, `1` or `0`: ranks of a gloo job that share a host move "
       "allreduce, reducescatter, allgather and broadcast data through shared memory (/dev/shm) "
       "instead of TCP loopback, and so do ranks of an MPI job whose waits yield (more ranks "
       "than cores), or its large collectives where they spin (MPI_SHM_MIN_MB); auto: on "
       "x86-64", _L, choices=("auto", "1", "0", "on", "off", "true", "false", "yes", "no")),
    _v("SHM_SLOT_MB", "float", 8.0, "per-rank shared-memory slot; larger collectives run in "
       "chunks of at most this size (SHM_CHUNK_MB)", _L),
    _v("SHM_CHUNK_MB", "str", "auto", "`auto` or a size in MB: the chunks a large "
       "shared-memory collective runs in (0: whole slots); auto: whole slots when ranks "
       "outnumber cores, else 2 MB chunks or whole slots, whichever allreduced 8 MB faster "
       "when the ranks set up (once a process). The ranks agree: the largest any rank sets", _L,
       choices=("auto",), or_size=True),
    _v("DISABLE_GROUP_FUSION", "bool", False, "grouped tensors fuse only with their own group"),
    _v("ENABLE_ASYNC_COMPLETION", "bool", False, "GPU collectives complete once queued on the "
       "GPU: waiting on a handle makes the caller's current CUDA stream wait for the result "
       "instead of blocking the thread until the GPU has it (Horovod's; the result is then "
       "ready on that stream only)"),
    _v("HIERARCHICAL_ALLREDUCE", "bool", False,
       "reduce within each host, allreduce across hosts, broadcast within each host"),
    _v("HIERARCHICAL_ALLGATHER", "bool", False,
       "not supported (allgather is flat); hvdlite-run refuses the flag"),
    _v("TORUS_ALLREDUCE", "bool", False, "not supported; hvdlite-run refuses the flag"),
    _v("DYNAMIC_PROCESS_SETS", "bool", False, 'same as `init(process_sets="dynamic")`'),
    _v("CPU_OPERATIONS", "str", None, "`gloo` or `mpi`: the CPU transport (default: gloo, "
       "MPI under mpirun)", choices=("gloo", "mpi")),
    _v("CONTROLLER", "str", None, "accepted for compatibility; negotiation always uses "
       "hvdlite's control channel"),
    _v("MPI_THREADS_DISABLE", "bool", False, "do not request MPI_THREAD_MULTIPLE"),
    _v("NUM_NCCL_STREAMS", "int", 1, "NCCL streams; hvdlite uses one"),
    _v("THREAD_AFFINITY", "str", None, "not supported; hvdlite-run refuses the flag"),
    _v("CCL_BGT_AFFINITY", "int", None, "accepted for compatibility (oneCCL only)"),
    _v("GLOO_TIMEOUT_SECONDS", "float", 30.0, "gloo transport timeout"),
    _v("GLOO_IFACE", "str", None, "network interface for gloo (`--network-interfaces`)"),
    _v("START_TIMEOUT", "float", 30.0, "seconds for all ranks to connect at `init()`"),
    _v("SHUTDOWN_GRACE_SECONDS", "float", 10.0,
       "how long rank 0 keeps coordinating others after its own shutdown()"),
    # stall inspector and timeline
    _v("STALL_CHECK_DISABLE", "bool", False, "1 turns the stall inspector off", group="stall"),
    _v("STALL_CHECK_TIME_SECONDS", "float", 60.0, "warn about tensors waiting this long",
       group="stall"),
    _v("STALL_SHUTDOWN_TIME_SECONDS", "float", 600.0,
       "fail the job after this long (0: never, Horovod's default)", group="stall"),
    _v("TIMELINE", "str", None, "write a Chrome trace here (rank 0); `DYNAMIC` to use "
       "`start_timeline()` only", group="stall"),
    _v("TIMELINE_MARK_CYCLES", "bool", False, "mark each negotiation send", group="stall"),
    # logging
    _v("LOG_LEVEL", "str", "WARNING", "TRACE, DEBUG, INFO, WARNING, ERROR, FATAL",
       group="logging", choices=("trace", "debug", "info", "warning", "warn", "error", "fatal",
                                 "critical")),
    _v("LOG_HIDE_TIME", "bool", False, "1 drops the time from hvdlite's log records "
       "(`--log-without-timestamp`)", group="logging"),
    _v("LOG_FORMAT", "str", "text", "`json`: one JSON object per log record and line",
       group="logging", choices=("text", "json")),
    # autotune
    _v("AUTOTUNE", "bool", False, "1 tunes the fusion threshold and cycle time while training",
       group="autotune"),
    _v("AUTOTUNE_LOG", "str", None, "CSV log of every autotune trial", group="autotune"),
    _v("AUTOTUNE_WARMUP_SAMPLES", "int", 3, "scores discarded before tuning starts",
       group="autotune"),
    _v("AUTOTUNE_STEPS_PER_SAMPLE", "int", 10, "steps per sample (5 samples make one score)",
       group="autotune"),
    _v("AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "int", 20,
       "scored trials before the best parameters are kept", group="autotune"),
    _v("AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "float", 0.8,
       "observation noise of the Gaussian process", group="autotune"),
    # a rank's identity, set by hvdlite-run
    *(_v(n, "int" if n != "HOSTNAME" else "str", None, f"a rank's {d} (set by hvdlite-run)",
         group="identity")
      for n, d in (("RANK", "rank"), ("SIZE", "job size"), ("LOCAL_RANK", "rank on its host"),
                   ("LOCAL_SIZE", "ranks on its host"), ("CROSS_RANK", "host index"),
                   ("CROSS_SIZE", "number of hosts with its local rank"),
                   ("HOSTNAME", "host name"))),
    _v("GLOO_RENDEZVOUS_ADDR", "str", None, "the job's c10d store (Horovod's); without the "
       "launcher rank 0 serves it there", _H, "identity"),
    _v("GLOO_RENDEZVOUS_PORT", "int", None, "port of the job's c10d store (Horovod's)", _H,
       "identity"),
    _v("STORE_ADDR", "str", None, "the job's c10d store (set by hvdlite-run)", _L, "identity"),
    _v("STORE_PORT", "int", None, "port of the job's c10d store (set by hvdlite-run)", _L,
       "identity"),
    _v("STORE_FD", "int", None, "listening socket rank 0 serves the job's c10d store on (set "
       "by hvdlite-run on a local rank 0; its init() serves it)", _L, "identity"),
    _v("SECRET", "str", None, "per-job key that signs control messages (set by hvdlite-run, "
       "never on a command line)", _L, "identity"),
    _v("COORDINATOR_ADDR", "str", None, "address other ranks use to reach rank 0's "
       "coordinator (default: found automatically)", _L, "identity"),
    _v("JOB_GENERATION", "str", "0", "namespaces a job's store keys (set by hvdlite.runner.run)",
       _L, "identity"),
    _v("ENV_CHECKED", "bool", False, "set by hvdlite-run for its ranks: variable names were "
       "checked once already", _L, "identity"),
    # elastic
    _v("ELASTIC", "bool", False, "the job is elastic (set by hvdlite-run)", group="elastic"),
    _v("ELASTIC_TIMEOUT", "int", 600, "seconds an elastic job waits for its `--min-np` slots "
       "(`--elastic-timeout` wins)", group="elastic"),
    _v("CHECKPOINT_TIMEOUT", "float", 600.0, "seconds rank 0 waits for every rank's part of a "
       "checkpoint (hvdlite.torch.checkpoint) before it leaves the save incomplete", _L,
       "elastic"),
    _v("ELASTIC_WORKER", "str", None, "`<host>:<slot>` of an elastic worker (set by "
       "hvdlite-run)", _L, "elastic"),
    _v("ELASTIC_SPAWN", "str", None, "id of this spawn of an elastic slot (set by "
       "hvdlite-run)", _L, "elastic"),
    _v("DRIVER_ADDR", "str", None, "the elastic driver's control endpoint (set by hvdlite-run)",
       _L, "elastic"),
    _v("DRIVER_PORT", "int", None, "the elastic driver's control port (set by hvdlite-run)",
       _L, "elastic"),
    # launcher
    _v("SSH_ARGS", "str", None, "extra ssh options, placed before hvdlite's own", _L,
       "launcher"),
    _v("REMOTE_PYTHON", "str", None, "Python to run on remote hosts (default: this one's path)",
       _L, "launcher"),
    _v("STORE_ON_DRIVER", "bool", False, "1: the launcher serves the job's c10d store even when "
       "rank 0 runs on its machine (for scripts that use the store without hvd.init() and let "
       "rank 0 exit first); the launcher then imports torch, in a thread while the ranks start "
       "(they share the cores with it)", _L, "launcher"),
    # diagnosis (flight recorder, stragglers) and control-plane limits
    _v("STRAGGLER_REPORT", "float", None, "seconds between straggler reports "
       "(`hvdlite-run --straggler-report SECONDS`)", group="stall"),
    _v("FLIGHT_DIR", "str", None, "where ranks write their flight-recorder dumps "
       "(set by hvdlite-run)", _L, "stall"),
    _v("FLIGHT_RECORDER_SIZE", "int", 64, "collectives each rank remembers; 0 turns the "
       "recorder off", _L, "stall"),
    _v("MAX_FRAME_BYTES", "int", 64 << 20, "the largest control frame accepted", _L, "identity"),
    _v("SECRET_FILE", "str", None, "a file holding the job secret, read when HVDLITE_SECRET "
       "is unset", _L, "identity"),
    # add-ons, tests, set-up
    _v("ZERO_BUCKET_BYTES", "int", None, "ZeRO: bytes per reduce-scatter/allgather bucket", _L,
       "other"),
    _v("TF_PACE_BACKPROP", "bool", True, "TensorFlow: order each gradient unit's collective "
       "before the next unit's gradient op in a traced step, so reduction overlaps "
       "backpropagation; 0 leaves the order to TensorFlow. Only where a traced step has a "
       "node per gradient: a host with no core to spare per rank has one node per step, with "
       "nothing to pace", _L, "other"),
    _v("REQUIRE_RAY", "bool", False, "tests: missing Ray fails the Ray tests instead of "
       "skipping them", _L, "other"),
    _v("P2P_INLINE_BYTES", "int", None, "pipeline point-to-point: messages up to this size "
       "travel inline with their header", _L, "other"),
    _v("REQUIRE_SSHD", "bool", False, "tests: a missing sshd fails the multi-host tests "
       "instead of skipping them", _L, "other"),
    _v("SKIP_TENSORFLOW", "bool", False, "scripts/setup.sh: leave TensorFlow out", _L, "other"),
)

_BY_FULL_NAME: dict[str, Var] = {full: v for v in VARIABLES for full in v.full_names}
_BY_SUFFIX: dict[str, Var] = {v.name: v for v in VARIABLES if v.prefixes == BOTH}


def declared(name: str) -> bool:
    """True for a full variable name in the registry."""
    return name in _BY_FULL_NAME


def raw(name: str, default: Optional[str] = None,
        environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The value of the declared variable `name` (a full name), as a string."""
    if name not in _BY_FULL_NAME:
        raise KeyError(f"{name} is not declared in hvdlite.common.config.VARIABLES")
    value = (os.environ if environ is None else environ).get(name)
    return default if value is None else value


def raw_int(name: str, default: int) -> int:
    """`raw(name)` as an integer; `default` when it is unset or not a number. For values read
    when a module is imported, where raising would print a traceback instead of a message;
    check_values reports the bad value where the job starts."""
    value = raw(name)
    try:
        return default if not value else parse_value("int", value)
    except ValueError:
        return default


def misspelled(environ: Optional[Mapping[str, str]] = None) -> list[tuple[str, str]]:
    """(set name, likely intended name) for each undeclared HVDLITE_* variable close to a
    declared one."""
    environ = os.environ if environ is None else environ
    known = sorted(n for n in _BY_FULL_NAME if n.startswith("HVDLITE_"))
    out = []
    for name in sorted(environ):
        if name.startswith("HVDLITE_") and name not in _BY_FULL_NAME:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            if close:
                out.append((name, close[0]))
    return out


_warned = False


def warn_misspelled(emit: Callable[[str], None],
                    environ: Optional[Mapping[str, str]] = None) -> int:
    """Once per process: one warning line per likely misspelled HVDLITE_* variable."""
    global _warned
    if _warned:
        return 0
    _warned = True
    found = misspelled(environ)
    for name, close in found:
        emit(f"{name} is not a variable hvdlite reads; did you mean {close}?")
    return len(found)


def markdown_table() -> str:
    """docs/environment.md's table of environment variables, generated from the registry."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for v in VARIABLES:
        names = " / ".join(f"`{n}`" for n in v.full_names)
        if v.default is None:
            default = "unset"
        elif v.type == "bool":
            default = "1" if v.default else "0"
        else:
            default = str(v.default)
        rows.append(f"| {names} | {v.type} | {default} | {v.doc} |")
    return "\n".join(rows) + "\n"


def env(name: str, default: str | None = None,
        environ: Optional[Mapping[str, str]] = None) -> str | None:
    """Value of HVDLITE_<name>, else HOROVOD_<name>, else default (in `environ`, by default
    this process's environment; an empty value counts as unset)."""
    environ = os.environ if environ is None else environ
    for prefix in BOTH:
        value = environ.get(prefix + name)
        if value is not None and value != "":
            return value
    return default


def _env_typed(type_: str, name: str, default):
    value = env(name)
    if value is None:
        return default
    try:
        return parse_value(type_, value)
    except ValueError:
        raise ValueError(f"HVDLITE_{name}/HOROVOD_{name} must be {_TYPE_WORDS[type_]}, got "
                         f"{value!r}") from None


def env_int(name: str, default: int) -> int:
    return _env_typed("int", name, default)


def env_float(name: str, default: float) -> float:
    return _env_typed("float", name, default)


def env_bool(name: str, default: bool = False) -> bool:
    return _env_typed("bool", name, default)


_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n")


def parse_bool(value: str) -> Optional[bool]:
    """A boolean variable's value, or None when it is not one: 1/true/yes/on/y and
    0/false/no/off/n (any case), and any other integer as Horovod reads most of its flags
    (`strtol(value) > 0`: 2 is true, -1 false)."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    try:
        return int(v) > 0
    except ValueError:
        return None


def truthy(value: Optional[str], default: bool = False) -> bool:
    """A boolean variable's value, leniently: unset or empty is `default`, and a value that
    is not a boolean is False (check_values reports it at start-up)."""
    if value is None or value == "":
        return default
    return bool(parse_bool(value))


_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "1 or 0 (or true/false, "
               "yes/no, on/off)"}


def parse_value(type_: str, value: str) -> Any:
    """`value` read as a declared variable of `type_` ("int", "float" or "bool"): the one rule
    that every reader (env_int, env_float, env_bool, raw_int) and check_values follow.
    ValueError when it is not one."""
    if type_ == "bool":
        parsed = parse_bool(value)
        if parsed is None:
            raise ValueError(value)
        return parsed
    try:
        return int(float(value)) if type_ == "int" else float(value)
    except OverflowError:          # int(float("inf"))
        raise ValueError(value) from None


def _choice_error(full: str, value: str, v: Var) -> Optional[str]:
    """What is wrong with `value` for the enumerated variable `v` (named `full`), or None."""
    word = value.strip().lower()
    if word in v.choices:
        return None
    if v.or_size:
        try:
            if float(word) >= 0:        # (nan is not)
                return None
        except ValueError:
            pass
    allowed = ("one of " if len(v.choices) > 1 else "") + ", ".join(v.choices) \
        + (" or a size in MB" if v.or_size else "")
    return f"{full}={value!r} is not {allowed} ({v.doc})"


def choice(name: str, default: Optional[str] = None) -> str:
    """An enumerated variable's value (HVDLITE_<name>, else HOROVOD_<name>, as env() reads
    them), trimmed and in lower case; `default` (or the declared default, or "") when unset.
    ValueError, with check_values' message, for a word it does not take: the readers and the
    up-front check share one rule and one message."""
    v = next((x for x in VARIABLES if x.name == name and x.choices), None)
    if v is None:
        raise KeyError(f"{name} is not an enumerated variable in hvdlite.common.config")
    for full in v.full_names:
        value = os.environ.get(full)
        if value is not None and value != "":
            problem = _choice_error(full, value, v)
            if problem is not None:
                raise ValueError(problem)
            return value.strip().lower()
    fallback = default if default is not None else v.default
    return "" if fallback is None else str(fallback).lower()


def check_values(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """One message per declared int, float or bool variable that is set to a value of another
    kind, and per enumerated one set to a word it does not take: what `hvdlite-run` (before it
    starts any rank) and `init()` refuse.

    Why up front: each reader would raise on its own, on every rank, at whatever moment it
    first reads its variable (some at import, some in init, some in the first collective),
    and a boolean read leniently would take a typo for False without a word."""
    environ = os.environ if environ is None else environ
    out = []
    for v in VARIABLES:
        if v.type not in _TYPE_WORDS and not v.choices:
            continue
        for full in v.full_names:
            value = environ.get(full)
            if value is None or value == "":
                continue
            if v.choices:
                problem = _choice_error(full, value, v)
                if problem is not None:
                    out.append(problem + "; set it to one, or unset it for the default")
                continue
            try:
                parse_value(v.type, value)
            except ValueError:
                out.append(f"{full}={value!r} is not {_TYPE_WORDS[v.type]} ({v.doc}); "
                           f"set it to one, or unset it for the default")
    return out


@dataclass
class Settings:
    """Engine tuning, read once per `init()` (Horovod's defaults)."""

    fusion_threshold: int = 128 * 1024 * 1024   # bytes
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    # The decentralised steady state (steady.py); HVDLITE_STEADY_STATE=0 keeps every cycle on
    # the coordinator.
    steady_state: bool = True
    # Where the steady state's rounds run: "auto" on the transport when it can (MPI: one small
    # allreduce), else over the control connections; "peers" always over the connections.
    steady_rounds: str = "auto"
    # Gradient buckets in the steady state (buckets.py), torch DDP's defaults; 0 turns them off.
    bucket_cap_bytes: int = 25 * 1024 * 1024
    first_bucket_bytes: int = 1024 * 1024
    # Whether the user chose the bucket sizes (else buckets.whole_pass_on_host may apply).
    buckets_explicit: bool = False
    # Set at init on a host with no core to spare per rank: a pass of CPU tensors is one
    # bucket (buckets.whole_pass_on_host).
    cpu_whole_pass: bool = False
    # Set at init for a one-host job through shared memory whose ranks have two cores or more:
    # the cap of a pass of CPU tensors (buckets.cpu_cap_on_host); None: bucket_cap_bytes.
    cpu_bucket_cap_bytes: int | None = None
    stall_check_disable: bool = False
    stall_warning_s: float = 60.0
    # Horovod never shuts down on a stall (0). A silent hang is the top complaint of its users, so
    # hvdlite fails the job after 10 minutes of stall unless told otherwise (0 restores Horovod's).
    stall_shutdown_s: float = 600.0
    timeline: str | None = None
    timeline_mark_cycles: bool = False
    gloo_timeout_s: float = 30.0
    start_timeout_s: float = 30.0
    disable_group_fusion: bool = False
    # GPU collectives complete once queued (collectives.gpu_done): Horovod's
    # HOROVOD_ENABLE_ASYNC_COMPLETION, off by default as there.
    async_completion: bool = False
    log_level: str = "WARNING"
    dynamic_process_sets: bool = False
    hierarchical_allreduce: bool = False   # hierarchical.py
    elastic: bool = False
    # How long rank 0 keeps coordinating other ranks after its own shutdown().
    shutdown_grace_s: float = 10.0
    # Autotune (autotune.py): Horovod's knobs and defaults. A tuned parameter that the user set
    # explicitly (HOROVOD_FUSION_THRESHOLD / HOROVOD_CYCLE_TIME) is held constant.
    autotune: bool = False
    autotune_log: str | None = None
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8
    fusion_threshold_fixed: bool = False
    cycle_time_fixed: bool = False

    @classmethod
    def from_env(cls) -> "Settings":
        s = cls()
        s.fusion_threshold = env_int("FUSION_THRESHOLD", s.fusion_threshold)
        s.cycle_time_ms = env_float("CYCLE_TIME", s.cycle_time_ms)
        s.cache_capacity = env_int("CACHE_CAPACITY", s.cache_capacity)
        s.steady_state = env_bool("STEADY_STATE", True)
        s.steady_rounds = choice("STEADY_ROUNDS")
        s.bucket_cap_bytes = int(env_float("BUCKET_CAP_MB", 25.0) * 1024 * 1024)
        s.first_bucket_bytes = int(env_float("FIRST_BUCKET_MB", 1.0) * 1024 * 1024)
        s.buckets_explicit = env("BUCKET_CAP_MB") is not None or env("FIRST_BUCKET_MB") is not None
        s.stall_check_disable = env_bool("STALL_CHECK_DISABLE", False)
        s.stall_warning_s = env_float("STALL_CHECK_TIME_SECONDS", s.stall_warning_s)
        s.stall_shutdown_s = env_float("STALL_SHUTDOWN_TIME_SECONDS", s.stall_shutdown_s)
        s.timeline = env("TIMELINE")
        s.timeline_mark_cycles = env_bool("TIMELINE_MARK_CYCLES", False)
        s.gloo_timeout_s = env_float("GLOO_TIMEOUT_SECONDS", s.gloo_timeout_s)
        s.start_timeout_s = env_float("START_TIMEOUT", s.start_timeout_s)
        s.disable_group_fusion = env_bool("DISABLE_GROUP_FUSION", False)
        s.async_completion = env_bool("ENABLE_ASYNC_COMPLETION", False)
        s.log_level = (env("LOG_LEVEL") or s.log_level).upper()
        s.dynamic_process_sets = env_bool("DYNAMIC_PROCESS_SETS", False)
        s.hierarchical_allreduce = env_bool("HIERARCHICAL_ALLREDUCE", False)
        s.elastic = env_bool("ELASTIC", False)
        s.shutdown_grace_s = env_float("SHUTDOWN_GRACE_SECONDS", s.shutdown_grace_s)
        s.autotune = env_bool("AUTOTUNE", False)
        s.autotune_log = env("AUTOTUNE_LOG")
        s.autotune_warmup_samples = env_int("AUTOTUNE_WARMUP_SAMPLES", s.autotune_warmup_samples)
        s.autotune_steps_per_sample = env_int("AUTOTUNE_STEPS_PER_SAMPLE",
                                              s.autotune_steps_per_sample)
        s.autotune_bayes_opt_max_samples = env_int("AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
                                                   s.autotune_bayes_opt_max_samples)
        s.autotune_gaussian_process_noise = env_float("AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
                                                      s.autotune_gaussian_process_noise)
        s.fusion_threshold_fixed = env("FUSION_THRESHOLD") is not None
        s.cycle_time_fixed = env("CYCLE_TIME") is not None
        return s


if __name__ == "__main__":
    print(markdown_table(), end="")
