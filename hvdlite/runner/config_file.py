"""`--config-file`: horovodrun's YAML configuration, read without requiring PyYAML.

PyYAML is used when it is importable. Otherwise a small parser reads the subset that the config
file needs (nested mappings by indentation, scalars, comments), and anything beyond it is a clear
error rather than a silent misreading. Flags given on the command line win over the file.
"""
from __future__ import annotations

import re
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


def _scalar(text: str, where: str) -> Any:
    text = text.strip()
    if not text or text in ("~", "null", "Null", "NULL"):
        return None
    if text[0] in "\"'":
        if len(text) < 2 or text[-1] != text[0]:
            raise ConfigError(f"{where}: unterminated string {text!r}")
        return text[1:-1]
    if text[0] in "[{&*!|>":
        raise ConfigError(f"{where}: unsupported YAML ({text!r}); install PyYAML for full YAML")
    if text.lower() in ("true", "yes", "on"):
        return True
    if text.lower() in ("false", "no", "off"):
        return False
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    if re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?", text):
        return float(text)
    return text


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def parse_yaml_subset(text: str, path: str = "<config>") -> dict[str, Any]:
    """Nested `key: value` mappings by indentation; scalars are null/bool/int/float/str."""
    lines: list[tuple[int, str, str | None, str]] = []  # indent, key, value text, where
    for lineno, raw in enumerate(text.splitlines(), start=1):
        where = f"config file {path} line {lineno}"
        line = _strip_comment(raw).rstrip()
        if not line.strip() or line.strip() in ("---", "..."):
            continue
        lead = line[: len(line) - len(line.lstrip())]
        if "\t" in lead:
            raise ConfigError(f"{where}: tabs are not allowed for indentation")
        body = line.strip()
        if body.startswith("-"):
            raise ConfigError(f"{where}: lists are not supported without PyYAML")
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*:(?:\s+(.*))?", body)
        if not m:
            raise ConfigError(f"{where}: expected 'key: value', got {body!r}")
        value = m.group(2)
        lines.append((len(lead), m.group(1), value if value and value.strip() else None, where))

    def block(i: int, indent: int) -> tuple[dict[str, Any], int]:
        mapping: dict[str, Any] = {}
        while i < len(lines):
            ind, key, value, where = lines[i]
            if ind < indent:
                break
            if ind > indent:
                raise ConfigError(f"{where}: inconsistent indentation")
            if key in mapping:
                raise ConfigError(f"{where}: duplicate key {key!r}")
            i += 1
            if value is not None:
                mapping[key] = _scalar(value, where)
            elif i < len(lines) and lines[i][0] > indent:
                mapping[key], i = block(i, lines[i][0])
            else:
                mapping[key] = None
        return mapping, i

    if not lines:
        return {}
    root, end = block(0, lines[0][0])
    if end != len(lines):
        raise ConfigError(f"{lines[end][3]}: inconsistent indentation")
    return root


def load_config(path: str) -> dict[str, Any]:
    """Read the YAML file at `path` with PyYAML if available, else with `parse_yaml_subset`."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    try:
        import yaml  # type: ignore[import-not-found]
    except ImportError:
        data = parse_yaml_subset(text, path)
    else:
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
    """Copy config values onto `args`, except for destinations given on the command line."""
    def put(dest: str, value: Any) -> None:
        if dest not in explicit and value is not None:
            setattr(args, dest, value)

    for section, body in config.items():
        if section == "controller":
            if not isinstance(body, str) or body.lower() not in ("gloo", "mpi"):
                raise ConfigError(f"config file {path}: controller must be 'gloo' or 'mpi', "
                                  f"got {body!r}")
            if not (args.use_gloo or args.use_mpi or args.use_jsrun):
                setattr(args, "use_" + body.lower(), True)
            continue
        if section == "verbose":
            put("verbose", bool(body))
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
            put(dest, value)
