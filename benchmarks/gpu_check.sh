#!/usr/bin/env bash
# bash benchmarks/gpu_check.sh [--smoke] [OUT_DIR]
# The MLA-kernel GPU check (docs/kernels.md, "GPU check") as one prepared call of at most 8 minutes on one H200:
#   1. the kernel tests natively on CUDA (tests/kernels/, gpu-marked ones included),
#   2. benchmarks/kernels_bench.py: prefill fwd/bwd TFLOP/s against torch SDPA, decode GB/s against HBM, and the rows
#      for mha2mla/kernels/speed_table.py (what recover's attention auto reads),
#   3. recover's training tokens/s with SDPA and with the Triton kernel in bf16 at two widths: SmolLM2-135M widths
#      (every layer trained, 16 x 1024) and Llama-3.2-1B widths (LoRA, 8 x 2048), random weights converted at
#      12.5% / 25% KV, the same text, seed and steps for both attentions (so the loss curves compare too),
#   4. recovery's peak GPU memory beside its --dry-run estimate: Llama-3.2-1B widths with a 128K vocabulary, LoRA + KL
#      to the source, 8 x 4096 tokens per step,
#   5. the default conversion at Llama-3-8B widths on CUDA against its floor, phase by phase
#      (benchmarks/convert_cost.py, 2 layers: what dominates on a GPU).
# Each phase gets at most its own limit and what is left of the 470 s budget (a phase that no longer fits is
# skipped and says so). Full logs land in OUT_DIR (default $OUT, else ./gpu_check_out), 8 files at most, and the
# suites' records in OUT_DIR/records/ (append them to benchmarks/records/ to keep them); one summary table last.
# --smoke (or MHA2MLA_GPU_CHECK_SMOKE=1): the same phases on the CPU with tiny shapes, the kernels in Triton's
# interpreter, to check the script end to end where no GPU is at hand; its figures mean nothing.
# GPU_CHECK_PHASES="4 5" runs only those phases (a rerun of what failed).
# On the GPU machine pydantic is missing: carry wheels in .whl/ (docs/kernels.md); they are installed into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE="${MHA2MLA_GPU_CHECK_SMOKE:-0}"
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
T0=$(date +%s)
BUDGET=470  # seconds: 8 minutes less a margin for the summary
phase() { echo "== [+$(( $(date +%s) - T0 ))s] $*"; }
PHASES=" ${GPU_CHECK_PHASES:-1 2 3 4 5} "  # a rerun may name only the phases it needs, e.g. GPU_CHECK_PHASES="4 5"
wants() { [[ "$PHASES" == *" $1 "* ]]; }
# seconds a phase may take: its own limit, or what is left of the budget (0: skip it)
limit() { local left=$(( BUDGET - ($(date +%s) - T0) )); [ "$left" -lt 15 ] && echo 0 || echo $(( $1 < left ? $1 : left )); }
# within SECONDS COMMAND...: COMMAND under its limit (limit above), or skipped with exit 124 when no time is left
within() { local t; t=$(limit "$1"); shift; [ "$t" -gt 0 ] || { echo "skipped: out of time"; return 124; }; timeout "$t" "$@"; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo '{"error": "installing the carried wheels failed"}'; exit 3; }
fi
export PYTHONPATH="$PWD:$PWD/tests:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=""
for candidate in "${PYTHON:-}" python3 .venv/bin/python python; do
  [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
  if [ "$SMOKE" = 1 ]; then check="import torch, triton, pydantic"; else check="import torch, triton, pydantic; assert torch.cuda.is_available()"; fi
  if "$candidate" -c "$check" 2>/dev/null; then PY="$candidate"; break; fi
done
[ -n "$PY" ] || { echo '{"error": "no Python with torch, triton and pydantic (and CUDA unless --smoke); set PYTHON=..."}'; exit 2; }

if [ "$SMOKE" = 1 ]; then
  export TRITON_INTERPRET=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
  TESTS=(-m "not slow and not gpu" tests/kernels/test_dtypes.py tests/kernels/test_tuning.py tests/kernels/test_speed_table.py)
  BENCH=(--smoke); DEVICE=cpu; VOCAB=512; BUDGET=900  # a shared CPU: the interpreter is slow, the budget larger
  WIDTHS=("w135 64 2 4 2 128 0.25 full 2 32 4" "w1b 96 2 6 2 192 0.25 lora 2 32 4")  # name hidden layers heads kv mlp budget train batch seq steps
  MEMORY="m1b 96 2 6 2 192 1024 0.25 2 64 2"  # name hidden layers heads kv mlp vocab budget batch seq steps
  COST=(--model "$WORK/src_tiny" --calib-samples 8)
else
  unset TRITON_INTERPRET
  TESTS=(-m "not slow" --ignore tests/kernels/test_compile.py tests/kernels)  # compiling is checked on the CPU
  BENCH=(); DEVICE=cuda; VOCAB=49152
  WIDTHS=("w135 576 30 9 3 1536 0.125 full 16 1024 20" "w1b 2048 16 32 8 8192 0.25 lora 8 2048 12")
  MEMORY="m1b 2048 16 32 8 8192 128256 0.25 8 4096 4"
  COST=(--shape llama3-8b --layers 2 --calib-device cuda)
fi

{ [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null; echo "smoke $SMOKE"; } > "$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"

# build_source SECONDS NAME HIDDEN LAYERS HEADS KV MLP VOCAB: a random-weight Llama-family source in $WORK/src_NAME
build_source() {
  [ "$1" -gt 0 ] || { echo "$2: skipped, out of time"; return 124; }
  timeout "$1" "$PY" - "$WORK/src_$2" "${@:3}" "$DEVICE" <<'EOF'
# a random-weight Llama-family source at these widths, with a byte-level BPE of the bundled text (benchmarks/scale.py)
import sys
sys.path.insert(0, "benchmarks")
import torch
from scale import build_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

out, (hidden, layers, heads, kv, mlp, vocab), device = sys.argv[1], map(int, sys.argv[2:8]), sys.argv[8]
config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                     intermediate_size=mlp, vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=True,
                     bos_token_id=0, eos_token_id=0)
torch.manual_seed(0)
with torch.device(device):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(out)
build_tokenizer(vocab).save_pretrained(out)
print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
EOF
}

# the text the recovery phases train on: the bundled calibration sample, 8 times over
cat "$("$PY" -c 'from mha2mla.convert.calibration.data import bundled_sample_path as p; print(p())')" > "$WORK/one.txt"
for _ in 1 2 3 4 5 6 7 8; do cat "$WORK/one.txt"; done > "$WORK/text.txt"

if wants 1; then
phase "1 kernel tests"
t=$(limit 110)
if [ "$t" -gt 0 ]; then timeout "$t" "$PY" -m pytest -q -p no:cacheprovider -rfE "${TESTS[@]}" > "$OUT_DIR/kernel_tests.txt" 2>&1
  echo "kernel tests rc $?" | tee -a "$OUT_DIR/kernel_tests.txt"; else echo "skipped: out of time" > "$OUT_DIR/kernel_tests.txt"; fi

fi

if wants 2; then
phase "2 kernels bench"
t=$(limit 100)
if [ "$t" -gt 0 ]; then timeout "$t" "$PY" benchmarks/kernels_bench.py "${BENCH[@]}" --json "$WORK/kernels_bench.json" \
  --records "$OUT_DIR/records/kernels_bench.jsonl" \
  > "$OUT_DIR/kernels_bench.txt" 2>&1; echo "bench rc $?" | tee -a "$OUT_DIR/kernels_bench.txt"
else echo "skipped: out of time" > "$OUT_DIR/kernels_bench.txt"; fi

fi

if wants 3; then
phase "3 recover tokens/s: sdpa vs mha2mla_triton, bf16"
: > "$OUT_DIR/recover.txt"; : > "$OUT_DIR/recover_logs.jsonl"
for spec in "${WIDTHS[@]}"; do
  read -r name hidden layers heads kv mlp budget train batch seq steps <<< "$spec"
  t=$(limit 60)
  [ "$t" -gt 0 ] || { echo "$name: skipped, out of time" | tee -a "$OUT_DIR/recover.txt"; continue; }
  build_source "$t" "$name" "$hidden" "$layers" "$heads" "$kv" "$mlp" "$VOCAB" >> "$OUT_DIR/recover.txt" 2>&1
  t=$(limit 60)
  [ "$t" -gt 0 ] && timeout "$t" "$PY" -m mha2mla.cli.main convert "$WORK/src_$name" "$WORK/mla_$name" --calib none \
    --kv-budget "$budget" >> "$OUT_DIR/recover.txt" 2>&1 || { echo "$name: convert failed" | tee -a "$OUT_DIR/recover.txt"; continue; }
  layers_flag=$([ "$train" = full ] && echo --full-layers || echo --no-full-layers)
  for impl in sdpa mha2mla_triton; do
    t=$(limit 75)
    [ "$t" -gt 0 ] || { echo "$name $impl: skipped, out of time" | tee -a "$OUT_DIR/recover.txt"; continue; }
    echo "== $name $impl" >> "$OUT_DIR/recover.txt"
    timeout "$t" "$PY" -m mha2mla.cli.main recover "$WORK/mla_$name" --data "$WORK/text.txt" --out "$WORK/r_${name}_$impl" \
      $layers_flag --distill-weight 0 --max-steps "$steps" --batch-size "$batch" --seq-len "$seq" \
      --compute-dtype bfloat16 --attn-implementation "$impl" --save-every 0 --eval-every 0 --eval-sequences 0 \
      --no-progress >> "$OUT_DIR/recover.txt" 2>&1
    echo "$name $impl rc $?" | tee -a "$OUT_DIR/recover.txt"
    [ -f "$WORK/r_${name}_$impl/train_log.jsonl" ] && "$PY" -c "import json, sys
for line in open(sys.argv[1]):
    if line.strip(): print(json.dumps({'width': sys.argv[2], 'attention': sys.argv[3], **json.loads(line)}))" \
      "$WORK/r_${name}_$impl/train_log.jsonl" "$name" "$impl" >> "$OUT_DIR/recover_logs.jsonl"
    rm -rf "$WORK/r_${name}_$impl"
  done
  rm -rf "$WORK/src_$name" "$WORK/mla_$name"
done

fi

if wants 4; then
phase "4 recovery memory: 128K vocabulary, LoRA + KL"
read -r name hidden layers heads kv mlp vocab budget batch seq steps <<< "$MEMORY"
t=$(limit 60)
if [ "$t" -gt 0 ] && build_source "$t" "$name" "$hidden" "$layers" "$heads" "$kv" "$mlp" "$vocab" >> "$OUT_DIR/recover.txt" 2>&1 \
  && within 60 "$PY" -m mha2mla.cli.main convert "$WORK/src_$name" "$WORK/mla_$name" --calib none \
    --kv-budget "$budget" >> "$OUT_DIR/recover.txt" 2>&1; then
  ARGS=("$WORK/mla_$name" --data "$WORK/text.txt" --out "$WORK/r_$name" --no-full-layers --teacher "$WORK/src_$name"
        --distill-weight 0.5 --batch-size "$batch" --seq-len "$seq" --compute-dtype bfloat16 --save-every 0
        --eval-every 0 --eval-sequences 0 --no-progress --max-steps "$steps")
  estimate=$(within 60 "$PY" -m mha2mla.cli.main recover "${ARGS[@]}" --dry-run 2>>"$OUT_DIR/recover.txt" \
    | tee -a "$OUT_DIR/recover.txt" | awk '$1 == "total" {print $2}')
  within 90 "$PY" -m mha2mla.cli.main recover "${ARGS[@]}" >> "$OUT_DIR/recover.txt" 2>&1
  echo "$name recover rc $?" | tee -a "$OUT_DIR/recover.txt"
  peak=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1])).get('peak_gpu_gib', 'n/a'))" \
    "$WORK/r_$name/recovery_report.json" 2>/dev/null || echo "no report")
  echo "peak memory $name vocab $vocab: estimate ${estimate:-n/a} GiB, peak ${peak} GiB ($batch x $seq tokens, LoRA + KL 0.5)" \
    | tee -a "$OUT_DIR/recover.txt"
else echo "peak memory $name: skipped or failed (out of time, or the source/convert failed)" | tee -a "$OUT_DIR/recover.txt"; fi
rm -rf "$WORK/src_$name" "$WORK/mla_$name" "$WORK/r_$name"

fi

if wants 5; then
phase "5 conversion cost: floor and phases"
t=$(limit 150)
if [ "$t" -gt 0 ]; then
  [ "$SMOKE" = 1 ] && build_source 60 tiny 64 2 4 2 128 "$VOCAB" >> "$OUT_DIR/convert_cost.txt" 2>&1
  timeout "$t" "$PY" benchmarks/convert_cost.py "${COST[@]}" --work "$WORK" \
    --records "$OUT_DIR/records/convert_cost.jsonl" >> "$OUT_DIR/convert_cost.txt" 2>&1
  echo "convert_cost rc $?" | tee -a "$OUT_DIR/convert_cost.txt"
else echo "skipped: out of time" > "$OUT_DIR/convert_cost.txt"; fi
fi
[ -f "$WORK/kernels_bench.json" ] && cp "$WORK/kernels_bench.json" "$OUT_DIR/kernels_bench.json"

phase "summary (total $(( $(date +%s) - T0 ))s)"
"$PY" - "$OUT_DIR" <<'EOF' | tee "$OUT_DIR/summary.txt"
# one table: kernel tests, kernel vs SDPA per benchmark shape, recover tokens/s and loss per attention, conversion
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
text = lambda name: (out / name).read_text() if (out / name).exists() else ""
rows = [("kernel tests", ([l for l in text("kernel_tests.txt").splitlines() if " passed" in l or " failed" in l
                           or "error" in l.lower()] or ["no result line"])[-1])]
bench = json.loads(text("kernels_bench.json") or "{}")
for r in bench.get("results", []):
    if "error" in r:
        rows.append((f"{r['kind']} {r['name']}", "error: " + r["error"][:80]))
    elif r["kind"] == "prefill":
        rows.append((f"prefill {r['name']} B{r['B']} H{r['H']} T{r['T']}", f"ours / SDPA: fwd x{r['fwd_speedup_vs_sdpa']:.2f}, "
                     f"bwd x{r['bwd_speedup_vs_sdpa']:.2f} ({r['ours_fwd_tflops']:.0f} / {r['ours_bwd_tflops']:.0f} TFLOP/s)"))
    else:
        rows.append((f"decode {r['name']} B{r['B']} H{r['H']} T{r['T']}",
                     f"{r['kernel_gb_s']:.0f} GB/s ({100 * r['kernel_fraction_of_hbm']:.0f}% of HBM)"))
logs = [json.loads(l) for l in text("recover_logs.jsonl").splitlines() if l.strip()]
for width in dict.fromkeys(r["width"] for r in logs):
    rate, losses = {}, {}
    for attention in ("sdpa", "mha2mla_triton"):
        steps = [r for r in logs if r["width"] == width and r["attention"] == attention and "tokens_per_second" in r]
        if steps:
            rate[attention] = statistics.median(r["tokens_per_second"] for r in steps[3:] or steps)
            losses[attention] = [r.get("loss") for r in steps]
            rows.append((f"recover {width} {attention}", f"{rate[attention]:.0f} tokens/s, last loss {losses[attention][-1]:.4f}"))
    if len(rate) == 2:
        gap = max(abs(a - b) for a, b in zip(*losses.values()) if a is not None and b is not None)
        rows.append((f"recover {width} kernel / sdpa", f"x{rate['mha2mla_triton'] / rate['sdpa']:.2f} tokens/s; "
                     f"largest per-step loss gap {gap:.4f}"))
for line in text("recover.txt").splitlines():
    if line.startswith("peak memory "):
        rows.append(("recover peak memory", line[len("peak memory "):]))
cost = [json.loads(l) for l in text("convert_cost.txt").splitlines() if l.startswith("{") and '"conversion"' in l]
if cost:  # the whole record: floor, phases, the ratio
    c = cost[-1]
    phases = sorted(c["conversion"]["phases"].items(), key=lambda item: -item[1])[:4]
    rows.append((f"convert {c['shape']} ({c['floor'].get('device', 'cpu')})",
                 f"floor {c['floor_seconds']:.1f} s, conversion {c['conversion']['seconds']:.1f} s = "
                 f"x{c['conversion_over_floor']:.2f}; " + ", ".join(f"{n} {v:.1f}" for n, v in phases)
                 + f"; peak GPU {c['conversion'].get('peak_gpu_gib')} GiB"))
else:
    rows.append(("convert cost", "no record (see convert_cost.txt)"))
for row in bench.get("speed_table_rows", []):
    rows.append(("speed_table.py row", row))
print("| check | result |\n|---|---|")
for name, result in rows:
    print(f"| {name} | {result} |")
EOF
# --smoke is a test of this script (CI runs it): any phase that failed or was skipped fails it
if [ "$SMOKE" = 1 ] && grep -hE " rc [1-9][0-9]*$|skipped(:|,) out of time|skipped or failed|convert failed" "$OUT_DIR"/*.txt; then
  echo "gpu_check --smoke: the phases above failed"; exit 1
fi
exit 0
