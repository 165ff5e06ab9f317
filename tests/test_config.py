"""The one registry of environment variables: complete, documented, and checked for typos."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvdlite.common import config
from util import clean_env

ROOT = Path(__file__).resolve().parent.parent
HVDLITE_RUN = str(Path(sys.executable).parent / "hvdlite-run")
# Names in the source that are not environment variables.
NOT_VARIABLES = {"HOROVOD_", "HVDLITE_", "HOROVOD_X", "HVDLITE_X",
                 "HOROVOD_PROCESS_SET_ERROR_INIT", "HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET",
                 "HOROVOD_SECRET_KEY"}


def _sources():
    return [p for p in (ROOT / "hvdlite").rglob("*.py")]


def test_every_name_in_the_code_is_declared():
    undeclared = set()
    for path in _sources():
        for name in re.findall(r"\b(?:HVDLITE|HOROVOD)_[A-Z0-9_]*", path.read_text()):
            if name not in NOT_VARIABLES and not config.declared(name) and \
                    name.rstrip("_") not in NOT_VARIABLES:
                undeclared.add(f"{name} ({path.relative_to(ROOT)})")
    assert not undeclared, sorted(undeclared)


def test_no_direct_reads_outside_the_registry():
    """HVDLITE_*/HOROVOD_* variables are read through hvdlite.common.config only."""
    direct = re.compile(r"""os\.(?:environ(?:\.get)?\s*[\[(]|getenv\()\s*f?["'](?:HVDLITE|HOROVOD)_""")
    found = []
    for path in _sources():
        if path.name == "config.py" and path.parent.name == "common":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if direct.search(line) and not re.search(r"\]\s*=[^=]", line):  # writes are fine
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, found


def test_docs_table_is_generated_from_the_registry():
    page = (ROOT / "docs" / "environment.md").read_text()
    assert config.markdown_table() in page, \
        "docs/environment.md's table is stale: paste `python -m hvdlite.common.config` into it"


def test_misspelled_names():
    environ = {"HVDLITE_FUSION_THRESHHOLD": "1", "HVDLITE_FUSION_THRESHOLD": "2",
               "HVDLITE_SOMETHING_ELSE": "x", "HOROVOD_GPU_OPERATIONS": "NCCL"}
    assert config.misspelled(environ) == [("HVDLITE_FUSION_THRESHHOLD",
                                          "HVDLITE_FUSION_THRESHOLD")]
    with pytest.raises(KeyError, match="HVDLITE_NOPE is not declared"):
        config.raw("HVDLITE_NOPE")


@pytest.mark.timeout(60)
def test_launcher_warns_once_about_a_misspelled_variable():
    env = clean_env()
    env.update(PYTHONPATH=str(ROOT), HVDLITE_CYCLE_TMIE="2")
    out = subprocess.run([HVDLITE_RUN, "-np", "2", sys.executable, "-c", "pass"],
                         capture_output=True, text=True, timeout=50, env=env)
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "HVDLITE_CYCLE_TMIE" in line]
    assert warnings == ["hvdlite-run: warning: HVDLITE_CYCLE_TMIE is not a variable hvdlite "
                        "reads; did you mean HVDLITE_CYCLE_TIME?"], out.stderr


def test_settings_defaults_match_the_registry():
    """Settings (the engine's view) and the registry (docs/environment.md's) state the same
    defaults."""
    fields = {"fusion_threshold": "FUSION_THRESHOLD", "cycle_time_ms": "CYCLE_TIME",
              "cache_capacity": "CACHE_CAPACITY", "stall_warning_s": "STALL_CHECK_TIME_SECONDS",
              "stall_shutdown_s": "STALL_SHUTDOWN_TIME_SECONDS",
              "gloo_timeout_s": "GLOO_TIMEOUT_SECONDS", "start_timeout_s": "START_TIMEOUT",
              "shutdown_grace_s": "SHUTDOWN_GRACE_SECONDS", "log_level": "LOG_LEVEL",
              "hierarchical_allreduce": "HIERARCHICAL_ALLREDUCE",
              "autotune_warmup_samples": "AUTOTUNE_WARMUP_SAMPLES",
              "autotune_steps_per_sample": "AUTOTUNE_STEPS_PER_SAMPLE",
              "autotune_bayes_opt_max_samples": "AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
              "autotune_gaussian_process_noise": "AUTOTUNE_GAUSSIAN_PROCESS_NOISE"}
    registry = {v.name: v.default for v in config.VARIABLES}
    defaults = config.Settings()
    for field, name in fields.items():
        assert getattr(defaults, field) == registry[name], (field, name)


def test_booleans_as_hvdlite_and_horovod_read_them():
    for value in ("1", "true", "YES", " on ", "y", "2"):     # 2: Horovod's strtol(value) > 0
        assert config.parse_bool(value) is True, value
    for value in ("0", "False", "no", "off", "n", "-1"):
        assert config.parse_bool(value) is False, value
    for value in ("enable", "1.5", "truee"):
        assert config.parse_bool(value) is None, value
    assert config.truthy(None, True) and not config.truthy("enable", True)


def test_check_values_names_each_bad_number_and_boolean():
    environ = {"HVDLITE_FUSION_THRESHOLD": "64MB", "HOROVOD_CYCLE_TIME": "fast",
               "HVDLITE_STALL_CHECK_DISABLE": "enable", "HVDLITE_CACHE_CAPACITY": "1e3",
               "HOROVOD_HIERARCHICAL_ALLREDUCE": "2", "HVDLITE_TIMELINE": "anything",
               "HVDLITE_START_TIMEOUT": ""}
    bad = config.check_values(environ)
    assert len(bad) == 3, bad
    assert bad[0].startswith("HVDLITE_FUSION_THRESHOLD='64MB' is not an integer (bytes per "
                             "fused transport call"), bad
    assert bad[1].startswith("HOROVOD_CYCLE_TIME='fast' is not a number"), bad
    assert bad[2].startswith("HVDLITE_STALL_CHECK_DISABLE='enable' is not 1 or 0"), bad
    assert all(b.endswith("set it to one, or unset it for the default") for b in bad)


def test_check_values_names_each_bad_word_of_an_enumerated_variable():
    """Enumerated variables (a transport, a wait mode, a log level...) are checked up front as
    numbers are, with the words each takes; any case and spaces around are fine."""
    environ = {"HVDLITE_MPI_WAIT": "spinn", "HOROVOD_CPU_OPERATIONS": "ccl",
               "HVDLITE_SHM_CHUNK_MB": "-1", "HOROVOD_LOG_LEVEL": " Debug ",
               "HVDLITE_SHM": "ON", "HVDLITE_STEADY_ROUNDS": "peers",
               "HVDLITE_TF_PACE_BACKPROP": "sometimes", "HVDLITE_LOG_FORMAT": "",
               "HVDLITE_TIMELINE": "/tmp/anything.json"}
    bad = config.check_values(environ)
    assert [b.split("=")[0] for b in bad] == ["HVDLITE_MPI_WAIT", "HVDLITE_SHM_CHUNK_MB",
                                              "HOROVOD_CPU_OPERATIONS",
                                              "HVDLITE_TF_PACE_BACKPROP"], bad
    assert bad[0].startswith("HVDLITE_MPI_WAIT='spinn' is not one of spin, yield, auto (")
    assert bad[1].startswith("HVDLITE_SHM_CHUNK_MB='-1' is not auto or a size in MB (")
    assert bad[2].startswith("HOROVOD_CPU_OPERATIONS='ccl' is not one of gloo, mpi (")
    assert bad[3].startswith("HVDLITE_TF_PACE_BACKPROP='sometimes' is not 1 or 0")
    assert all(b.endswith("set it to one, or unset it for the default") for b in bad)
    for ok in ("auto", "0", "2.5", " AUTO "):
        assert config.check_values({"HVDLITE_SHM_CHUNK_MB": ok}) == [], ok


def test_readers_of_enumerated_variables_share_the_up_front_rule(monkeypatch):
    """config.choice is what every reader calls: the value in lower case, the default when
    unset, and check_values' message for a word it does not take."""
    for full in ("HVDLITE_MPI_WAIT", "HOROVOD_MPI_WAIT"):
        monkeypatch.delenv(full, raising=False)
    assert config.choice("MPI_WAIT") == "auto"
    monkeypatch.setenv("HOROVOD_MPI_WAIT", " Yield")
    assert config.choice("MPI_WAIT") == "yield"
    monkeypatch.setenv("HVDLITE_MPI_WAIT", "spin")             # HVDLITE_ wins, as in env()
    assert config.choice("MPI_WAIT") == "spin"
    monkeypatch.setenv("HVDLITE_MPI_WAIT", "fast")
    with pytest.raises(ValueError, match=r"HVDLITE_MPI_WAIT='fast' is not one of spin, yield, "
                                         r"auto \(`spin`"):
        config.choice("MPI_WAIT")
    monkeypatch.delenv("HOROVOD_CPU_OPERATIONS", raising=False)
    monkeypatch.delenv("HVDLITE_CPU_OPERATIONS", raising=False)
    assert config.choice("CPU_OPERATIONS") == ""              # unset, no default
    with pytest.raises(KeyError):
        config.choice("FUSION_THRESHOLD")                     # a number, not enumerated
    from hvdlite.common.logs import LEVELS
    level = next(v for v in config.VARIABLES if v.name == "LOG_LEVEL")
    assert sorted(level.choices) == sorted(n.lower() for n in LEVELS)


@pytest.mark.timeout(60)
def test_launcher_refuses_a_bad_value_before_starting_any_rank(tmp_path):
    env = clean_env()
    marker = tmp_path / "started"
    env.update(PYTHONPATH=str(ROOT), HOROVOD_FUSION_THRESHOLD="64MB")
    out = subprocess.run([HVDLITE_RUN, "-np", "2", sys.executable, "-c",
                          f"open({str(marker)!r}, 'w')"],
                         capture_output=True, text=True, timeout=50, env=env)
    assert out.returncode == 2, out.stderr
    assert "hvdlite-run: error: HOROVOD_FUSION_THRESHOLD='64MB' is not an integer" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_init_refuses_a_bad_value_outside_hvdlite_run():
    """Launched another way (torchrun, mpiexec, a plain python), init() checks the values."""
    env = clean_env()
    env.update(PYTHONPATH=str(ROOT), HVDLITE_STEADY_STATE="maybe",
               HVDLITE_FLIGHT_RECORDER_SIZE="big",    # (read when hvdlite is imported)
               HVDLITE_MPI_WAIT="sometimes")
    code = ("import hvdlite.torch as hvd\n"
            "try:\n    hvd.init()\nexcept ValueError as e:\n    print('REFUSED', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50, env=env)
    assert out.returncode == 0, out.stderr
    assert "REFUSED hvdlite.init(): HVDLITE_STEADY_STATE='maybe' is not 1 or 0" in out.stdout, \
        out.stdout + out.stderr
    assert "HVDLITE_FLIGHT_RECORDER_SIZE='big' is not an integer" in out.stdout
    assert "HVDLITE_MPI_WAIT='sometimes' is not one of spin, yield, auto" in out.stdout


def test_launcher_hang_limit_reads_the_variables_as_the_ranks_do():
    from hvdlite.runner.hang_report import stall_shutdown_s
    clean = clean_env()
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(clean)
        assert stall_shutdown_s({}) == 600.0
        assert stall_shutdown_s({"HOROVOD_STALL_CHECK_DISABLE": "y"}) == 0.0
        assert stall_shutdown_s({"HOROVOD_STALL_CHECK_DISABLE": "2"}) == 0.0
        assert stall_shutdown_s({"HVDLITE_STALL_CHECK_DISABLE": "0",
                                 "HOROVOD_STALL_CHECK_DISABLE": "1"}) == 600.0
        assert stall_shutdown_s({"HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "30",
                                 "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90"}) == 30.0
    finally:
        os.environ.clear()
        os.environ.update(saved)
