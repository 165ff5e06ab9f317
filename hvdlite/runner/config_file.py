"""`--config-file`: horovodrun's YAML configuration, read with PyYAML (`yaml.safe_load`).

One parser, the same one Horovod uses, so a config that works on one machine works on every
other. Flags given on the command line win over the file. Top-level keys starting with `x-` are
ignored, so they can hold anchors that the sections below reuse (`<<: *defaults`).
"""
from __future__ import annotations

from typing import Any

# section -> {key in file: dest in the parsed args}
_SECTIONS: dict[str, dict[str, str]] = {
    "params": {
        "fusion_threshold_mb": "fusion_threshold_mb",
        "cycle_time_ms": "cycle_time_ms",
        "cache_capacity": "cache_capacity",
        "hierarchical_allreduce": "hierarchical_allreduce",
        "hierarchical_allgather": "hierarchical_allgather",
        "torus_allreduce": "torus_allreduce",
    },
    "autotune": {
        "enabled": "autotune",
        "log_file": "autotune_log_file",
        "warmup_samples": "autotune_warmup_samples",
        "steps_per_sample": "autotune_steps_per_sample",
        "bayes_opt_max_samples": "autotune_bayes_opt_max_samples",
        "gaussian_process_noise": "autotune_gaussian_process_noise",
    },
    "timeline": {
        "filename": "timeline_filename",
        "mark_cycles": "timeline_mark_cycles",
    },
    "stall_check": {
        "enabled": "no_stall_check",   # inverted below
        "warning_time_seconds": "stall_check_warning_time_seconds",
        "shutdown_time_seconds": "stall_check_shutdown_time_seconds",
    },
    "library_options": {
        "mpi_threads_disable": "mpi_threads_disable",
        "num_nccl_streams": "num_nccl_streams",
        "thread_affinity": "thread_affinity",
        "ccl_bgt_affinity": "ccl_bgt_affinity",
        "gloo_timeout_seconds": "gloo_timeout_seconds",
    },
    "logging": {
        "level": "log_level",
        "with_timestamp": "log_with_timestamp",
    },
}


class ConfigError(ValueError):
    """The config file cannot be read or holds something hvdlite-run does not understand."""


def load_config(path: str) -> dict[str, Any]:
    """Read the YAML file at `path` (full YAML: anchors, aliases, lists, flow style)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    import yaml  # here: only --config-file needs it, and every hvdlite-run start would pay

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping")
    return data


def apply_config(args: Any, config: dict[str, Any], explicit: set[str], path: str) -> None:
    """Copy config values onto `args`, except for destinations given on the command line.
    `args.config_sources` maps each destination set here to its key in the file
    ("params.cycle_time_ms"), so a bad value's error names the file and the key."""
    sources: dict[str, str] = {}
    args.config_sources = sources

    def put(dest: str, value: Any, key: str) -> None:
        if dest not in explicit and value is not None:
            setattr(args, dest, value)
            sources[dest] = key

    for section, body in config.items():
        if isinstance(section, str) and section.startswith("x-"):
            continue  # a holder for YAML anchors (`x-defaults: &d ...`), as docker compose allows
        if section == "controller":
            if not isinstance(body, str) or body.lower() not in ("gloo", "mpi"):
                raise ConfigError(f"config file {path}: controller must be 'gloo' or 'mpi', "
                                  f"got {body!r}")
            if not (args.use_gloo or args.use_mpi or args.use_jsrun):
                setattr(args, "use_" + body.lower(), True)
            continue
        if section == "verbose":
            put("verbose", bool(body), "verbose")
            continue
        keys = _SECTIONS.get(section)
        if keys is None:
            raise ConfigError(f"config file {path}: unknown section {section!r} "
                              f"(known: controller, verbose, {', '.join(_SECTIONS)})")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"config file {path}: section {section!r} must be a mapping")
        for key, value in body.items():
            dest = keys.get(key)
            if dest is None:
                raise ConfigError(f"config file {path}: unknown key {section}.{key} "
                                  f"(known: {', '.join(keys)})")
            if section == "stall_check" and key == "enabled" and value is not None:
                value = not bool(value)
            put(dest, value, f"{section}.{key}")
