"""The lane configurations a user can reach, as (environment, launcher flags), and how one job
of conformance seeds runs under one of them (for tests/test_conformance.py and the long mode,
tests/conformance/long.py).

Where each switch comes from (hvdlite/common/config.py VARIABLES, hvdlite-run's flags):
- the steady state: HVDLITE_STEADY_STATE (on by default); it needs the response cache,
  HOROVOD_CACHE_CAPACITY (0 turns both off; a small one makes them thrash);
- shared memory: HVDLITE_SHM=0|1 (auto: on, on x86-64); gloo over TCP is HVDLITE_SHM=0; small
  HVDLITE_SHM_SLOT_MB / HVDLITE_SHM_CHUNK_MB make the larger tensors run in many chunks;
- MPI: `hvdlite-run --mpi`; its steady rounds HVDLITE_STEADY_ROUNDS=auto|peers; shared memory
  under MPI where the ranks' waits yield (HVDLITE_MPI_WAIT=yield) or from a size on
  (HVDLITE_MPI_SHM_MIN_MB);
- the express lane has no switch of its own: a blocking allreduce of a cached tensor in the
  steady state takes it (the programs' blocking calls), and timeline recording
  (HOROVOD_TIMELINE) or no steady state keeps every call off it;
- fusion: HOROVOD_FUSION_THRESHOLD (0: none) and HVDLITE_BUCKET_CAP_MB (0: no buckets).
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from util import hvdlite_run, rank_lines


@dataclass(frozen=True)
class Config:
    name: str
    env: dict = field(default_factory=dict)
    launcher_args: tuple = ()
    mpi: bool = False
    # What the engine's counters must show (a lane meant to run did, one meant to be off was):
    # counter name -> True (> 0, summed over every job of the configuration in a run: whether
    # one program reaches a lane depends on what it drew) or False (0 in every job).
    lanes: dict = field(default_factory=dict)


CONFIGS = {c.name: c for c in [
    Config("default", lanes={"steady_entered": True, "express": True, "shm_collectives": True,
                             "round_payloads": True}),
    Config("tcp", {"HVDLITE_SHM": "0"}, lanes={"shm_collectives": False, "steady_entered": True,
                                               "round_payloads": True}),
    Config("shm-chunks", {"HVDLITE_SHM": "1", "HVDLITE_SHM_SLOT_MB": "0.05",
                          "HVDLITE_SHM_CHUNK_MB": "0.01"}, lanes={"shm_collectives": True}),
    Config("no-steady", {"HVDLITE_STEADY_STATE": "0"},
           lanes={"steady_entered": False, "express": False}),
    Config("no-cache", {"HOROVOD_CACHE_CAPACITY": "0"},
           lanes={"steady_entered": False, "express": False}),
    Config("small-cache", {"HOROVOD_CACHE_CAPACITY": "4"}),
    Config("timeline", {"HOROVOD_TIMELINE": "{tmp}/timeline.json",
                        "HOROVOD_TIMELINE_MARK_CYCLES": "1"},
           lanes={"express": False, "steady_entered": False}),
    Config("no-fusion", {"HOROVOD_FUSION_THRESHOLD": "0", "HVDLITE_BUCKET_CAP_MB": "0"}),
    Config("mpi", {}, ("--mpi",), mpi=True, lanes={"steady_entered": True,
                                                   "round_payloads": True}),
    Config("mpi-peers-tcp", {"HVDLITE_STEADY_ROUNDS": "peers", "HVDLITE_SHM": "0"}, ("--mpi",),
           mpi=True, lanes={"steady_entered": True, "shm_collectives": False}),
    Config("mpi-shm", {"HVDLITE_MPI_WAIT": "yield", "HVDLITE_SHM": "1"}, ("--mpi",), mpi=True,
           lanes={"shm_collectives": True}),
]}


def have_mpi() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    import shutil
    return bool(shutil.which("mpiexec", path=str(Path(sys.executable).parent))
                or shutil.which("mpiexec"))


@dataclass
class JobResult:
    config: str
    np: int
    seeds: list
    ok: list
    failed: dict            # seed -> the failing ranks' lines
    lanes: dict             # counter -> summed over ranks
    output: str
    returncode: int
    lane_problems: list


def counters_of(lines: list[str]) -> dict:
    import json
    for line in lines:
        if line.startswith("COUNTERS "):
            return json.loads(line[len("COUNTERS "):])
    return {}


# The worker of each frontend; TensorFlow's runs the blocking part of each program
# (tests/workers/conformance_tf.py says which), quiet and single-threaded.
WORKERS = {"torch": ("conformance.py", {}),
           "tensorflow": ("conformance_tf.py", {"TF_CPP_MIN_LOG_LEVEL": "2",
                                                "TF_ENABLE_ONEDNN_OPTS": "0",
                                                "OMP_NUM_THREADS": "1",
                                                "HVDLITE_START_TIMEOUT": "120"})}


def run_job(config: Config, np: int, seeds: list[int], timeout: float = 300,
            op_timeout: float = 60.0, extra_args: list[str] | None = None,
            frontend: str = "torch") -> JobResult:
    """One job: `seeds` in turn on `np` ranks under `config`; each seed's verdict from its
    CHECK lines (a seed with no verdict on some rank failed: the job died or hung there)."""
    script, frontend_env = WORKERS[frontend]
    with tempfile.TemporaryDirectory(prefix="hvdlite-conformance-") as tmp:
        env = dict(frontend_env)
        env.update({k: v.replace("{tmp}", tmp) for k, v in config.env.items()})
        env.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(int(op_timeout)))
        args = ["--seeds", ",".join(map(str, seeds)), "--config", config.name,
                *(["--op-timeout", str(op_timeout)] if frontend == "torch" else []),
                *(extra_args or [])]
        try:
            proc = hvdlite_run(script, np=np, args=args, env=env, timeout=timeout,
                               launcher_args=list(config.launcher_args), check=False)
            out, code = proc.stdout + "\n--- stderr\n" + proc.stderr, proc.returncode
            stdout = proc.stdout
        except AssertionError as exc:      # the launcher itself ran past `timeout`
            out, code, stdout = str(exc), -1, str(exc)
        timeline = env.get("HOROVOD_TIMELINE")
        recorded = os.path.getsize(timeline) if timeline and os.path.exists(timeline) else 0
    lines = {r: rank_lines(stdout, r) for r in range(np)}
    ok, failed = [], {}
    for s in seeds:
        verdicts = {r: [x for x in ls if re.match(rf"CHECK seed{s} (OK|FAIL)", x)]
                    for r, ls in lines.items()}
        if all(v and v[-1].startswith(f"CHECK seed{s} OK") for v in verdicts.values()):
            ok.append(s)
        else:
            failed[s] = {r: _failure_lines(ls, s) for r, ls in lines.items()}
    lanes: dict = {}
    for ls in lines.values():
        for k, v in counters_of(ls).items():
            lanes[k] = lanes.get(k, 0) + v
    problems = lane_problems(config, lanes, want_on=False)
    if timeline and not recorded:
        problems.append(f"HOROVOD_TIMELINE={timeline}: rank 0 wrote no timeline")
    return JobResult(config.name, np, seeds, ok, failed, lanes, out, code, problems)


def lane_problems(config: Config, lanes: dict, want_on: bool) -> list[str]:
    """The lanes of `config` that `lanes` (counters summed over ranks and jobs) show wrong:
    those meant to be off (want_on=False) or those meant to run (want_on=True). An engine
    without these counters reports none: nothing to judge."""
    problems = []
    for counter, want in config.lanes.items():
        got = lanes.get(counter)
        if want == want_on and got is not None and bool(got) != want:
            problems.append(f"{counter} = {got} summed over the ranks, expected "
                            f"{'> 0' if want else '0'} under {config.name}")
    return problems


def _failure_lines(lines: list[str], seed: int) -> list[str]:
    keep, inside = [], False
    for x in lines:
        if x.startswith((f"CHECK seed{seed} FAIL", "HANG")) \
                or (x.startswith("REPLAY") and f"--seeds {seed} " in x + " "):
            keep.append(x)
            inside = x.startswith("CHECK")
        elif inside and x.startswith("  |"):
            keep.append(x)
        else:
            inside = False
    return keep


def replay_command(config: str, np: int, seeds, frontend: str = "torch") -> str:
    return (f"scripts/conformance.sh --config {config} --np {np} "
            f"--seeds {','.join(map(str, seeds))}"
            + ("" if frontend == "torch" else f" --frontend {frontend}"))


__all__ = [
    "CONFIGS",
    "Config",
    "JobResult",
    "have_mpi",
    "lane_problems",
    "replay_command",
    "run_job",
]
