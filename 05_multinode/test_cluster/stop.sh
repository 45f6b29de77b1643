#!/usr/bin/env bash
# Stop the one-node Slurm that start.sh started with the same folder (munged keeps running).
set -euo pipefail
dir="${1:?give the folder given to start.sh}"
for daemon in slurmd slurmctld; do
    pid_file="$dir/$daemon.pid"
    if [[ ! -s "$pid_file" ]]; then
        continue
    fi
    pid="$(cat "$pid_file")"
    # only if that process is still the daemon: after a reboot the number may be another program's
    if [[ "$(ps -o comm= -p "$pid" 2>/dev/null)" == "$daemon" ]]; then
        kill "$pid"
        kill -CONT "$pid" 2>/dev/null || true  # a stopped process gets its TERM only once it runs
        for _ in $(seq 40); do
            if ! kill -0 "$pid" 2>/dev/null; then
                break
            fi
            sleep 0.25
        done
        kill -KILL "$pid" 2>/dev/null || true  # still there after 10 s
    fi
    rm -f "$pid_file"
done
