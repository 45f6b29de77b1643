#!/usr/bin/env bash
# The course on one GPU (written for an H200), in under 8 minutes including start-up:
#
#   1. chapter 01, gpt2 preset, bf16, eager         tokens/s, MFU, peak memory, step / bare step
#      chapter 03 on one GPU and chapter 04 under torchrun with 1 rank on NCCL, same settings
#   2. chapter 01, gpt2 preset, bf16, torch.compile  the same figures
#   3. bench/gpu_vs_cpu.py: a few bf16 steps on the GPU follow the CPU's float32 losses (rtol 2e-2)
#
#   bash bench/gpu_check.sh                 # results under $OUT, else bench/results/gpu
#
# Settings (environment): OUT, BATCH (sequences per step, 32), ITERS (30), LOG_INTERVAL (10),
# DATA_DIR (data); PRESET (gpt2) and DEVICE (cuda) exist for a dry run of the script's mechanics
# on a CPU: DEVICE=cpu PRESET=tiny ITERS=4 LOG_INTERVAL=2 bash bench/gpu_check.sh
# Every step has its own time limit; a step that fails or overruns is reported and the rest still
# run. The exit status is 0 only when every step passed.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root

OUT="${OUT:-bench/results/gpu}"
BATCH="${BATCH:-32}"
ITERS="${ITERS:-30}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
PRESET="${PRESET:-gpt2}"
DEVICE="${DEVICE:-cuda}"
DATA_DIR="${DATA_DIR:-data}"
PYTHON="${PYTHON:-python}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
failed=()

# step NAME SECONDS COMMAND...: run COMMAND under `timeout`, its output to $OUT/NAME.log and the screen
step() {
    local name="$1" limit="$2"
    shift 2
    echo "==== $name (at most ${limit}s): $*"
    local start=$SECONDS code=0
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" || code=$?  # pipefail: the command's status
    if [[ $code -ne 0 ]]; then
        [[ $code -eq 124 ]] && echo "==== $name: stopped after ${limit}s" || echo "==== $name: failed (exit status $code)"
        failed+=("$name")
    fi
    echo "==== $name: $((SECONDS - start))s"
}

{ nvidia-smi || true; "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'; } \
    > "$OUT/environment.txt" 2>&1 || true
cat "$OUT/environment.txt"

step prepare_data 60 "$PYTHON" -c "import sys; sys.path.insert(0, '.'); from common.data import prepare; prepare('shakespeare', '$DATA_DIR')"

common=(--device "$DEVICE" --dtype bfloat16 --preset "$PRESET" --batch-size "$BATCH" --iters "$ITERS" --log-interval "$LOG_INTERVAL"
        --repeats 1 --no-comm --data-dir "$DATA_DIR" --work-dir "$OUT/work" --timeout 120)
step eager 140 "$PYTHON" bench/benchmark.py "${common[@]}" --stages 01,03,04x1 --results-dir "$OUT/eager"
# compiling takes most of this step (and once more for evaluation mode at the end); no bare step here
step compile 200 "$PYTHON" bench/benchmark.py "${common[@]}" --stages 01 --compile --no-bare --results-dir "$OUT/compile"
step gpu_vs_cpu 60 "$PYTHON" bench/gpu_vs_cpu.py --preset small --steps 10 --batch-size 8 --ref-device cpu \
    --ref-dtype float32 --test-device "$DEVICE" --test-dtype bfloat16 --rtol 2e-2 --data-dir "$DATA_DIR" --out "$OUT/gpu_vs_cpu.json"

# chunked vs plain output layer + loss (common/chunked_loss.py, bench/loss_bench.py): bare steps, eager and compiled
# (tokens/s, peak memory), then the loss alone at the model's width by chunk size; table in $OUT/loss_chunked.md
step loss_chunked 300 "$PYTHON" bench/loss_bench.py check --configs "$PRESET" --device "$DEVICE" --dtype bfloat16 \
    --batch-size "$BATCH" --iters "$ITERS" --log-interval "$LOG_INTERVAL" --repeats 1 --compile --data-dir "$DATA_DIR" \
    --work-dir "$OUT/work/loss_chunked" --timeout 140 --out "$OUT/loss_chunked.json"

"$PYTHON" bench/gpu_summary.py "$OUT" | tee "$OUT/summary.md"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "failed steps: ${failed[*]}"
    exit 1
fi
echo "all steps passed; results in $OUT"
