"""Process sets on 4 real ranks: static (hvd.init(process_sets=[...])) and dynamic
(hvd.init(process_sets="dynamic") + add_process_set/remove_process_set).

Worker scripts: tests/workers/ps_static.py and ps_dynamic.py; each prints one `CHECK <name> OK|FAIL`
line per check and a final `FINISHED` line per rank. Broadcast roots are global ranks, Average
divides by the set size (Horovod semantics).
"""
from __future__ import annotations

import pytest

from util import Run


@pytest.fixture(scope="module")
def static_run():
    return Run("ps_static.py", 4, timeout=120)


@pytest.fixture(scope="module")
def dynamic_run():
    return Run("ps_dynamic.py", 4, timeout=120)


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
    static_run.check(name)


@pytest.mark.timeout(150)
def test_static_process_sets_finished(static_run):
    static_run.finished()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", [
    "add_and_use",             # add [0,2], ProcessSet([1,3]), [1,2,3]; every collective on them
    "overlapping_async",
    "errors",                  # duplicate set, bad ranks, registered object, removing global set
    "remove_and_readd",        # removed set -> ValueError; re-add works; repeated remove/re-add
    "reinit_dynamic",          # shutdown forgets sets; init("dynamic") again and add again
])
def test_dynamic_process_sets(dynamic_run, name):
    dynamic_run.check(name)


@pytest.mark.timeout(150)
def test_dynamic_process_sets_finished(dynamic_run):
    dynamic_run.finished()
