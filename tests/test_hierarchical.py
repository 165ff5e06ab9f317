"""Hierarchical allreduce on two "hosts": -H localhost:2,127.0.0.1:2 starts all four ranks here,
but the engine sees two hosts (HOROVOD_HOSTNAME), so the three-step path runs on real gloo."""
from __future__ import annotations

import re

import pytest

from hvdlite.common.hierarchical import host_groups
from util import hvdlite_run, rank_lines

TWO_HOSTS = ["-H", "localhost:2,127.0.0.1:2"]


def _checks_pass(out: str, ranks: int) -> None:
    for r in range(ranks):
        lines = rank_lines(out, r)
        assert any(line.startswith("FINISHED") and line.endswith("0 failed: []")
                   for line in lines), "\n".join(lines)


@pytest.mark.timeout(240)
def test_hierarchical_allreduce_two_hosts():
    proc = hvdlite_run("hierarchical_ops.py", np=4, timeout=220,
                       launcher_args=[*TWO_HOSTS, "--hierarchical-allreduce"],
                       env={"HOROVOD_LOG_LEVEL": "info"})
    _checks_pass(proc.stdout, 4)
    # The engine really took the hierarchical path (logged when the factory is wrapped).
    assert len(re.findall(r"hierarchical allreduce over 2 hosts: \[\[0, 1\], \[2, 3\]\]",
                          proc.stderr)) == 4, proc.stderr


def test_host_groups():
    assert host_groups({0: "a", 1: "b", 2: "a", 3: "b"}, 4) == [[0, 2], [1, 3]]
    assert host_groups({"0": "a", "1": "a"}, 2) == [[0, 1]]
