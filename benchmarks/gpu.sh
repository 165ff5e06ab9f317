#!/usr/bin/env bash
# GPU benchmark in one command: training step vs DDP on NCCL (ResNet-style CNN, transformer,
# synthetic data) and NCCL allreduce bus bandwidth through hvdlite vs raw torch.distributed,
# 1 MiB - 1 GiB. Usage: bash benchmarks/gpu.sh [results dir]
#
# Ranks: one per GPU. With one GPU: 1 rank (against DDP on NCCL), then 2 ranks sharing it; NCCL
# refuses two ranks on one GPU, so there hvdlite stages CUDA tensors through host memory and the
# peer is DDP / torch.distributed on gloo with the same CUDA tensors. Last, the same 2 ranks with
# an NCCL_HOSTID each, which NCCL serves as two hosts over loopback sockets: both hvdlite and the
# peer on a real two-rank NCCL communicator (fewer steps, up to 64 MiB: the GPU is time-sliced).
# Without a GPU it runs the same code on CPU/gloo with small sizes and says so.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(command -v python3); fi
fi
RUN=("$PY" -m hvdlite.runner)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ "$GPUS" -gt 0 ]; then
  echo "== $GPUS GPU(s): NCCL tests, then the benchmark"
  "$PY" -m pytest -q -rs tests/test_nccl.py || echo "NCCL tests failed (see above)"
  "${RUN[@]}" -np "$GPUS" "$PY" benchmarks/gpu.py --json "$OUT/gpu_np$GPUS.json"
  if [ "$GPUS" -eq 1 ]; then
    echo "== 2 ranks sharing GPU 0 (hvdlite stages through host memory; the peer is gloo)"
    "${RUN[@]}" -np 2 "$PY" benchmarks/gpu.py --json "$OUT/gpu_np2_shared.json"
    echo "== 2 ranks sharing GPU 0 over NCCL: each rank its own NCCL_HOSTID, so NCCL connects them"
    echo "   through its socket transport on loopback (the GPU is time-sliced between them)"
    NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}" NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}" \
      timeout "${HOSTID_TIMEOUT:-300}" "${RUN[@]}" -np 2 \
      bash -c 'NCCL_HOSTID="hvdlite-bench-rank$HOROVOD_RANK" exec "$0" "$@"' \
      "$PY" benchmarks/gpu.py --steps 3 --top-mib 64 --json "$OUT/gpu_np2_nccl_hostid.json" \
      || echo "the NCCL_HOSTID run failed or timed out (exit $?)"
  fi
else
  echo "no GPU: ran the CPU fallback (gloo, CPU tensors, small models and sizes)"
  "${RUN[@]}" -np 2 "$PY" benchmarks/gpu.py --cpu-fallback --rounds 5 --steps 3 \
      --json "$OUT/gpu_cpu_fallback.json"
  rc=$?
  echo "no GPU: ran the CPU fallback (exit $rc); GPU figures need a machine with a GPU"
  exit $rc
fi
