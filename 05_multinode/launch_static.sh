#!/usr/bin/env bash
# Static rendezvous: every node is told the whole layout up front. Run this on EVERY node, with
# NODE_RANK=0 on the node whose address is MASTER_ADDR (it hosts the meeting point), 1, 2, ... on
# the others. Arguments after the script name go to train.py.
#
#   node 0:  NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash 05_multinode/launch_static.sh --max-iters 2000
#   node 1:  NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash 05_multinode/launch_static.sh --max-iters 2000
#
# Settings (environment variables, with defaults):
#   NODE_RANK        this node's number, 0 .. NNODES-1 (required)
#   MASTER_ADDR      address of node 0 that every node can reach (required)
#   MASTER_PORT      a free TCP port on node 0, open to the other nodes (29500)
#   NNODES           number of nodes (2)
#   NPROC_PER_NODE   processes per node, one per GPU (the GPUs nvidia-smi lists, else 1)
#   MAX_RESTARTS     how often torchrun restarts this node's processes after a failure (0;
#                    chapter 06 teaches restarts with launch_c10d.sh: under this static
#                    rendezvous a restarted group meets at a store that outlived the attempt)
#   SCRIPT           the program to start (05_multinode/train.py; 05_multinode/preflight.py to
#                    check the nodes first; 06_fault_tolerance/train.py for chapter 06)
#   SAME_MACHINE     1: every node runs on this one machine (simulate_two_nodes.sh), so
#                    MASTER_ADDR may be this machine's own address (0)
#
# train.py's --dist-timeout among the arguments (300 s unless given) also bounds how long this node
# waits for the others: one that never comes ends the wait with one line.
#
# exec: torchrun takes this script's place, so a signal sent to it (as Kubernetes sends SIGTERM to a
# container's first process) reaches torchrun, which passes it on to the training processes.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root, so the paths below work from anywhere

: "${NODE_RANK:?set NODE_RANK: 0 on the node at MASTER_ADDR, 1, 2, ... on the others}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0, reachable from every node}"
MASTER_PORT="${MASTER_PORT:-29500}"
NNODES="${NNODES:-2}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    [[ "$NPROC_PER_NODE" -gt 0 ]] || NPROC_PER_NODE=1
fi
MAX_RESTARTS="${MAX_RESTARTS:-0}"
SCRIPT="${SCRIPT:-05_multinode/train.py}"
# How long this node waits for the others: as long as the run lets a collective wait for a
# peer (train.py's --dist-timeout, 300 s unless the arguments say otherwise), not the static
# rendezvous's own 15 minutes. A node whose peer never comes then ends by itself, with one line.
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

echo "launch_static: node $NODE_RANK of $NNODES, $NPROC_PER_NODE process(es), meeting at $MASTER_ADDR:$MASTER_PORT" >&2
# Can this node take part? torchrun would retry an unreachable MASTER_ADDR for 15 minutes; the
# preflight's network check says in one line what is wrong, in a moment, and then waits until
# every node is there, or names the node ranks that never came (preflight.py, --meet and --wait).
same_machine=""
[[ "${SAME_MACHINE:-0}" != 1 ]] || same_machine=--same-machine
# shellcheck disable=SC2086  # $same_machine: one word, or none
python 05_multinode/preflight.py --meet "$MASTER_ADDR:$MASTER_PORT" --node-rank "$NODE_RANK" \
    --nnodes "$NNODES" --wait "$TIMEOUT" $same_machine
exec torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
    --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --rdzv-conf timeout="$TIMEOUT" \
    --max-restarts="$MAX_RESTARTS" "$SCRIPT" "$@"
