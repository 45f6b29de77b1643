#!/usr/bin/env bash
# Elastic rendezvous (c10d): every node runs the SAME line. The nodes meet in a key-value store
# at RDZV_ENDPOINT (hosted by the torchrun on that machine), which hands out the node ranks in the
# order of the nodes' names (each torchrun's host name, compared as text, then its process id as a
# number), not in the order they arrive. When a process fails, torchrun can restart the group
# (MAX_RESTARTS, chapter 06).
#
#   on every node:  RDZV_ENDPOINT=10.0.0.1:29400 RDZV_ID=job42 bash 05_multinode/launch_c10d.sh --max-iters 2000
#
# Settings (environment variables, with defaults):
#   RDZV_ENDPOINT    HOST:PORT of one of the nodes, reachable from all (required)
#   RDZV_ID          a name for this job, the same on every node, new for every job (gpt-course)
#   NNODES           number of nodes (2). MIN:MAX (1:4) lets nodes come and go, but then the
#                    world size and the global batch change: this course keeps it fixed
#   NPROC_PER_NODE   processes per node, one per GPU (the GPUs nvidia-smi lists, else 1)
#   MAX_RESTARTS     restarts of the whole group after a failure (0; chapter 06)
#   SCRIPT           the program to start (05_multinode/train.py; 05_multinode/preflight.py to
#                    check the nodes first; 06_fault_tolerance/train.py for chapter 06)
#   SAME_MACHINE     1: every node runs on this one machine (simulate_two_nodes.sh), so the
#                    loopback is right (0)
#
# train.py's --dist-timeout among the arguments (300 s unless given) also bounds how long this node
# waits for the others: one that never comes ends the wait with one line.
#
# exec: torchrun takes this script's place, so a signal sent to it (as Kubernetes sends SIGTERM to a
# container's first process) reaches torchrun, which passes it on to the training processes.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root, so the paths below work from anywhere

: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=HOST:PORT, the address of one node and a port open to all}"
RDZV_ID="${RDZV_ID:-gpt-course}"
NNODES="${NNODES:-2}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    [[ "$NPROC_PER_NODE" -gt 0 ]] || NPROC_PER_NODE=1
fi
MAX_RESTARTS="${MAX_RESTARTS:-0}"
SCRIPT="${SCRIPT:-05_multinode/train.py}"
# How long this node waits for the others: as long as the run lets a collective wait for a
# peer (train.py's --dist-timeout, 300 s unless the arguments say otherwise), not torchrun's own
# 10 minutes. A node whose peer never comes then ends by itself, with one line.
TIMEOUT=300
previous=""
for arg in "$@"; do
    if [[ "$previous" == --dist-timeout ]]; then
        TIMEOUT="$arg"
    fi
    if [[ "$arg" == --dist-timeout=* ]]; then
        TIMEOUT="${arg#--dist-timeout=}"
    fi
    previous="$arg"
done
# A new meeting point for the processes of every restart (chapter 06): by default every round of
# the rendezvous shares one store, which outlives a restart, and a restarted group can meet the
# failed group's leftovers there and hang (pytorch/pytorch#135712). With this set, node 0's
# torchrun opens a fresh store on a free port for every round.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

echo "launch_c10d: $NNODES node(s) x $NPROC_PER_NODE process(es), job '$RDZV_ID' meeting at $RDZV_ENDPOINT" >&2
# Can this node take part? torchrun would retry an unreachable endpoint until its timeout; the
# preflight's network check says in one line what is wrong, in a moment, and then waits until
# every node is there, or says how many never came (preflight.py, --meet and --wait).
same_machine=""
[[ "${SAME_MACHINE:-0}" != 1 ]] || same_machine=--same-machine
# shellcheck disable=SC2086  # $same_machine: one word, or none
python 05_multinode/preflight.py --meet "$RDZV_ENDPOINT" --nnodes "$NNODES" --wait "$TIMEOUT" \
    $same_machine
exec torchrun --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" \
    --rdzv-conf join_timeout="$TIMEOUT" --max-restarts="$MAX_RESTARTS" \
    "$SCRIPT" "$@"
