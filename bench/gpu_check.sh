#!/usr/bin/env bash
# The course on one GPU (written for an H200): one command, at most 8 minutes (TOTAL) from start to
# summary, the first CUDA initialisation and Triton's cold compile cache included.
#
#   step           limit  estimate on one H200 (how each is reckoned: bench/README.md, "The GPU check")
#   prepare_data     60s   ~10s  the Shakespeare token files
#   replica_dtype    45s   ~15s  the dtype inside DataParallel's replica threads (bfloat16 expected)
#   eager           150s   ~90s  GPT-2 124M, bf16: chapter 01, chapter 03 on one GPU, chapter 04 with
#                                1 NCCL rank: tokens/s, MFU, peak memory, step / bare step
#   gpu_vs_cpu       60s   ~25s  a few bf16 GPU steps follow the CPU's float32 losses
#   preflight        45s   ~15s  chapter 05's preflight, 1 rank on NCCL
#   from_scratch     60s   ~20s  04_ddp/train_from_scratch.py --impl all, 1 rank on CUDA (the hooks' stream paths)
#   compile         180s   ~120s chapter 01 with torch.compile: the MFU that counts (goal: 50%)
#   loss_chunked    rest   ~180s plain vs chunked loss (bench/loss_bench.py check): bare steps eager and
#                                compiled, tokens/s and peak memory, and the loss alone by chunk size
#
#   bash bench/gpu_check.sh                 # results under $OUT, else bench/results/gpu
#
# Every step gets the smaller of its limit and the time left of TOTAL, so the whole script ends in
# TOTAL seconds whatever happens; a step that fails, overruns or finds no time left is reported and
# the rest still run. Exit status 0 only when every step passed.
#
# Only small text and JSON go under $OUT. Checkpoints (1.5 GB each for GPT-2 with its AdamW state),
# metrics and probe files go under $WORK, a fresh temporary folder unless set.
#
# Settings (environment): OUT, WORK, TOTAL (480), BATCH (sequences per step, 32), ITERS (30),
# LOG_INTERVAL (10), DATA_DIR (data); PRESET (gpt2), CHECK_PRESET (small) and DEVICE (cuda) exist for
# a dry run of the mechanics on a CPU, as the tests do:
#   DEVICE=cpu PRESET=tiny CHECK_PRESET=tiny ITERS=4 LOG_INTERVAL=2 BATCH=4 bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root

OUT="${OUT:-bench/results/gpu}"
WORK="${WORK:-$(mktemp -d -t gpu_check.XXXXXX)}"
TOTAL="${TOTAL:-480}"
BATCH="${BATCH:-32}"
ITERS="${ITERS:-30}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
PRESET="${PRESET:-gpt2}"
CHECK_PRESET="${CHECK_PRESET:-small}"
DEVICE="${DEVICE:-cuda}"
DATA_DIR="${DATA_DIR:-data}"
PYTHON="${PYTHON:-python}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
failed=()
echo "results: $OUT (small files only); work files: $WORK"

# step NAME LIMIT COMMAND...: run COMMAND under `timeout` for LIMIT seconds or what is left of TOTAL,
# its output to $OUT/NAME.log and the screen
step() {
    local name="$1" limit="$2"
    shift 2
    local left=$((TOTAL - SECONDS - 5))  # 5 s kept for the summary
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        echo "==== $name: skipped, no time left of TOTAL=${TOTAL}s" | tee "$OUT/$name.log"
        failed+=("$name")
        return
    fi
    echo "==== $name (at most ${limit}s): $*"
    local start=$SECONDS code=0
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" || code=$?  # pipefail: the command's status
    if [[ $code -ne 0 ]]; then
        [[ $code -eq 124 ]] && echo "==== $name: stopped after ${limit}s" || echo "==== $name: failed (exit status $code)"
        failed+=("$name")
    fi
    echo "==== $name: $((SECONDS - start))s" | tee -a "$OUT/$name.log"
}

torchrun_one=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=1)  # one rank on this machine

{ nvidia-smi || true; "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'; } \
    > "$OUT/environment.txt" 2>&1 || true
cat "$OUT/environment.txt"

step prepare_data 60 "$PYTHON" -c "import sys; sys.path.insert(0, '.'); from common.data import prepare; prepare('shakespeare', '$DATA_DIR')"
step replica_dtype 45 "$PYTHON" bench/replica_dtype.py --device "$DEVICE" --dtype bfloat16 --out "$OUT/replica_dtype.json"

common=(--device "$DEVICE" --dtype bfloat16 --preset "$PRESET" --batch-size "$BATCH" --iters "$ITERS"
        --log-interval "$LOG_INTERVAL" --repeats 1 --no-comm --data-dir "$DATA_DIR")
# the benchmark's own per-run limit: the step's, less a margin for writing its table
step eager 150 "$PYTHON" bench/benchmark.py "${common[@]}" --setups 01,03,04x1 --timeout 130 \
    --work-dir "$WORK/eager" --results-dir "$OUT/eager"
step gpu_vs_cpu 60 "$PYTHON" bench/gpu_vs_cpu.py --preset "$CHECK_PRESET" --steps 10 --batch-size 8 --ref-device cpu \
    --ref-dtype float32 --test-device "$DEVICE" --test-dtype bfloat16 --rtol 2e-2 --data-dir "$DATA_DIR" \
    --out "$OUT/gpu_vs_cpu.json"
step preflight 45 "${torchrun_one[@]}" 05_multinode/preflight.py --sizes-mb 1,16,128 --iters 10
step from_scratch 60 "${torchrun_one[@]}" 04_ddp/train_from_scratch.py --impl all --preset "$CHECK_PRESET" --steps 12
# compiling GPT-2's forward and backward takes most of this step
step compile 180 "$PYTHON" bench/benchmark.py "${common[@]}" --setups 01 --compile --no-bare --timeout 170 \
    --work-dir "$WORK/compile" --results-dir "$OUT/compile"
# chunked vs plain output layer + loss (common/chunked_loss.py, bench/loss_bench.py): bare steps, eager and
# compiled (tokens/s, peak memory), then the loss alone by chunk size; it gets what is left of TOTAL
left=$((TOTAL - SECONDS - 15))
step loss_chunked "$left" "$PYTHON" bench/loss_bench.py check --configs "$PRESET" --device "$DEVICE" --dtype bfloat16 \
    --batch-size "$BATCH" --iters "$ITERS" --log-interval "$LOG_INTERVAL" --repeats 1 --compile --data-dir "$DATA_DIR" \
    --work-dir "$WORK/loss_chunked" --timeout $((left > 30 ? left / 3 : 10)) --out "$OUT/loss_chunked.json"

"$PYTHON" bench/gpu_summary.py "$OUT" | tee "$OUT/summary.md"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "failed steps: ${failed[*]}"
    exit 1
fi
echo "all steps passed in ${SECONDS}s; results in $OUT"
