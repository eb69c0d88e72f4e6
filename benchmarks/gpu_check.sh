#!/usr/bin/env bash
# bash benchmarks/gpu_check.sh [OUT_DIR]
# One prepared GPU check for the MLA kernels (docs/design.md), FSDP recovery and calibration on the GPU, < 10 minutes on one H200:
#   1. the kernel tests natively on CUDA (gpu-marked tests and bf16 included),
#   2. benchmarks/kernels_bench.py: prefill fwd/bwd TFLOP/s vs torch SDPA, decode GB/s vs HBM (JSON),
#   3. `recover` under FSDP2 on CUDA (tests/train/test_recover_fsdp.py, gpu-marked: NCCL, one process per GPU, at most
#      two; the loss curve against one process, the checkpoint folder, SIGKILL + --resume auto; docs/recover.md).
#   4. calibrated conversion with --calib-device cuda at Llama-3-70B layer widths (benchmarks/scale.py, 2 layers,
#      the default 128 calibration sequences): seconds per layer, host peak RSS and the GPU's peak (peak_gpu_gib).
#   5. the compute-dtype policy on CUDA: the default calibrated conversion (reconstruction included) at Llama-3-8B
#      widths with --compute-dtype float32 and bfloat16 side by side (benchmarks/scale.py --compute-dtypes).
# Results land in OUT_DIR (default: $OUT if set, else ./gpu_check_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"

# A Python with CUDA torch, triton and this package importable.
PY=""
for candidate in "${PYTHON:-}" .venv/bin/python python3 python; do
  [ -n "$candidate" ] || continue
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch, triton; assert torch.cuda.is_available()" 2>/dev/null; then
    PY="$candidate"; break
  fi
done
if [ -z "$PY" ]; then
  echo '{"error": "no Python with CUDA torch and triton found (set PYTHON=...)"}'
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT_DIR/gpu.txt"

# -m overrides pyproject's "not slow and not gpu" so the gpu tests run too.
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/kernels/test_kernels.py 2>&1 | tee "$OUT_DIR/kernel_tests.txt"
tests_rc=${PIPESTATUS[0]}

timeout 130 "$PY" benchmarks/kernels_bench.py --json "$OUT_DIR/kernels_bench.json" 2>&1 | tee "$OUT_DIR/kernels_bench.txt"
bench_rc=${PIPESTATUS[0]}

timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m "gpu" tests/train/test_recover_fsdp.py 2>&1 | tee "$OUT_DIR/fsdp_tests.txt"
fsdp_rc=${PIPESTATUS[0]}

timeout 100 "$PY" benchmarks/scale.py --shapes llama3-70b --modes calibrated --layers 2 --calib-samples 128 \
  --calib-device cuda --max-minutes 1.5 --work "$OUT_DIR/scale" --json "$OUT_DIR/scale_cuda.json" 2>&1 | tee "$OUT_DIR/scale_cuda.txt"
scale_rc=${PIPESTATUS[0]}
rm -rf "$OUT_DIR/scale"

timeout 200 "$PY" benchmarks/scale.py --shapes llama3-8b --modes calibrated --layers 2 --calib-samples 128 \
  --calib-device cuda --compute-dtypes float32 bfloat16 --max-minutes 1.5 --work "$OUT_DIR/scale" \
  --json "$OUT_DIR/scale_compute_dtype.json" 2>&1 | tee "$OUT_DIR/scale_compute_dtype.txt"
dtype_rc=${PIPESTATUS[0]}
rm -rf "$OUT_DIR/scale"

echo "{\"tests_rc\": $tests_rc, \"bench_rc\": $bench_rc, \"fsdp_rc\": $fsdp_rc, \"scale_rc\": $scale_rc, \"dtype_rc\": $dtype_rc, \"out_dir\": \"$OUT_DIR\"}"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$fsdp_rc" -eq 0 ] && [ "$scale_rc" -eq 0 ] && [ "$dtype_rc" -eq 0 ]
