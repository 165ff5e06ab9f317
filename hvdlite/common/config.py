"""Settings from the environment: every `HVDLITE_X` also answers to Horovod's `HOROVOD_X`.

The `HVDLITE_*` name wins when both are set, so a job can override an inherited Horovod setting.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


def env(name: str, default: str | None = None) -> str | None:
    """Value of HVDLITE_<name>, else HOROVOD_<name>, else default."""
    for prefix in ("HVDLITE_", "HOROVOD_"):
        value = os.environ.get(prefix + name)
        if value is not None and value != "":
            return value
    return default


def env_int(name: str, default: int) -> int:
    value = env(name)
    if value is None:
        return default
    try:
        return int(float(value))
    except ValueError:
        raise ValueError(f"HVDLITE_{name}/HOROVOD_{name} must be an integer, got {value!r}") from None


def env_float(name: str, default: float) -> float:
    value = env(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"HVDLITE_{name}/HOROVOD_{name} must be a number, got {value!r}") from None


def env_bool(name: str, default: bool = False) -> bool:
    value = env(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on", "y")


@dataclass
class Settings:
    """Engine tuning, read once per `init()` (Horovod's defaults)."""

    fusion_threshold: int = 128 * 1024 * 1024   # bytes
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
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
        s.stall_check_disable = env_bool("STALL_CHECK_DISABLE", False)
        s.stall_warning_s = env_float("STALL_CHECK_TIME_SECONDS", s.stall_warning_s)
        s.stall_shutdown_s = env_float("STALL_SHUTDOWN_TIME_SECONDS", s.stall_shutdown_s)
        s.timeline = env("TIMELINE")
        s.timeline_mark_cycles = env_bool("TIMELINE_MARK_CYCLES", False)
        s.gloo_timeout_s = env_float("GLOO_TIMEOUT_SECONDS", s.gloo_timeout_s)
        s.start_timeout_s = env_float("START_TIMEOUT", s.start_timeout_s)
        s.disable_group_fusion = env_bool("DISABLE_GROUP_FUSION", False)
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
