#!/usr/bin/env bash
# Two "nodes" on one machine: two torchrun invocations that meet over 127.0.0.1, exactly as two
# machines meet over the network, each starting NPROC_PER_NODE training processes on the CPU.
# For a reader without a cluster: watch the ranks, node ranks and the per-node data preparation.
#
#   bash 05_multinode/simulate_two_nodes.sh                        # 2 nodes x 2 processes, tiny model
#   NPROC_PER_NODE=1 bash 05_multinode/simulate_two_nodes.sh --max-iters 300
#   RDZV=c10d bash 05_multinode/simulate_two_nodes.sh              # elastic rendezvous instead of static
#   SHARED_FS=1 bash 05_multinode/simulate_two_nodes.sh            # both nodes share one data folder
#   RDZV=c10d SCRIPT=06_fault_tolerance/train.py MAX_RESTARTS=1 bash 05_multinode/simulate_two_nodes.sh
#                                                                  # chapter 06: then kill -9 a rank
#   sudo MACHINES=course bash 05_multinode/simulate_two_nodes.sh   # across two machines of their own
#
# With MACHINES (the machines that `sudo bash 05_multinode/machines.sh up` made), node I runs on
# machine I, with its own network stack and address, and the nodes meet at machine 0's address
# instead of 127.0.0.1, as real machines do.
#
# Each node runs the chapter's own recipe (launch_static.sh or launch_c10d.sh). Arguments go to
# train.py after these defaults, so they override them.
#
# Settings (environment variables, with defaults):
#   NPROC_PER_NODE   processes per simulated node (2)
#   RDZV             static or c10d (static)
#   PORT             the meeting port on 127.0.0.1 (a free one)
#   SCRIPT           the program every node starts (05_multinode/train.py)
#   RUN_DIR          where logs, metrics.jsonl, ckpt.pt and the nodes' data folders go
#                    (out/<the script's chapter>/two_nodes)
#   SHARED_FS        1: one data folder for both nodes and --shared-fs (0: a folder per node,
#                    as node-local disks would be)
#   MAX_RESTARTS     how often torchrun restarts the processes after one fails (0; chapter 06)
#   MACHINES         run node I on machine I of this set of machines.sh (its --prefix, e.g.
#                    course); needs root. Unset: both nodes on this machine, over 127.0.0.1
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root

NPROC_PER_NODE="${NPROC_PER_NODE:-2}"
RDZV="${RDZV:-static}"
PYTHON="${PYTHON:-python}"
PORT="${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
SCRIPT="${SCRIPT:-05_multinode/train.py}"
RUN_DIR="${RUN_DIR:-out/$(basename "$(dirname "$SCRIPT")")/two_nodes}"
SHARED_FS="${SHARED_FS:-0}"
MACHINES="${MACHINES:-}"
address=127.0.0.1  # where the nodes meet: node 0's address
# What starts a node's recipe on its machine, and what makes the run's folder and logs: here `env`,
# which just runs the command, as this script's user. (Never an empty list: bash 3.2, macOS's,
# calls "${list[@]}" of an empty list unbound under set -u.)
on_node=(env)
export SAME_MACHINE=1  # the recipes' network check: both nodes on this machine, loopback and all
as_user=(env)
if [[ -n "$MACHINES" ]]; then
    address=$(bash 05_multinode/machines.sh address --prefix "$MACHINES" 0)
    SAME_MACHINE=0
    # under sudo the nodes run as the user who ran it (machines.sh run): the folder is theirs too
    if [[ -n "${SUDO_UID:-}" && "$SUDO_UID" != 0 ]]; then
        as_user=(setpriv --reuid="$SUDO_UID" --regid="$SUDO_GID" --init-groups)
    fi
fi
# a short CPU run of the tiny model; the processes share this machine's cores, one thread each
DEFAULTS=(--preset tiny --max-iters 200 --eval-interval 50 --log-interval 10 --device cpu --dtype float32)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

"${as_user[@]}" mkdir -p "$RUN_DIR"
"${as_user[@]}" touch "$RUN_DIR/node0.log" "$RUN_DIR/node1.log"
# One simulation per run folder, and never over another run: the node logs below would be the
# first files lost. (train.py's rank 0 also refuses and locks the folder, but only after both
# nodes have started and their logs have been opened.)
# A lock on node 0's log (train.py's rank 0 locks the folder itself), taken by Python: the lock
# belongs to the open log, which this script keeps open, so it holds until the script ends. Python
# has it everywhere; the flock command is Linux's only.
exec 9>>"$RUN_DIR/node0.log"
if ! "$PYTHON" -c 'import fcntl; fcntl.flock(9, fcntl.LOCK_EX | fcntl.LOCK_NB)' 2> /dev/null; then
    echo "error: $RUN_DIR is in use by another simulation that is still going; wait for it, or set RUN_DIR" >&2
    exit 2
fi
resuming=0
for arg in "$@"; do [[ "$arg" == --resume ]] && resuming=1; done
if [[ $resuming == 0 && ( -e "$RUN_DIR/ckpt.pt" || -s "$RUN_DIR/metrics.jsonl" ) ]]; then
    echo "error: $RUN_DIR already holds a run (its ckpt.pt / metrics.jsonl); continue it with --resume," \
         "start a new one with RUN_DIR=another/folder, or delete $RUN_DIR first" >&2
    exit 2
fi
pids=()
log_lines=()  # the node logs are appended to (a --resume continues them): follow only what is new
for NODE in 0 1; do
    "${as_user[@]}" touch "$RUN_DIR/node$NODE.log"
    log_lines+=("$(wc -l < "$RUN_DIR/node$NODE.log")")
done
for NODE in 0 1; do
    if [[ "$SHARED_FS" == 1 ]]; then
        data=(--data-dir "$RUN_DIR/data" --shared-fs)
    else
        data=(--data-dir "$RUN_DIR/node$NODE/data")  # this "node's" local disk
    fi
    args=("${DEFAULTS[@]}" --out-dir "$RUN_DIR" "${data[@]}" "$@")
    if [[ -n "$MACHINES" ]]; then
        on_node=(bash 05_multinode/machines.sh run --prefix "$MACHINES" "$NODE")
    fi
    if [[ "$RDZV" == c10d ]]; then
        NNODES=2 NPROC_PER_NODE="$NPROC_PER_NODE" RDZV_ENDPOINT="$address:$PORT" RDZV_ID="two-nodes-$PORT" \
            MAX_RESTARTS="${MAX_RESTARTS:-0}" SCRIPT="$SCRIPT" "${on_node[@]}" bash 05_multinode/launch_c10d.sh "${args[@]}" >> "$RUN_DIR/node$NODE.log" 2>&1 &
    elif [[ "$RDZV" == static ]]; then
        NNODES=2 NODE_RANK="$NODE" NPROC_PER_NODE="$NPROC_PER_NODE" MASTER_ADDR="$address" MASTER_PORT="$PORT" \
            MAX_RESTARTS="${MAX_RESTARTS:-0}" SCRIPT="$SCRIPT" "${on_node[@]}" bash 05_multinode/launch_static.sh "${args[@]}" >> "$RUN_DIR/node$NODE.log" 2>&1 &
    else
        echo "error: RDZV must be static or c10d, not '$RDZV'" >&2
        exit 2
    fi
    pids+=($!)
done
# a background job ignores Ctrl-C in a script: pass it on, so no node is left running
trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM

where="this machine"
[[ -z "$MACHINES" ]] || where="machines 0 and 1 of '$MACHINES'"
echo "two nodes x $NPROC_PER_NODE process(es) on $where, $RDZV rendezvous on $address:$PORT; following both logs:"
tail -q -n +$((log_lines[0] + 1)) -F "$RUN_DIR/node0.log" 2>/dev/null &
follower0=$!
tail -q -n +$((log_lines[1] + 1)) -F "$RUN_DIR/node1.log" 2>/dev/null &
follower1=$!

# Wait for both nodes. If one fails, stop the other: alone, it would wait for its peer until the
# rendezvous or collective timeout.
status=0
remaining=2
while [[ $remaining -gt 0 ]]; do
    sleep 1
    for i in 0 1; do
        pid="${pids[$i]}"
        if [[ "$pid" == done ]] || kill -0 "$pid" 2>/dev/null; then
            continue
        fi
        code=0
        wait "$pid" || code=$?
        pids[i]=done
        remaining=$((remaining - 1))
        if [[ $code -ne 0 && $status -eq 0 ]]; then
            echo "node $i exited with status $code; stopping the other node" >&2
            status=$code
            for other in "${pids[@]}"; do
                [[ "$other" == done ]] || kill "$other" 2>/dev/null || true
            done
        fi
    done
done
sleep 1  # let the follower print the last lines
kill "$follower0" "$follower1" 2>/dev/null || true

echo
echo "node logs:       $RUN_DIR/node0.log  $RUN_DIR/node1.log"
echo "metrics (rank 0): $RUN_DIR/metrics.jsonl"
echo "checkpoint:       $RUN_DIR/ckpt.pt"
exit "$status"
