#!/usr/bin/env bash
# Stop the one-node Slurm that start.sh started with the same folder (munged keeps running).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/processes.sh"
dir="${1:?give the folder given to start.sh}"
for daemon in slurmd slurmctld; do
    pid="$(running_pid "$dir/$daemon.pid" "$daemon" || true)"
    if [[ -n "$pid" ]]; then
        stop_process "$pid"
    fi
    rm -f "$dir/$daemon.pid"
done
