#!/usr/bin/env bash
# Stop the one-node Slurm that start.sh started with the same folder (munged keeps running).
set -euo pipefail
dir="${1:?give the folder given to start.sh}"
for daemon in slurmd slurmctld; do
    if [[ -s "$dir/$daemon.pid" ]]; then
        kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
        rm -f "$dir/$daemon.pid"
    fi
done
