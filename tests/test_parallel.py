"""hvdlite.torch.parallel on real ranks through hvdlite-run: tensor parallel (tp = 2, 4),
pipeline parallel (pp = 2, 4; GPipe and 1F1B; m = p, 2p and an odd m; checkpointing; skip
connections across stages; tuple and variable-shape activations), tp=2 x pp=2, and both composed
with data parallelism through DistributedOptimizer(process_set=mesh.dp). Every configuration is
compared with the dense single-process model: loss, outputs, every parameter's gradient (gathered
to full shape) and the weights after optimizer steps, fp32 at rtol 1e-5 / atol 1e-6.

One launch per world size runs every check (tests/workers/parallel_checks.py) and prints one
`CHECK <name> OK|FAIL` line per rank; each test below judges one check, so a failure names it.
Stalls fail fast: the engine's stall shutdown (and so the pipelines' message timeout) is 60 s.
"""
from __future__ import annotations

import re

import pytest

from util import ROOT, Run, hvdlite_run, rank_lines

ENV = {"HVDLITE_STALL_CHECK_TIME_SECONDS": "20", "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "60"}


@pytest.fixture(scope="module")
def np2():
    return Run("parallel_checks.py", 2, ["tp", "pp", "stall"], env=ENV, timeout=200)


@pytest.fixture(scope="module")
def np4():
    return Run("parallel_checks.py", 4, ["tp", "pp", "3d"], env=ENV, timeout=200)


TP_CHECKS = ["init_slices", "mappings", "mlp", "embedding", "cross_entropy", "gpt", "rng",
             "checkpoint", "errors"]
PP_CHECKS = (["gpipe_m{p}", "gpipe_m{2p}", "gpipe_m{odd}", "1f1b_m{p}", "1f1b_m{2p}",
              "1f1b_m{odd}", "gpipe_checkpoint_except_last", "1f1b_checkpoint_always", "m1",
              "forward_only", "variable_shapes", "balance", "factories", "custom_schedule",
              "errors"])


def _pp_name(p: int, check: str) -> str:
    return f"pp{p}_" + check.format(p=p, **{"2p": 2 * p, "odd": 5})


@pytest.mark.timeout(240)
def test_np2_finished(np2):
    np2.finished()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", TP_CHECKS)
def test_tp2(np2, check):
    np2.check(f"tp2_{check}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", PP_CHECKS)
def test_pp2(np2, check):
    np2.check(_pp_name(2, check))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", ["mesh_layout", "p2p_messages", "mesh_without_dynamic_sets",
                                   "pp2_stall_warning", "pp2_timeout"])
def test_np2_misc(np2, check):
    np2.check(check)


@pytest.mark.timeout(240)
def test_stall_warning_names_the_message(np2):
    (text,) = np2.tagged(1, "STALL-WARNING")[:1] or ["<none>"]
    assert re.search(r"waited \d+\.\d s for message 'pipe\d+\.fwd\.0>1\.mb0': the activations "
                     r"of micro-batch 0 from stage 0 \(rank 0\)", text), text


@pytest.mark.timeout(240)
def test_timeout_error_names_the_message(np2):
    (text,) = np2.tagged(1, "TIMEOUT-ERROR")[:1] or ["<none>"]
    assert "fwd.0>1.mb0" in text and "giving up after the 1.5 s timeout" in text, text


@pytest.mark.timeout(240)
def test_schedule_deadlock_report(np2):
    (text,) = np2.tagged(0, "DEADLOCK-REPORT")[:1] or ["<none>"]
    assert "would deadlock" in text and "waits for gradients of micro-batch 0" in text, text


@pytest.mark.timeout(300)
def test_np4_finished(np4):
    np4.finished()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", TP_CHECKS)
def test_tp4(np4, check):
    np4.check(f"tp4_{check}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", PP_CHECKS)
def test_pp4(np4, check):
    np4.check(_pp_name(4, check))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [2, 4, 3])
def test_tp2_pp2(np4, schedule, m):
    np4.check(f"tp2_pp2_{schedule}_m{m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", ["tp2_pp2_1f1b_m3_checkpoint", "tp2_pp2_clip_grad_norm",
                                   "pp2_dp2_distributed_optimizer",
                                   "tp2_dp2_distributed_optimizer", "tp2_rng_across_dp",
                                   "mesh_layout", "p2p_messages"])
def test_np4_misc(np4, check):
    np4.check(check)


@pytest.mark.timeout(300)
def test_mesh_prints_rank_map(np4):
    text = "\n".join(np4.lines[0])
    assert "Mesh(tp=2, pp=2, dp=1) over 4 ranks" in text
    assert "pp groups: [0, 2] [1, 3]" in text and "tp groups: [0, 1] [2, 3]" in text


@pytest.mark.timeout(200)
def test_example_gpt_tp2_pp2():
    """The example trains a GPT-style model with tp=2 x pp=2 on 4 processes."""
    script = ROOT / "examples" / "parallel" / "gpt_tp_pp.py"
    proc = hvdlite_run(script, np=4, args=["--steps", "30", "--log-every", "10"], env=ENV,
                       timeout=180)
    lines = rank_lines(proc.stdout, 2)           # the last stage's tp-rank 0 reports
    final = [x for x in lines if x.startswith("final loss")]
    assert final, proc.stdout[-3000:]
    m = re.match(r"final loss ([\d.]+) \(first ([\d.]+)\)", final[0])
    last, first = float(m.group(1)), float(m.group(2))
    assert last < 0.6 * first, final[0]
    assert "tp=2 pp=2 dp=1" in final[0]


@pytest.mark.timeout(150)
def test_bubble_benchmark_runs():
    """Smoke run of benchmarks/pipeline_bubble.py (timings are not judged)."""
    script = ROOT / "benchmarks" / "pipeline_bubble.py"
    proc = hvdlite_run(script, np=2, args=["--chunks", "1,2", "--rounds", "1", "--steps", "1",
                                           "--hidden", "32", "--layers", "1"], env=ENV,
                       timeout=120)
    out = "\n".join(rank_lines(proc.stdout, 0))
    assert "formula" in out and "hvd/torch" in out, out
    assert re.search(r"gpipe\s+2\s+33\.3%", out), out          # (p-1)/(m+p-1) for p=2, m=2
    assert "refused m<p" in out, out                            # torch's 1F1B needs m >= p
