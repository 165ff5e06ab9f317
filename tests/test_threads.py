"""torch's intra-op threads per rank (hvdlite/common/threads.py), on 2 real ranks: the host's
cores divided among its ranks by default, and the user's choice kept: OMP_NUM_THREADS (here 2,
all of this 2-core machine's cores, where the default would give each rank 1), or
torch.set_num_threads before init with fewer threads than cores (checked where the machine has
more than 2 cores)."""
from __future__ import annotations

import pytest

from util import Run

from hvdlite.common.threads import fair_share, usable_cores


def test_fair_share_arithmetic():
    assert fair_share(2, cores=2) == 1
    assert fair_share(4, cores=2) == 1
    assert fair_share(2, cores=16) == 8
    assert fair_share(0, cores=4) == 4
    assert usable_cores() >= 1


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["default", "omp_env", "script"])
def test_threads_per_rank(how):
    env = {"OMP_NUM_THREADS": ""}
    args = []
    chosen = str(usable_cores())
    if how == "omp_env":
        env = {"OMP_NUM_THREADS": chosen}
    elif how == "script":
        if usable_cores() <= 2:
            pytest.skip("needs more than 2 cores: below that a script's own count cannot "
                        "differ from both torch's default and a rank's fair share")
        chosen = str(usable_cores() - 1)
        args = ["--set", chosen]
    run = Run("threads_check.py", 2, args=args, env=env, timeout=150)
    run.check("threads")
    run.finished()
    counts = [run.tagged(r, "THREADS")[0].split()[0] for r in range(2)]
    if how == "default":
        assert counts == [str(fair_share(2))] * 2
    else:
        assert counts == [chosen, chosen]
