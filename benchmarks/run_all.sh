#!/usr/bin/env bash
# Run every benchmark (gloo through hvdlite-run, MPI through mpiexec; 2 and 4 ranks) and write
# JSON and PNG results under benchmarks/results/. Usage: bash benchmarks/run_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
OUT=benchmarks/results
mkdir -p "$OUT"
.venv/bin/pip install -q --disable-pip-version-check matplotlib mpi4py mpich >/dev/null 2>&1 || true
for np in 2 4; do
  echo "== training step, $np ranks, gloo"
  HOROVOD_CPU_OPERATIONS=gloo .venv/bin/hvdlite-run -np "$np" "$PY" benchmarks/train_step.py \
      --json "$OUT/train_step_gloo_np$np.json" --plot "$OUT/train_step_gloo_np$np.png"
  if [ -x .venv/bin/mpiexec ]; then
    echo "== training step, $np ranks, mpi"
    .venv/bin/mpiexec -n "$np" "$PY" benchmarks/train_step.py \
        --json "$OUT/train_step_mpi_np$np.json" --plot "$OUT/train_step_mpi_np$np.png"
  fi
done
echo "== allreduce, 2 ranks, gloo"
.venv/bin/hvdlite-run -np 2 "$PY" benchmarks/allreduce.py \
    --json "$OUT/allreduce_gloo.json" --plot "$OUT/allreduce_gloo.png"
echo "== allreduce, 2 ranks, gloo with the shared-memory path off (gloo's own TCP data path)"
HVDLITE_SHM=0 .venv/bin/hvdlite-run -np 2 "$PY" benchmarks/allreduce.py \
    --json "$OUT/allreduce_gloo_tcp.json" --plot "$OUT/allreduce_gloo_tcp.png"
echo "== steady-state paths (grouped, barrier, unnamed), 2 ranks, gloo"
.venv/bin/hvdlite-run -np 2 "$PY" benchmarks/steady_paths.py --json "$OUT/steady_paths_gloo.json"
if [ -x .venv/bin/mpiexec ]; then
  echo "== allreduce, 2 ranks, mpi"
  .venv/bin/mpiexec -n 2 "$PY" benchmarks/allreduce.py \
      --json "$OUT/allreduce_mpi.json" --plot "$OUT/allreduce_mpi.png"
  echo "== steady-state paths (grouped, barrier, unnamed), 2 ranks, mpi"
  .venv/bin/mpiexec -n 2 "$PY" benchmarks/steady_paths.py --json "$OUT/steady_paths_mpi.json"
  echo "== a small allreduce with warm caches and after streaming 64 MiB, 2 ranks, mpi"
  .venv/bin/mpiexec -n 2 "$PY" benchmarks/cold_cache.py --json "$OUT/cold_cache_mpi.json"
fi
for np in 1 2 4; do
  echo "== ZeRO sharding (memory, step time), $np rank(s), gloo"
  .venv/bin/hvdlite-run -np "$np" "$PY" benchmarks/zero.py --json "$OUT/zero_np$np.json"
done
for np in 2 4; do
  echo "== fully_shard against torch's fully_shard and DDP (memory, step time), $np ranks, gloo"
  .venv/bin/hvdlite-run -np "$np" "$PY" benchmarks/fsdp.py --json "$OUT/fsdp_np$np.json"
done
echo "== gradient compression (bytes, step time, final loss), 2 ranks, gloo"
.venv/bin/hvdlite-run -np 2 "$PY" benchmarks/compression.py --json "$OUT/compression_np2.json"
echo "== Keras model.fit / DistributedGradientTape / torch frontend / one plain process"
"$PY" benchmarks/keras_fit.py --json "$OUT/keras_fit.json"
echo "== a TensorFlow custom loop's first (traced) step: DistributedGradientTape against a plain tape"
"$PY" benchmarks/tf_first_step.py --json "$OUT/tf_first_step.json"
echo "== TensorFlow eager collectives against the torch frontend's, 2 ranks, gloo"
.venv/bin/hvdlite-run -np 2 "$PY" benchmarks/tf_eager_ops.py --json "$OUT/tf_eager_ops.json"
echo "== control plane, simulated 2-512 ranks"
"$PY" benchmarks/control_plane.py --json "$OUT/control_plane.json"
echo "== a one-rank job: steady state on one member, and every call through the coordinator"
"$PY" benchmarks/one_rank.py --json "$OUT/one_rank.json"
HVDLITE_STEADY_STATE=0 "$PY" benchmarks/one_rank.py --json "$OUT/one_rank_coordinator.json"
echo "== job start: hvdlite-run against torchrun, 2 ranks (started from here, not under a launcher)"
"$PY" benchmarks/job_start.py --np 2 --json "$OUT/job_start.json"
echo "== kill loop (short): elastic job under failures against torchrun; async checkpoint cost"
"$PY" benchmarks/kill_loop.py --short --json "$OUT/kill_loop_short.json"
"$PY" benchmarks/kill_loop.py --save-cost --json "$OUT/checkpoint_save_cost.json"
if [ "$(id -u)" = 0 ]; then
  echo "== a namespaced cluster on 1 Gbit/s links: cross-host allreduce, hierarchical (root)"
  "$PY" benchmarks/cluster.py --json "$OUT/cluster.json"
else
  echo "== skipped benchmarks/cluster.py: network namespaces need root"
fi
echo "== GPU (NCCL), or its CPU fallback without a GPU"
PYTHON="$PY" bash benchmarks/gpu.sh "$OUT"
echo "== the engine's targets, at a glance (python benchmarks/report.py prints every table)"
"$PY" benchmarks/report.py "$OUT" --glance
