"""The one table that maps launcher flags to the environment variables every rank receives.

Each tuning knob is exported under both names, `HOROVOD_X` and `HVDLITE_X`, so an unchanged
Horovod script and hvdlite's own engine (which prefers `HVDLITE_X`) see the same value. The CLI,
the config file and `hvdlite.runner.run` all go through `tuning_env`, so there is one mapping.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from hvdlite.common import config

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


def _flag01(value: Any) -> str:
    return "1" if value else "0"


def _mb_to_bytes(value: Any) -> str:
    return str(int(value) * 1024 * 1024)


@dataclass(frozen=True)
class EnvFlag:
    """One parsed-argument destination and the variable it becomes."""

    dest: str                       # attribute of the parsed args
    name: str                       # variable suffix: exported as HOROVOD_<name> and HVDLITE_<name>
    convert: Callable[[Any], str] = str
    prefixed: bool = True           # False: exported verbatim as <name> (e.g. NCCL_IB_DISABLE)


ENV_FLAGS: tuple[EnvFlag, ...] = (
    # tunable parameters
    EnvFlag("fusion_threshold_mb", "FUSION_THRESHOLD", _mb_to_bytes),
    EnvFlag("cycle_time_ms", "CYCLE_TIME"),
    EnvFlag("cache_capacity", "CACHE_CAPACITY"),
    EnvFlag("hierarchical_allreduce", "HIERARCHICAL_ALLREDUCE", _flag01),
    EnvFlag("hierarchical_allgather", "HIERARCHICAL_ALLGATHER", _flag01),
    EnvFlag("torus_allreduce", "TORUS_ALLREDUCE", _flag01),
    # autotune
    EnvFlag("autotune", "AUTOTUNE", _flag01),
    EnvFlag("autotune_log_file", "AUTOTUNE_LOG"),
    EnvFlag("autotune_warmup_samples", "AUTOTUNE_WARMUP_SAMPLES"),
    EnvFlag("autotune_steps_per_sample", "AUTOTUNE_STEPS_PER_SAMPLE"),
    EnvFlag("autotune_bayes_opt_max_samples", "AUTOTUNE_BAYES_OPT_MAX_SAMPLES"),
    EnvFlag("autotune_gaussian_process_noise", "AUTOTUNE_GAUSSIAN_PROCESS_NOISE"),
    # timeline
    EnvFlag("timeline_filename", "TIMELINE"),
    EnvFlag("timeline_mark_cycles", "TIMELINE_MARK_CYCLES", _flag01),
    # stall check
    EnvFlag("no_stall_check", "STALL_CHECK_DISABLE", _flag01),
    EnvFlag("stall_check_warning_time_seconds", "STALL_CHECK_TIME_SECONDS"),
    EnvFlag("stall_check_shutdown_time_seconds", "STALL_SHUTDOWN_TIME_SECONDS"),
    EnvFlag("straggler_report", "STRAGGLER_REPORT"),
    # library options
    EnvFlag("mpi_threads_disable", "MPI_THREADS_DISABLE", _flag01),
    EnvFlag("num_nccl_streams", "NUM_NCCL_STREAMS"),
    EnvFlag("thread_affinity", "THREAD_AFFINITY"),
    EnvFlag("ccl_bgt_affinity", "CCL_BGT_AFFINITY"),
    EnvFlag("gloo_timeout_seconds", "GLOO_TIMEOUT_SECONDS"),
    EnvFlag("tcp_flag", "NCCL_IB_DISABLE", _flag01, prefixed=False),
    # logging
    EnvFlag("log_level", "LOG_LEVEL"),
    EnvFlag("log_with_timestamp", "LOG_HIDE_TIME", lambda v: _flag01(not v)),
)

# Destinations whose value is meaningful only when True (a store_true flag left at False must not
# export "0" and override what the caller's environment says).
_ONLY_WHEN_TRUE = {"tcp_flag"}


def both_names(name: str) -> tuple[str, str]:
    """The two spellings a worker may read: Horovod's and hvdlite's."""
    return f"HOROVOD_{name}", f"HVDLITE_{name}"


def tuning_env(args: Any) -> dict[str, str]:
    """Variables to export for the flags that were given (None: not given, export nothing)."""
    out: dict[str, str] = {}
    for flag in ENV_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None or (flag.dest in _ONLY_WHEN_TRUE and not value):
            continue
        text = flag.convert(value)
        if flag.prefixed:
            for key in both_names(flag.name):
                out[key] = text
        else:
            out[flag.name] = text
    return out


def elastic_timeout_s(flag: Optional[int], environ: Mapping[str, str],
                      default: int = 600) -> int:
    """How long an elastic job waits for its minimum of slots: --elastic-timeout, else
    HVDLITE_ELASTIC_TIMEOUT / HOROVOD_ELASTIC_TIMEOUT (horovodrun's elastic driver reads it),
    else 600 s."""
    return flag if flag is not None else _seconds_from_env("ELASTIC_TIMEOUT", environ, default)


def start_timeout_from_env(environ: Mapping[str, str], default: int = 30) -> int:
    """`--start-timeout` default: HVDLITE_START_TIMEOUT, else HOROVOD_START_TIMEOUT, else 30 s."""
    return _seconds_from_env("START_TIMEOUT", environ, default)


def _seconds_from_env(name: str, environ: Mapping[str, str], default: int) -> int:
    """Whole seconds from HVDLITE_<name>, else HOROVOD_<name>, else `default`; ValueError
    naming the variable for a value that is not a number."""
    for key in (f"HVDLITE_{name}", f"HOROVOD_{name}"):
        value = config.raw(key, environ=environ)
        if value:
            try:
                return int(float(value))
            except ValueError:
                raise ValueError(f"{key} must be a number of seconds, got {value!r}") from None
    return default
