"""Kill loop: an elastic job under a steady stream of failures, against torchrun on the same one.

    python benchmarks/kill_loop.py --short         # 70 s, ~4 failures per job (run_all.sh)
    python benchmarks/kill_loop.py                 # full: 300 s per job, one failure / 10-20 s
    python benchmarks/kill_loop.py --save-cost     # async checkpoint cost per step (transformer)

hvdlite: `hvdlite-run -np 3 --min-np 2 --max-np 3` on one host (discovery prints localhost:3,
`--blacklist-cooldown-range 1 2`, stall shutdown 6 s), the elastic worker of the tests
(tests/workers/elastic_train.py: commit every 2 steps, `TorchState(checkpoint_dir=,
checkpoint_every=3)`, i.e. a checkpoint every 6 steps). torchrun: `--nproc-per-node 3
--max-restarts 100`, the same model and steps over gloo (timeout 6 s, like the stall shutdown),
`torch.save` on rank 0 every 6 steps, loaded on every restart.

A seeded injector keeps one failure in flight every 10-20 s (short mode: 70 s, ~4 failures), from
SIGKILL of a worker, SIGKILL of rank 0 and SIGSTOP of a worker (a hang), plus once per run
SIGKILL of every worker at once (recovery from the checkpoint). Both jobs get the same schedule.
From rank 0's step log ("run <step> <time>", "commit <step> <time>"):
- committed steps lost: steps below the highest commit before a failure run again after it
  (hvdlite's commits are in memory, torchrun's are its checkpoints);
- time to next commit: from the failure to the first commit beyond the last one before it;
- goodput: steps per second under failures over steps per second of the same job without.
The machine this runs on is shared: run it on a quiet one for figures to quote.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "elastic_train.py"
RUN = str(Path(sys.executable).parent / "hvdlite-run")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
NP, COMMIT_EVERY, CHECKPOINT_EVERY, STEP_DELAY, SHUTDOWN_S = 3, 2, 3, 0.05, 6
KINDS = ("kill_worker", "kill_rank0", "stop_worker")


# ---------------------------------------------------------------------- torchrun's worker
def torchrun_worker() -> int:
    """elastic_train's model and steps under torchrun: gloo, torch.save checkpoints."""
    import datetime

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(WORKER.parent))
    import elastic_train as et

    rank = int(os.environ["RANK"])
    log_path, marks, ckpt = (os.environ["KL_STEP_LOG"], Path(os.environ["KL_MARKS"]),
                             os.environ["KL_CKPT"])
    (marks / f"pid.rank{rank}").write_text(str(os.getpid()))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=SHUTDOWN_S))
    model = et.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=et.LR, momentum=et.MOMENTUM)
    step = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step = saved["step"]

    def log(line: str) -> None:
        if rank == 0:
            with open(log_path, "a") as f:
                f.write(f"{line} {time.time():.3f}\n")

    while True:
        log(f"run {step}")
        x, c = et.batch(step)
        opt.zero_grad()
        (model(x) * c).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        # The elastic worker's other collectives per step (its size check and sample ids).
        dist.all_reduce(torch.ones(1))
        dist.all_gather_object([None] * dist.get_world_size(), [step, step + 1])
        step += 1
        if step % (COMMIT_EVERY * CHECKPOINT_EVERY) == 0 and rank == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
            log(f"commit {step}")
        time.sleep(STEP_DELAY)


# ---------------------------------------------------------------------- jobs
class Job:
    def __init__(self, system: str, tmp: Path) -> None:
        self.system, self.tmp = system, tmp
        self.marks = tmp / "marks"
        self.marks.mkdir(parents=True)
        self.log = tmp / "steps.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT), HVDLITE_START_TIMEOUT="60")
        if system == "hvdlite":
            script = tmp / "discover.sh"
            script.write_text(f"#!/bin/sh\necho localhost:{NP}\n")
            script.chmod(0o755)
            env.update(ELASTIC_TOTAL_STEPS="1000000", ELASTIC_STEP_DELAY=str(STEP_DELAY),
                       ELASTIC_COMMIT_EVERY=str(COMMIT_EVERY), ELASTIC_MARK_DIR=str(self.marks),
                       ELASTIC_STEP_LOG=str(self.log), ELASTIC_CHECKPOINT_DIR=str(tmp / "ckpt"),
                       ELASTIC_CHECKPOINT_EVERY=str(CHECKPOINT_EVERY))
            cmd = [RUN, "-np", str(NP), "--min-np", "2", "--max-np", str(NP),
                   "--host-discovery-script", str(script), "--blacklist-cooldown-range", "1", "2",
                   "--stall-check-warning-time-seconds", "2",
                   "--stall-check-shutdown-time-seconds", str(SHUTDOWN_S),
                   sys.executable, str(WORKER)]
        else:
            env.update(KL_STEP_LOG=str(self.log), KL_MARKS=str(self.marks),
                       KL_CKPT=str(tmp / "ckpt.pt"))
            cmd = [TORCHRUN, "--nproc-per-node", str(NP), "--max-restarts", "100",
                   "--monitor-interval", "0.5", __file__, "--torchrun-worker"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(tmp / "stderr", "w"), start_new_session=True)

    def workers(self) -> list[tuple[int, int]]:
        """(rank, pid) of the live workers."""
        out = []
        if self.system == "hvdlite":
            # Every started worker (pid.<slot>); its rank once it has stepped (step.<slot>).
            for f in self.marks.glob("pid.*"):
                try:
                    pid = int(f.read_text())
                except (OSError, ValueError):
                    continue
                try:
                    step = (self.marks / f.name.replace("pid.", "step.", 1)).read_text().split()
                    rank = int(step[2])
                except (OSError, ValueError, IndexError):
                    rank = -1
                out.append((rank, pid))
        else:
            for f in self.marks.glob("pid.rank*"):
                out.append((int(f.name[len("pid.rank"):]), int(f.read_text())))
        return [(r, p) for r, p in out if _alive(p)]

    def entries(self) -> list[tuple[str, int, float]]:
        try:
            text = self.log.read_text()
        except OSError:
            return []
        rows = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 3:
                rows.append((parts[0], int(parts[1]), float(parts[2])))
        return rows

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait(30)
        for _, pid in self.workers():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def schedule(seed: int, duration: float, gap: tuple[float, float]) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    times, t = [], 10.0   # the first failure after warm-up
    while t < duration - 10:
        times.append(t)
        t += rng.uniform(*gap)
    kinds = [KINDS[i % len(KINDS)] for i in range(len(times))]
    rng.shuffle(kinds)
    if times:
        kinds[len(kinds) // 2] = "kill_all"   # once per run
    return list(zip(times, kinds))


def inject(job: Job, kind: str, rng: random.Random) -> bool:
    workers = sorted(job.workers())
    if not workers:
        return False
    if kind == "kill_all":
        for _, pid in workers:
            os.kill(pid, signal.SIGKILL)
        return True
    if kind == "kill_rank0":
        victims = [p for r, p in workers if r == 0]
    else:
        victims = [p for r, p in workers if r > 0] or [p for r, p in workers if r != 0]
    if not victims:
        return False
    pid = rng.choice(victims)
    os.kill(pid, signal.SIGSTOP if kind == "stop_worker" else signal.SIGKILL)
    return True


def run_job(system: str, duration: float, plan: list[tuple[float, str]], seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(system, Path(tmp))
        rng = random.Random(seed)
        try:
            deadline = time.monotonic() + 180
            while not job.entries():
                if time.monotonic() > deadline or job.proc.poll() is not None:
                    raise RuntimeError(f"{system} did not start:\n"
                                       + (Path(tmp) / "stderr").read_text()[-3000:])
                time.sleep(0.1)
            t0 = time.time()
            done = []
            for at, kind in plan:
                while time.time() - t0 < at:
                    time.sleep(0.05)
                if job.proc.poll() is not None:
                    break
                if inject(job, kind, rng):
                    done.append((time.time(), kind))
            while time.time() - t0 < duration:
                time.sleep(0.1)
            alive = job.proc.poll() is None
        finally:
            job.stop()
            # The launcher's messages, for a look at what happened (tmp is removed).
            keep = Path(tempfile.gettempdir()) / f"kill_loop_{system}_{len(plan)}.stderr"
            keep.write_text((Path(tmp) / "stderr").read_text())
        return analyse(system, job.entries(), done, t0, time.time(), alive)


def analyse(system: str, rows: list, failures: list, t0: float, t_end: float,
            alive: bool) -> dict:
    runs = [(s, t) for k, s, t in rows if k == "run"]
    commits = [(s, t) for k, s, t in rows if k == "commit"]
    out = {"system": system, "failures": len(failures), "survived": alive,
           "progress": max((s for s, _ in runs), default=0), "by_kind": {}}
    lost_partial, lost_whole, recover = 0, 0, {}
    # (recovery time, kind, commit, steps lost so far) of the failure the job last recovered from
    open_since: tuple = (float("-inf"), "", 0, 0)
    for i, (tf, kind) in enumerate(failures):
        t_next = failures[i + 1][0] if i + 1 < len(failures) else t_end
        before = max((s for s, t in commits if t <= tf), default=0)
        charged, counted = kind, 0
        if tf < open_since[0]:
            # The job had not recovered from the failure before: what is lost from here on
            # belongs to that one (its commit is the one to keep), counted once.
            charged, before, counted = open_since[1], open_since[2], open_since[3]
        in_flight = max((s for s, t in runs if t <= tf), default=0)
        # The next commit of a step begun after the failure (a commit the survivors finish
        # just after it, of the step in flight, is not a recovery).
        nxt = [t for s, t in commits if t > tf and s >= in_flight + 2]
        recovered_at = nxt[0] if nxt else t_end
        # Steps run again: below the last commit, run between the failure and that recovery.
        after = [s for s, t in runs if tf < t <= recovered_at]
        total = max(counted, max(0, before - min(after)) if after else 0)
        lost, open_since = total - counted, (recovered_at, charged, before, total)
        if charged == "kill_all":
            lost_whole += lost
        else:
            lost_partial += lost
        recover.setdefault(kind, []).append(recovered_at - tf if nxt and nxt[0] < t_next
                                            else None)
    out["committed_steps_lost_partial"] = lost_partial
    out["steps_lost_whole_job"] = lost_whole
    for kind, times in recover.items():
        ok = [x for x in times if x is not None]
        out["by_kind"][kind] = {"n": len(times), "recovered": len(ok),
                                "median_s": statistics.median(ok) if ok else None,
                                "worst_s": max(ok) if ok else None}
    kills = [x for k in ("kill_worker", "kill_rank0") for x in recover.get(k, []) if x]
    out["kill_median_s"] = statistics.median(kills) if kills else None
    out["kill_worst_s"] = max(kills) if kills else None
    first = runs[0][1] if runs else t0
    out["steps_per_s"] = out["progress"] / max(1e-9, t_end - first)
    out["log"] = rows                 # to look at (or analyse again) later
    out["failure_times"] = failures
    return out


# ---------------------------------------------------------------------- async save cost
def save_cost_worker(rounds: int, steps: int) -> int:
    """On every rank: the transformer's step time with a checkpoint every 10 steps vs none,
    in alternating rounds."""
    import torch

    sys.path.insert(0, str(ROOT))
    import hvdlite.torch as hvd
    from benchmarks.models import transformer
    from hvdlite.torch import checkpoint

    hvd.init()
    model, x, y = transformer()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loss_fn = torch.nn.CrossEntropyLoss()
    tmp = tempfile.mkdtemp(prefix="hvdlite-save-cost-") if hvd.rank() == 0 else None
    tmp = hvd.broadcast_object(tmp, 0, name="tmp")

    def run(save: bool, r: int) -> float:
        start = time.perf_counter()
        for i in range(steps):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            if save and i % 10 == 9:
                checkpoint.save({"model": model, "optimizer": opt},
                                os.path.join(tmp, f"r{r}-s{i}"), keep=2)
        checkpoint.wait()
        return (time.perf_counter() - start) / steps

    run(True, -1)   # warm-up (optimizer state, first save)
    plain, saving = [], []
    for r in range(rounds):
        plain.append(run(False, r))
        saving.append(run(True, r))
    if hvd.rank() == 0:
        ratios = [s / p for s, p in zip(saving, plain)]
        print("SAVECOST " + json.dumps({
            "plain_ms": statistics.median(plain) * 1e3,
            "saving_ms": statistics.median(saving) * 1e3,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "rounds": rounds, "steps": steps,
            "params_mib": sum(p.numel() * 4 for p in model.parameters()) / 2**20}), flush=True)
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def save_cost(rounds: int, steps: int, np: int) -> dict:
    out = subprocess.run([RUN, "-np", str(np), sys.executable, __file__, "--save-cost-worker",
                          "--rounds", str(rounds), "--steps", str(steps)],
                         capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    for line in out.stdout.splitlines():
        if "SAVECOST " in line:
            return json.loads(line.split("SAVECOST ", 1)[1])
    raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])


# ---------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--duration", type=float, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--save-cost", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", choices=("hvdlite", "torchrun"), default=None,
                    help="run one system (to look at it; the table needs both)")
    ap.add_argument("--reanalyse", metavar="JSON", default=None,
                    help="print the table again from a saved --json (its step logs)")
    ap.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save-cost-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torchrun_worker:
        return torchrun_worker()
    if args.save_cost_worker:
        return save_cost_worker(args.rounds, args.steps)
    if args.save_cost:
        res = save_cost(args.rounds, args.steps, 2)
        print(f"async checkpoint every 10 steps, transformer ({res['params_mib']:.1f} MiB of "
              f"parameters), 2 ranks: {res['saving_ms']:.1f} ms/step against "
              f"{res['plain_ms']:.1f} ms/step without; ratio {res['ratio']:.3f} "
              f"(rounds {res['ratio_min']:.3f}-{res['ratio_max']:.3f}, {res['rounds']} "
              f"alternating rounds of {res['steps']} steps; target <= 1.05)")
        if args.json:
            Path(args.json).write_text(json.dumps({"save_cost": res}, indent=1))
        return 0
    duration = args.duration or (70.0 if args.short else 300.0)
    gap = (10.0, 20.0)
    plan = schedule(args.seed, duration, gap)
    clean_s = 20.0 if args.short else 60.0
    results = {}
    if args.reanalyse:
        saved = json.loads(Path(args.reanalyse).read_text())
        plan = [tuple(p) for p in saved["plan"]]
        for system, r in saved["results"].items():
            rows = [tuple(row) for row in r["log"]]
            failures = [tuple(f) for f in r["failure_times"]]
            t_first = rows[0][2] if rows else 0.0
            again = analyse(system, rows, failures, t_first, t_first + (r["progress"] /
                                                                        r["steps_per_s"]),
                            r["survived"])
            again["goodput"] = again["steps_per_s"] / max(1e-9, r["clean_steps_per_s"])
            again["clean_steps_per_s"] = r["clean_steps_per_s"]
            results[system] = again
    for system in () if args.reanalyse else (args.only,) if args.only \
            else ("hvdlite", "torchrun"):
        clean = run_job(system, clean_s, [], args.seed)
        loaded = run_job(system, duration, plan, args.seed)
        loaded["goodput"] = loaded["steps_per_s"] / max(1e-9, clean["steps_per_s"])
        loaded["clean_steps_per_s"] = clean["steps_per_s"]
        results[system] = loaded
    print(f"kill loop: {len(plan)} failures over {duration:.0f} s "
          f"({', '.join(k for _, k in plan)}), seed {args.seed}; {NP} workers on this host, "
          f"commit every {COMMIT_EVERY} steps, checkpoint every "
          f"{COMMIT_EVERY * CHECKPOINT_EVERY} steps (machine shared: rerun quiet to quote)")
    head = (f"{'':10} {'failures':>8} {'survived':>8} {'lost(partial)':>13} {'lost(whole)':>11} "
            f"{'kill med/worst s':>17} {'hang med s':>10} {'goodput':>8}")
    print(head)

    def fmt(x):
        return "-" if x is None else f"{x:.1f}"
    for system, r in results.items():
        hang = r["by_kind"].get("stop_worker", {}).get("median_s")
        print(f"{system:10} {r['failures']:>8} {str(r['survived']):>8} "
              f"{r['committed_steps_lost_partial']:>13} {r['steps_lost_whole_job']:>11} "
              f"{fmt(r['kill_median_s']) + '/' + fmt(r['kill_worst_s']):>17} {fmt(hang):>10} "
              f"{r['goodput']:>8.2f}")
    ratio = None
    if len(results) == 2:
        ratio = results["hvdlite"]["goodput"] / max(1e-9, results["torchrun"]["goodput"])
        print(f"goodput hvdlite / torchrun: {ratio:.2f} (target >= 2)")
    if args.json and not args.reanalyse:
        Path(args.json).write_text(json.dumps({"plan": plan, "results": results,
                                               "goodput_ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
