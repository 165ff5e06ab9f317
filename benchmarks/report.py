"""Markdown tables for docs/benchmarks.md from the JSON that `bash benchmarks/run_all.sh` writes.

    python benchmarks/report.py [benchmarks/results]            # every table
    python benchmarks/report.py [benchmarks/results] --glance   # the targets only

Why: the published figures should come from one run, copied without retyping. Every table shows
medians over alternating rounds with the min-max spread of the per-round ratios, as the
benchmarks print them. A result file that is missing (MPI not installed, say) is skipped.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics

MODELS = (("mlp", "MLP, 3.7 M params"), ("cnn", "CNN + BatchNorm, 1.1 M"),
          ("transformer", "transformer, 2.1 M"))


def _load(root: str, name: str):
    path = os.path.join(root, name + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _first(root: str, names, keep=lambda d: True):
    """The first of the result files `names` that exists and that `keep` accepts, else None."""
    return next((d for d in (_load(root, n) for n in names) if d is not None and keep(d)), None)


# Where the GPU figures come from: a run_all.sh on a GPU host writes gpu_np1.json; the last
# GPU hosts' results were kept under the other names, newest first.
GPU_RESULTS = ("gpu_np1", "gpu_h200_latest_np1", "gpu_h100_latest_np1")
# Two ranks on NCCL: gpu.sh on a host of two GPUs writes gpu_np2.json; on one GPU, its run of
# two ranks under their own NCCL_HOSTIDs writes gpu_np2_nccl_hostid.json.
NCCL2_RESULTS = ("gpu_np2", "gpu_np2_nccl_hostid", "gpu_h200_latest_np2_nccl_hostid")


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def _vs(x: float, goal: float) -> str:
    """`x` to two places, or three where two would hide which side of `goal` it falls."""
    two = f"{x:.2f}"
    return f"{x:.3f}" if float(two) == goal and x != goal else two


SHORT = {"mlp": "MLP", "cnn": "CNN", "transformer": "transformer"}


def targets(root: str) -> list[str]:
    """The engine's targets (issue 9) against this run, one row each: what was asked, the
    figures, whether they meet it, and for those that do not, the limit the run measured."""
    out = ["| target | this run | met? | where it is not, the limit |", "|---|---|---|---|"]
    host16 = _load(root, "host16_train_step_gloo_np2")
    for kind, label, goal in (("gloo_np2", "2-rank step ≤ 0.85 × DDP, gloo", 0.85),
                              ("mpi_np2", "2-rank step ≤ 0.85 × DDP, MPI", 0.85),
                              ("gloo_np4", "4 ranks on 2 cores ≤ 1.0 × DDP, gloo", 1.0),
                              ("mpi_np4", "4 ranks on 2 cores ≤ 1.0 × DDP, MPI", 1.0)):
        d = _load(root, f"train_step_{kind}")
        if d is None:
            continue
        rs = [d["results"][key] for key, _ in MODELS]
        limits = []
        for (key, _), r in zip(MODELS, rs):
            if r["ratio"] <= goal:
                continue
            floor = r["serial_median_ms"] / r["ddp_median_ms"]
            if floor <= goal:
                limits.append(f"{SHORT[key]}: above it in this run, over a serial floor of "
                              f"{floor:.2f} (the ratio moves by up to ±0.1 between runs)")
                continue
            text = f"{SHORT[key]}'s serial floor {floor:.2f}"
            if key == "transformer" and host16 is not None:
                h = host16["results"][key]
                text += (f"; on 16 cores its step with no communication takes "
                         f"{h['local_median_ms'] / h['ddp_median_ms']:.3f} of DDP's")
            limits.append(text)
        out.append(f"| {label} (MLP / CNN / transformer) | "
                   + " / ".join(_vs(r["ratio"], goal) for r in rs) + " | "
                   + " / ".join(_yes(r["ratio"] <= goal) for r in rs) + " | "
                   + "; ".join(limits) + " |")
    runs = {k: _load(root, f"allreduce_{k}") for k in ("gloo", "gloo_tcp", "mpi")}
    names = {"gloo": "shared memory", "gloo_tcp": "TCP", "mpi": "MPI"}

    def size(kind: str, nbytes: int):
        d = runs[kind]
        return None if d is None else {r["bytes"]: r for r in d["sizes"]}.get(nbytes)

    for kinds, goal, label in ((("gloo", "gloo_tcp"), 1.5, "4 KiB allreduce ≤ 1.5 × raw gloo"),
                               (("mpi",), 3.0, "4 KiB allreduce ≤ 3 × raw MPI")):
        rows = [(k, size(k, 4096)) for k in kinds if size(k, 4096)]
        if rows:
            ratios = [r["hvdlite_us"] / r["raw_us"] for _, r in rows]
            # Where one is missed, the Python of a call: a one-rank job's, with no transport.
            alone = _load(root, "one_rank")
            limit = ""
            if alone is not None and any(x > goal for x in ratios):
                us = next((r["hvdlite_us"] for r in alone["rows"]
                           if r["what"] == "allreduce_ 4096 B"), None)
                if us is not None:
                    limit = (f"the Python of a call: {us:.1f} µs on one rank with no "
                             f"transport, run on each rank around the transport call")
            out.append(f"| {label} | " + ", ".join(
                f"{x:.2f} × ({names[k]})" for (k, _), x in zip(rows, ratios)) + " | "
                + " / ".join(_yes(x <= goal) for x in ratios) + f" | {limit} |")
    why = {"gloo": "", "gloo_tcp": "gloo's TCP loopback swings from run to run",
           "mpi": "Python run with cold caches around the transfer (After a large transfer)"}
    for kinds, label in ((("gloo", "gloo_tcp"), "gloo"), (("mpi",), "MPI")):
        cells, oks, limits = [], [], []
        for k in kinds:
            pair = [size(k, 16 << 20), size(k, 64 << 20)]
            if None in pair:
                continue
            cells.append(" / ".join(f"{r['ratio_bw']:.2f}" for r in pair) + f" ({names[k]})")
            oks.append(" / ".join(_yes(r["ratio_bw"] >= 0.95) for r in pair))
            limits += [f"{names[k]} {mib} MiB (spread {r['ratio_bw_min']:.2f}–"
                       f"{r['ratio_bw_max']:.2f}): "
                       + "; ".join(x for x in (why[k], _agreed_floor(r)) if x)
                       for mib, r in zip((16, 64), pair) if r["ratio_bw"] < 0.95]
        if cells:
            out.append(f"| 16 / 64 MiB ≥ 0.95 × raw bus bandwidth, {label} | "
                       + ", ".join(cells) + " | " + ", ".join(oks) + " | "
                       + "; ".join(limits) + " |")
    fused = [(k, runs[k]["many_small"]) for k in ("gloo", "gloo_tcp", "mpi") if runs[k]]
    if fused:
        limits = [f"{names[k]}: one raw call on one buffer of the same bytes is only "
                  f"{m['limit']:.2f} × its one by one" for k, m in fused if m["speedup"] < 4]
        out.append("| 100 tensors of 4–256 KiB fused ≥ 4 × raw one by one | " + ", ".join(
            f"{m['speedup']:.2f} × ({names[k]})" for k, m in fused) + " | "
            + " / ".join(_yes(m["speedup"] >= 4) for _, m in fused) + " | "
            + "; ".join(limits) + " |")
    cp = _load(root, "control_plane")
    if cp is not None:
        first, last = cp["rows"][0], cp["rows"][-1]
        grow = last["steady"]["work_us"]["median"] / first["steady"]["work_us"]["median"]
        coord = (last["coordinator"]["work_us"]["median"]
                 / first["coordinator"]["work_us"]["median"])
        bound = math.log2(last["ranks"]) / math.log2(first["ranks"])
        out.append(f"| steady state's work per cycle grows ≤ log2 N (× {bound:.0f} from "
                   f"{first['ranks']} to {last['ranks']} ranks) | × {grow:.1f} (the "
                   f"coordinator × {coord:.1f}) | {_yes(grow <= bound)} | |")
    gpu = _first(root, GPU_RESULTS)
    if gpu is not None and gpu.get("train"):
        rs = [gpu["train"][k] for k in ("resnet", "transformer") if k in gpu["train"]]
        out.append("| GPU step ≤ 0.95 × DDP on NCCL, one GPU (CNN / transformer) | "
                   + " / ".join(_vs(r["ratio"], 0.95) for r in rs) + f" ({gpu['gpu']}) | "
                   + " / ".join(_yes(r["ratio"] <= 0.95) for r in rs) + " | "
                   + "; ".join(f"its step with no communication: {r['floor']:.3f} of DDP's"
                               for r in rs if r["ratio"] > 0.95) + " |")
    two = _first(root, NCCL2_RESULTS,
                 lambda d: d.get("ranks", 1) >= 2 and d.get("peer", "").endswith("nccl"))
    if two is None:
        out.append("| two ranks on NCCL: step and bus bandwidth ≥ 0.95 × raw | not run | "
                   "blocked | needs a host with two GPUs |")
    else:
        out.append(_two_rank_nccl(two))
    return out


def _two_rank_nccl(d: dict) -> str:
    """The two-rank NCCL target's row: the step against DDP on NCCL, and the bus bandwidth of
    the largest allreduce against raw torch.distributed (queued calls; and each call waited
    for, as a blocking hvd.allreduce_ is), each also with async completion where measured."""
    rs = [d["train"][k] for k in ("resnet", "transformer") if k in d["train"]]
    bw = d["busbw"][-1] if d["busbw"] else None
    step = " / ".join(_vs(r["ratio"], 0.95) for r in rs) + " (step"
    if all("ratio_async" in r for r in rs):
        step += "; " + " / ".join(_vs(r["ratio_async"], 0.95) for r in rs) + \
            " with async completion"
    shown = [step + ")"]
    met = [" / ".join(_yes(r["ratio"] <= 0.95) for r in rs)]
    if bw is not None:
        extra = f"{bw.get('ratio_waited', 0):.2f} of raw waited per call"
        if "ratio_async" in bw:
            extra += f"; {_vs(bw['ratio_async'], 0.95)} with async completion"
        shown.append(f"{_vs(bw['ratio'], 0.95)} at {bw['bytes'] >> 20} MiB ({extra})")
        met.append(_yes(bw["ratio"] >= 0.95))
    limit = ""
    if d.get("nccl_hostid"):
        shown[-1] += (f" ({d['gpu']}: two ranks on its one GPU, an NCCL_HOSTID each)")
        limit = ("loopback sockets and a GPU time-sliced between the ranks, not two GPUs; the "
                 "step runs the same NCCL calls on the same bytes as DDP's and is bound by "
                 "them (no comm / DDP: " + " / ".join(f"{r['floor']:.2f}" for r in rs) + ")")
    return (f"| two ranks on NCCL: step ≤ 0.95 × DDP and bus bandwidth ≥ 0.95 × raw | "
            f"{', '.join(shown)} | {' ; '.join(met)} | {limit} |")


def _agreed_floor(r: dict) -> str:
    """Where a large allreduce misses raw's bandwidth: what a collective agreed before it is
    sent (a raw 16-byte allreduce, then the data) reaches in the same run, and hvdlite against
    it; "" for results written before allreduce.py measured it at every size."""
    if "ratio_agreed" not in r:
        return ""
    return (f"a collective agreed before it is sent (raw 16-byte allreduce, then the data) "
            f"reaches {r['raw_us'] / r['raw_agreed_us']:.2f} of raw, and hvdlite "
            f"{r['ratio_agreed']:.2f} of that")


def train_step(root: str) -> list[str]:
    out = ["| model | ranks, transport | hvdlite ms | torch DDP (gloo) ms | no comm ms | "
           "serial floor ms | hvdlite/DDP (spread) | limit: serial/DDP (no comm/DDP) |",
           "|---|---|---|---|---|---|---|---|"]
    for kind, label in (("gloo_np2", "2, gloo"), ("gloo_np4", "4 on 2 cores, gloo"),
                        ("mpi_np2", "2, MPI"), ("mpi_np4", "4 on 2 cores, MPI")):
        d = _load(root, f"train_step_{kind}")
        if d is None:
            continue
        for key, name in MODELS:
            r = d["results"][key]
            serial = r.get("serial_median_ms")     # results written before it existed lack it
            floor = "—" if serial is None else f"{serial / r['ddp_median_ms']:.2f}"
            out.append(f"| {name} | {label} | {r['hvdlite_median_ms']:.2f} | "
                       f"{r['ddp_median_ms']:.2f} | {r['local_median_ms']:.2f} | "
                       f"{'—' if serial is None else f'{serial:.2f}'} | "
                       f"**{r['ratio']:.2f}** ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | "
                       f"{floor} "
                       f"({r['local_median_ms'] / r['ddp_median_ms']:.2f}) |")
    return out


def allreduce(root: str) -> list[str]:
    out = ["| hvdlite's data path (raw peer) | 4 KiB latency, hvdlite vs raw | 16 MiB busbw ratio "
           "| 64 MiB busbw ratio | 100 tensors of 4–256 KiB, fused vs raw one by one "
           "| the same as one `grouped_allreduce_` "
           "| limit: raw one by one vs raw one buffer (with the copies in and out) |",
           "|---|---|---|---|---|---|---|"]
    for kind, label in (("gloo", "shared memory (raw gloo)"),
                        ("gloo_tcp", "gloo's TCP, `HVDLITE_SHM=0` (raw gloo)"),
                        ("mpi", "MPI (raw mpi4py)")):
        d = _load(root, f"allreduce_{kind}")
        if d is None:
            continue
        by = {r["bytes"]: r for r in d["sizes"]}
        small, m16, m64 = by.get(4096), by.get(16 << 20), by.get(64 << 20)
        many = d["many_small"]
        cells = [f"{small['hvdlite_us']:.0f} µs vs {small['raw_us']:.0f} µs: "
                 f"{small['hvdlite_us'] / small['raw_us']:.2f}×" if small else "—"]
        if small and "raw_agreed_us" in small:
            cells[0] += (f" (raw 16-byte agreement + data: {small['raw_agreed_us']:.0f} µs, "
                         f"{small['raw_agreed_us'] / small['raw_us']:.2f}×)")
        for r in (m16, m64):
            cell = f"{r['ratio_bw']:.2f} ({r['ratio_bw_min']:.2f}–{r['ratio_bw_max']:.2f})" \
                if r else "—"
            if r and "ratio_agreed" in r:   # (results written before it existed lack it)
                cell += (f"; against raw agreement + data {r['ratio_agreed']:.2f} "
                         f"({r['ratio_agreed_min']:.2f}–{r['ratio_agreed_max']:.2f}), "
                         f"which reaches {r['raw_us'] / r['raw_agreed_us']:.2f} of raw")
            cells.append(cell)
        cells.append(f"{many['hvdlite_ms']:.1f} vs {many['raw_one_by_one_ms']:.1f} ms: "
                     f"**{many['speedup']:.2f}×** ({many['speedup_min']:.2f}–"
                     f"{many['speedup_max']:.2f})")
        cells.append(f"{many['hvdlite_grouped_ms']:.1f} ms: {many['grouped_speedup']:.2f}× "
                     f"({many['grouped_speedup_min']:.2f}–{many['grouped_speedup_max']:.2f})"
                     if "hvdlite_grouped_ms" in many else "—")
        limit = f"{many['limit']:.2f}× ({many['raw_one_buffer_ms']:.1f} ms)" \
            if "limit" in many else "—"
        if "limit_copies" in many:
            limit += (f" ({many['limit_copies']:.2f}×, "
                      f"{many['raw_one_buffer_copies_ms']:.1f} ms)")
        cells.append(limit)
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def _paired(r: dict) -> str:
    """The cells of one row that bench_util.alternate timed: hvdlite µs, the peer, its µs, and
    the ratio with the spread of the per-round ratios."""
    return (f"{r['hvdlite_us']:.1f} | {r['peer']} | {r['peer_us']:.1f} | **{r['ratio']:.2f}** "
            f"({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) |")


def steady_paths(root: str) -> list[str]:
    out = ["| call, 2 ranks | transport | hvdlite µs | peer | peer µs | hvdlite/peer (spread) |",
           "|---|---|---|---|---|---|"]
    for kind in ("gloo", "mpi"):
        d = _load(root, f"steady_paths_{kind}")
        if d is None:
            continue
        for r in d["rows"].values():
            out.append(f"| {r['what']} | {d['transport']} | " + _paired(r))
    return out if len(out) > 2 else []


def tf_eager_ops(root: str) -> list[str]:
    """benchmarks/tf_eager_ops.py: TensorFlow's eager collectives against the torch frontend."""
    d = _load(root, "tf_eager_ops")
    if d is None:
        return []
    out = [f"| eager call, {d['ranks']} ranks | hvdlite.tensorflow µs | peer | peer µs | "
           "ratio (spread) |", "|---|---|---|---|---|"]
    return out + [f"| {r['what']} | " + _paired(r) for r in d["rows"].values()]


def cold_cache(root: str) -> list[str]:
    d = _load(root, "cold_cache_mpi")
    if d is None:
        return []
    m, r = d["median_us"], d["rounds"]
    out = [f"| {d['bytes'] // 1024} KiB allreduce, {d['ranks']} ranks, {d['transport']} | "
           f"warm µs (rounds) | after streaming {d['stream_mib']} MiB µs (rounds) | slower by |",
           "|---|---|---|---|"]
    for who in ("hvdlite", "raw"):
        w, c = r[f"{who}_warm"], r[f"{who}_cold"]
        out.append(f"| {who} | {m[who + '_warm']:.1f} ({min(w):.1f}–{max(w):.1f}) | "
                   f"{m[who + '_cold']:.1f} ({min(c):.1f}–{max(c):.1f}) | "
                   f"{m[who + '_cold'] / m[who + '_warm']:.2f}× |")
    warm = m["hvdlite_warm"] - m["raw_warm"]
    cold = m["hvdlite_cold"] - m["raw_cold"]
    out += ["", f"hvdlite's cost above the raw call: {warm:.0f} µs warm, {cold:.0f} µs after "
            f"streaming ({cold / warm:.2f}×)."]
    return out


def control_plane(root: str) -> list[str]:
    d = _load(root, "control_plane")
    if d is None:
        return []
    out = [f"(one step of {d['tensors']} cached tensors per cycle; one hop = "
           f"{d['hop_us']:.1f} µs, measured)", "",
           "| ranks | coordinator: frames at rank 0 | work µs | latency µs | steady: frames per "
           "rank | work µs | latency µs |", "|---|---|---|---|---|---|---|"]
    for row in d["rows"]:
        c, s = row["coordinator"], row["steady"]
        out.append(f"| {row['ranks']} | {c['frames']} | {c['work_us']['median']:.0f} "
                   f"({c['work_us']['min']:.0f}–{c['work_us']['max']:.0f}) | "
                   f"{c['latency_us']['median']:.0f} | {s['frames']} | "
                   f"{s['work_us']['median']:.0f} ({s['work_us']['min']:.0f}–"
                   f"{s['work_us']['max']:.0f}) | {s['latency_us']['median']:.0f} |")
    first, last = d["rows"][0], d["rows"][-1]
    grow_c = last["coordinator"]["work_us"]["median"] / first["coordinator"]["work_us"]["median"]
    grow_s = last["steady"]["work_us"]["median"] / first["steady"]["work_us"]["median"]
    out += ["", f"From {first['ranks']} to {last['ranks']} ranks the busiest rank's work per "
            f"cycle grows ×{grow_c:.1f} on the coordinator and ×{grow_s:.1f} in the steady state."]
    return out


def one_rank(root: str) -> list[str]:
    on, off = _load(root, "one_rank"), _load(root, "one_rank_coordinator")
    if on is None:
        return []
    out = ["| what | hvdlite µs | gloo (1 rank) µs | hvdlite/gloo (spread) |"
           + (" every call through the coordinator µs |" if off else ""),
           "|---|---|---|---|" + ("---|" if off else "")]
    for i, r in enumerate(on["rows"]):
        row = (f"| {r['what']} | {r['hvdlite_us']:.1f} | {r['raw_us']:.1f} | "
               f"**{r['ratio']:.2f}** ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) |")
        if off:
            row += f" {off['rows'][i]['hvdlite_us']:.1f} |"
        out.append(row)
    return out


def job_start(root: str) -> list[str]:
    d = _load(root, "job_start")
    if d is None:
        return []
    n = d["np"]
    sec, labels = d["seconds"], (
        ("hvdlite", "`hvdlite-run` (rank 0 serves the store)"),
        ("hvdlite_store_on_driver",
         "`hvdlite-run`, `HVDLITE_STORE_ON_DRIVER=1` (the launcher serves it)"),
        ("hvdlite_elastic", f"`hvdlite-run`, elastic (`--min-np {n} --max-np {n} -H "
                            f"localhost:{n}`; the driver serves it)"),
        ("torchrun", "`torchrun --standalone` (peer)"),
        ("floor", f"floor: {n} × `import torch` at once"))
    out = [f"| {n} ranks: launch, join, one allreduce, shut down | s (spread) |",
           "|---|---|"]
    for key, label in labels:
        if key not in sec:          # (runs before the elastic row was timed)
            continue
        r = sec[key]
        out.append(f"| {label} | {r['median']:.2f} ({r['min']:.2f}–{r['max']:.2f}) |")
    rounds = d["ratio_per_round_vs_torchrun"]
    out += ["", f"hvdlite / torchrun **{d['ratio_vs_torchrun']:.2f}** ({min(rounds):.2f}–"
            f"{max(rounds):.2f}); hvdlite / the store on the driver "
            f"{d['ratio_vs_store_on_driver']:.2f}; hvdlite above the floor "
            f"{sec['hvdlite']['median'] - sec['floor']['median']:.2f} s."]
    return out


def tf_first_step(root: str) -> list[str]:
    """benchmarks/tf_first_step.py: a custom loop's first (traced) step and its steady step."""
    d = _load(root, "tf_first_step")
    if d is None:
        return []
    sec, per = d["seconds"], d["ratio_per_round"]
    out = [f"| TensorFlow custom loop, {d['np']} ranks, {d['rounds']} jobs | plain "
           "`tf.GradientTape` (peer) | `hvd.DistributedGradientTape` | hvdlite / plain (spread) |",
           "|---|---|---|---|"]
    for w, label, unit, scale in (("first", "first call (traces the step)", "s", 1.0),
                                  ("steady", "a later step", "ms", 1e3)):
        p, h = sec[f"plain_{w}"], sec[f"hvdlite_{w}"]
        out.append(f"| {label} | {p['median'] * scale:.3f} {unit} | {h['median'] * scale:.3f} "
                   f"{unit} ({h['min'] * scale:.3f}–{h['max'] * scale:.3f}) | "
                   f"{statistics.median(per[w]):.2f} ({min(per[w]):.2f}–{max(per[w]):.2f}) |")
    return out


def zero(root: str) -> list[str]:
    out = ["| transformer + Adam, max over ranks | ranks | state B/rank | × stage 0 | "
           "params+grads+state B/rank | ms/step (spread) | × stage 0 |",
           "|---|---|---|---|---|---|---|"]
    for n in (2, 4):
        d = _load(root, f"zero_np{n}")
        if d is None:
            continue
        for name, r in d["results"].items():
            ts = [t * 1e3 for t in r["times_s"]]
            out.append(f"| {name} | {n} | {r['state_bytes_max']:,} | {r['state_ratio']:.3f} | "
                       f"{r['training_state_bytes_max']:,} | {r['median_ms']:.1f} "
                       f"({min(ts):.1f}–{max(ts):.1f}) | {r['time_ratio']:.2f} |")
    return out


def compression(root: str) -> list[str]:
    d = _load(root, "compression_np2")
    if d is None:
        return []
    base = d["results"]["hvdlite none"]["wire_bytes"]
    out = ["| MLP 3.7 M params, 2 ranks | bytes sent/rank/step | × fewer | ms/step (spread) | "
           "× none |", "|---|---|---|---|---|"]
    for name, r in d["results"].items():
        ts = [t * 1e3 for t in r["times_s"]]
        out.append(f"| {name} | {int(r['wire_bytes']):,} | {base / r['wire_bytes']:.1f} | "
                   f"{r['median_ms']:.2f} ({min(ts):.2f}–{max(ts):.2f}) | "
                   f"{r['time_ratio']:.2f} |")
    loss = d.get("loss", {})
    if loss:
        ref = loss.get("none")
        out += ["", "Final loss after 200 full-batch steps: " + ", ".join(
            f"{k} {v:.4f} ({(v / ref - 1) * 100:+.2f} %)" for k, v in loss.items())]
    return out


def keras(root: str) -> list[str]:
    d = _load(root, "keras_fit")
    if d is None:
        return []
    labels = {"keras_np2": "Keras `model.fit`, hvdlite, 2 ranks",
              "tape_np2": "`DistributedGradientTape` in `tf.function`, 2 ranks",
              "torch_np2": "torch frontend, same model shape, 2 ranks",
              "keras_np1": "Keras `model.fit`, hvdlite, 1 rank",
              "plain_1t": "one plain Keras process, 1 thread",
              "plain_2t": "one plain Keras process, 2 threads",
              "compute_np2": "2 ranks, no gradient exchange (the limit)"}
    out = ["| configuration | fit's steps | whole `fit()` call |", "|---|---|---|"]
    for key, label in labels.items():
        v = d["samples_per_s"].get(key)
        if not v:
            continue
        cell = f"{statistics.median(v):,.0f} ({min(v):,.0f}–{max(v):,.0f})"
        w = d.get("fit_samples_per_s", {}).get(key)
        wcell = f"{statistics.median(w):,.0f} ({min(w):,.0f}–{max(w):,.0f})" if w else ""
        out.append(f"| {label} | {cell} | {wcell} |")
    out.append("")
    for name, r in d["ratios"].items():
        out.append(f"* {name}: **{r['median']:.2f}** ({min(r['rounds']):.2f}–"
                   f"{max(r['rounds']):.2f})")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", nargs="?", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results"), help="the result files' folder")
    p.add_argument("--glance", action="store_true",
                   help="print only the table of the engine's targets (run_all.sh ends with it)")
    args = p.parse_args()
    root = args.root
    if args.glance:
        print("\n".join(targets(root)))
        return
    for title, fn in (("At a glance", targets),
                      ("Training step", train_step), ("Allreduce, 2 ranks", allreduce),
                      ("Steady-state paths", steady_paths),
                      ("After a large transfer", cold_cache),
                      ("Control plane", control_plane), ("One-rank job", one_rank),
                      ("Job start", job_start),
                      ("TensorFlow first step", tf_first_step),
                      ("TensorFlow eager collectives", tf_eager_ops),
                      ("ZeRO", zero),
                      ("Compression", compression), ("Keras", keras)):
        lines = fn(root)
        if lines:
            print(f"### {title}\n")
            print("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
