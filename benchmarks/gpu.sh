#!/usr/bin/env bash
# Benchmark suite on a CUDA machine, sized to finish in about 5 minutes on one GPU.
# CUDA tensors (device->host staging included) for the model-like workloads; 1 rank (NCCL)
# and 2 ranks sharing the GPU (gloo); replay buffers stay on the host as in training.
# Writes benchmarks.md + <tag>.json under $OUT (or benchmarks/gpu-results/ without $OUT).
# Falls back to CPU + gloo when no GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/gpu-results}"
mkdir -p "$OUT_DIR"
DEVICE=cpu
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then DEVICE=cuda; fi
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null | tee "$OUT_DIR/gpu.txt" || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cuda ]; then  # loads into CUDA tensors (page-locked host windows) checked before they are timed
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_staged_reads.py -k cuda 2>&1 | tee "$OUT_DIR/cuda-tests.txt" || true
fi
timeout 330 python -m benchmarks.run --device "$DEVICE" --ranks "${RANKS:-1,2}" \
  --only "${ONLY:-large,medium,small,rb_mujoco}" --reps "${REPS:-2}" --out "$OUT_DIR" --timeout 300 \
  2>&1 | tee "$OUT_DIR/log.txt"
