#!/usr/bin/env bash
# bash benchmarks/compute_dtype.sh [OUT_DIR]
# The compute-dtype measurements (docs/benchmarks.md, "compute dtype"), float32 and bfloat16 side by side in each
# script's own run, the scripts one after the other on an otherwise idle machine:
#   1. benchmarks/convert_phases.py: seconds per layer by phase, first 3 layers of SmolLM2 at 31.25%;
#   2. benchmarks/decode.py: the latent-cache engine's decode tokens/s at 4K context, batch 1 and 8, and its bf16
#      logits against float32 (transformers' own bf16 as the tolerance bar);
#   3. benchmarks/recover_speed.py: training tokens/s, converted and source, per compute dtype;
#   4. benchmarks/quality.py: the default conversion at 31.25%, wall time and held-out perplexity.
# Needs `make setup assets` and the weight-only 12.5% conversion at .cache/converted/smollm2-135m-kv0.125
# (mha2mla convert <the cached GGUF> .cache/converted/smollm2-135m-kv0.125 --kv-budget 0.125 --calib none).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-.cache/compute_dtype}"
mkdir -p "$OUT_DIR"
export MHA2MLA_CACHE="${MHA2MLA_CACHE:-.cache}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
PY=.venv/bin/python
$PY benchmarks/convert_phases.py --layers 3 --kv-budget 0.3125 2>"$OUT_DIR/phases.err" | tee "$OUT_DIR/phases.txt"
$PY benchmarks/decode.py --converted .cache/converted/smollm2-135m-kv0.125 --models mla-engine \
  --compute-dtypes float32 bfloat16 --contexts 4096 --batches 1,8 --warmup 2 --steps 16 --threads "$OMP_NUM_THREADS" \
  --json-out "$OUT_DIR/decode.json" 2>"$OUT_DIR/decode.err" | tee "$OUT_DIR/decode.txt"
$PY benchmarks/recover_speed.py --steps 6 --seq-len 256 --batch-size 2 --compute-dtypes float32 bfloat16 \
  2>"$OUT_DIR/recover_speed.err" | tee "$OUT_DIR/recover_speed.txt"
$PY benchmarks/quality.py --budgets 0.3125 --methods act-attention-refit-recon --profiles portable \
  --compute-dtypes float32 bfloat16 --json "$OUT_DIR/quality.json" 2>"$OUT_DIR/quality.err" | tee "$OUT_DIR/quality.txt"
