"""Process sets on 4 real ranks: static (hvd.init(process_sets=[...])) and dynamic
(hvd.init(process_sets="dynamic") + add_process_set/remove_process_set).

Worker scripts: tests/workers/ps_static.py and ps_dynamic.py; each prints one `CHECK <name> OK|FAIL`
line per check and a final `FINISHED` line per rank. Broadcast roots are global ranks, Average
divides by the set size (Horovod semantics).
"""
from __future__ import annotations

import pytest

from util import hvdlite_run, rank_lines


def _launch(script: str, np: int = 4, timeout: float = 120) -> dict:
    proc = hvdlite_run(script, np=np, timeout=timeout)
    return {"script": script, "np": np, "output": proc.stdout + "\n--- stderr\n" + proc.stderr,
            "lines": {r: rank_lines(proc.stdout, r) for r in range(np)}}


def _assert_check(run: dict, name: str) -> None:
    problems = []
    for r, lines in run["lines"].items():
        found = [i for i, line in enumerate(lines) if line.startswith(f"CHECK {name} ")]
        if not found:
            problems.append(f"rank {r}: no result for check {name!r}")
        elif not lines[found[-1]].startswith(f"CHECK {name} OK"):
            i = found[-1]
            problems.append(f"rank {r}:\n" + "\n".join(
                [lines[i]] + [x for x in lines[i + 1:i + 12] if x.startswith("  |")]))
    if problems:
        pytest.fail(f"{run['script']} -np {run['np']}: check {name!r} failed\n"
                    + "\n".join(problems), pytrace=False)


def _assert_finished(run: dict) -> None:
    missing = [r for r, lines in run["lines"].items()
               if not any(line.startswith("FINISHED ") for line in lines)]
    if missing:
        pytest.fail(f"{run['script']}: ranks {missing} did not finish\n{run['output'][-6000:]}",
                    pytrace=False)


@pytest.fixture(scope="module")
def static_run():
    return _launch("ps_static.py")


@pytest.fixture(scope="module")
def dynamic_run():
    return _launch("ps_dynamic.py")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", [
    "registration",            # ids, size(), rank(), included() for even/odd/[1,2,3]/[0,1]
    "set_allreduce",           # 9 dtypes x Average/Sum/Min/Product on every set the rank is in
    "set_allreduce_Max",
    "set_collectives",         # grouped, allgather, broadcast (global roots), alltoall, rs
    "overlapping_async",       # global + overlapping sets in flight together, rank-dependent order
    "set_grads",               # broadcast/allreduce gradients inside a set
    "errors",                  # non-member -> ValueError; root outside set; add_process_set refused
])
def test_static_process_sets(static_run, name):
    _assert_check(static_run, name)


@pytest.mark.timeout(150)
def test_static_process_sets_finished(static_run):
    _assert_finished(static_run)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", [
    "add_and_use",             # add [0,2], ProcessSet([1,3]), [1,2,3]; every collective on them
    "overlapping_async",
    "errors",                  # duplicate set, bad ranks, registered object, removing global set
    "remove_and_readd",        # removed set -> ValueError; re-add works; repeated remove/re-add
    "reinit_dynamic",          # shutdown forgets sets; init("dynamic") again and add again
])
def test_dynamic_process_sets(dynamic_run, name):
    _assert_check(dynamic_run, name)


@pytest.mark.timeout(150)
def test_dynamic_process_sets_finished(dynamic_run):
    _assert_finished(dynamic_run)
