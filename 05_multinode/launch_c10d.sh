#!/usr/bin/env bash
# Elastic rendezvous (c10d): every node runs the SAME line. The nodes meet in a key-value store
# at RDZV_ENDPOINT (hosted by the torchrun on that machine). The node ranks follow the sorted
# host names, not the order of arrival. When a process fails, torchrun stops the group, the
# nodes meet again and the processes restart (up to MAX_RESTARTS times); train.py then resumes
# from its last checkpoint.
#
#   on every node:  RDZV_ENDPOINT=10.0.0.1:29400 RDZV_ID=job42 bash 05_multinode/launch_c10d.sh --max-iters 2000
#
# Settings (environment variables, with defaults):
#   RDZV_ENDPOINT    HOST:PORT of one of the nodes, reachable from all (required)
#   RDZV_ID          a name for this job, the same on every node, new for every job (gpt-course)
#   NNODES           number of nodes (2). MIN:MAX (1:4) lets nodes come and go, but then the
#                    world size and the global batch change: this course keeps it fixed
#   NPROC_PER_NODE   processes per node, one per GPU (the GPUs nvidia-smi lists, else 1)
#   MAX_RESTARTS     restarts of the whole group after a failure (3)
#   SCRIPT           the program to start (05_multinode/train.py; 05_multinode/preflight.py to check)
#
# To stop a training run so that it can continue later, send SIGTERM to torchrun on every node (a
# scheduler does): torchrun passes it on, the ranks stop after the same step (they check every
# 10 steps), rank 0 saves it, and the training processes exit with status 75 (torchrun itself with 1). Run the same line again
# with --resume to continue. exec: torchrun takes this script's place, so a signal sent to it (as
# Kubernetes sends SIGTERM to a container's first process) reaches torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root, so the paths below work from anywhere

: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=HOST:PORT, the address of one node and a port open to all}"
RDZV_ID="${RDZV_ID:-gpt-course}"
NNODES="${NNODES:-2}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    [[ "$NPROC_PER_NODE" -gt 0 ]] || NPROC_PER_NODE=1
fi
MAX_RESTARTS="${MAX_RESTARTS:-3}"
SCRIPT="${SCRIPT:-05_multinode/train.py}"
# A new meeting point for the processes of every restart. By default torchrun lets them all meet in
# one store that outlives a restart, and a node whose peers failed restarts without counting it
# (TORCHELASTIC_RESTART_COUNT differs between nodes), so the processes could not even agree on
# which attempt they belong to; a restarted group then hangs. With this set, node 0's torchrun
# names a fresh port for every round of the rendezvous.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

echo "launch_c10d: $NNODES node(s) x $NPROC_PER_NODE process(es), job '$RDZV_ID' meeting at $RDZV_ENDPOINT" >&2
exec torchrun --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" \
    --max-restarts="$MAX_RESTARTS" \
    "$SCRIPT" "$@"
