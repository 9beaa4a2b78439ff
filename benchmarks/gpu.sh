#!/usr/bin/env bash
# Benchmark suite on a CUDA machine, sized to finish in about 5 minutes on one GPU.
# First the CUDA tests (loads into CUDA tensors, sync and async saves of many small ones); then
# CUDA tensors (device->host staging included) for the model-like workloads; 1 rank (NCCL)
# and 2 ranks sharing the GPU (gloo); replay buffers stay on the host as in training.
# Writes benchmarks.md + <tag>.json under $OUT (or benchmarks/gpu-results/ without $OUT).
# Then the main job (README) on CUDA/NCCL, one rank per GPU: trained, stopped, resumed, and compared with a run
# that never stopped. BENCH=0 / MAIN=0 skip the benchmarks / the main job.
# Falls back to CPU + gloo when no GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/gpu-results}"
mkdir -p "$OUT_DIR"
DEVICE=cpu
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then DEVICE=cuda; fi
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null | tee "$OUT_DIR/gpu.txt" || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cuda ]; then  # CUDA loads and saves checked bit for bit before they are timed
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_staged_reads.py tests/test_staged_writes.py -k cuda 2>&1 | tee "$OUT_DIR/cuda-tests.txt" || true
fi
[ "${BENCH:-1}" = 1 ] && timeout "${RUN_TIMEOUT:-330}" python -m benchmarks.run --device "$DEVICE" --ranks "${RANKS:-1,2}" \
  --only "${ONLY:-large,medium,small,rb_mujoco}" --reps "${REPS:-2}" --out "$OUT_DIR" --timeout "$(( ${RUN_TIMEOUT:-330} - 30 ))" \
  2>&1 | tee "$OUT_DIR/log.txt" || true
if [ "${MAIN:-1}" = 1 ]; then  # the README's main job: NCCL, one rank per GPU, stopped and resumed, then the same
  NPROC=1                       # iterations without a stop: the final fingerprints must match bit for bit
  if [ "$DEVICE" = cuda ]; then NPROC=$(python -c "import torch; print(torch.cuda.device_count())"); fi
  ITERS="${MAIN_ITERS:-50}"; MAIN_DIR="$(mktemp -d)"
  sac() { timeout "${MAIN_TIMEOUT:-150}" torchrun --standalone --nproc-per-node "$NPROC" -m torchrl_dcp.examples.sac "$@"; }
  { sac --ckpt-dir "$MAIN_DIR/resumed" --iterations "$ITERS" &&
    sac --ckpt-dir "$MAIN_DIR/resumed" --resume --iterations "$(( ITERS + 25 ))" &&
    sac --ckpt-dir "$MAIN_DIR/straight" --iterations "$(( ITERS + 25 ))"; } 2>&1 | tee "$OUT_DIR/main-job.txt" || true
  mapfile -t F < <(grep -E "^rank [0-9]+ final " "$OUT_DIR/main-job.txt")
  resumed="$(printf '%s\n' "${F[@]:NPROC:NPROC}" | sort)"; straight="$(printf '%s\n' "${F[@]:2*NPROC:NPROC}" | sort)"
  if [ "${#F[@]}" = "$(( 3 * NPROC ))" ] && [ "$resumed" = "$straight" ]; then
    echo "main job: the resumed run's final state equals the uninterrupted run's" | tee -a "$OUT_DIR/main-job.txt"
  else
    echo "main job: the resumed run's final state DIFFERS from the uninterrupted run's (or a run failed)" | tee -a "$OUT_DIR/main-job.txt"
  fi
fi
