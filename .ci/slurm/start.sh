#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, to try 06_fault_tolerance/slurm.sbatch (and its stop
# and requeue) before the real cluster. Debian or Ubuntu, as root (sudo):
#
#   sudo bash .ci/slurm/start.sh /tmp/course-slurm
#   export SLURM_CONF=/tmp/course-slurm/slurm.conf
#   sbatch --nodes=1 --gpus-per-node=0 --cpus-per-task=2 06_fault_tolerance/slurm.sbatch \
#       --preset tiny
#   sudo bash .ci/slurm/stop.sh /tmp/course-slurm                        # when done
#
# It installs Debian's slurmctld, slurmd, slurm-client and munge when they are missing, writes the
# configuration and the daemons' state into the folder it is given, starts munged, slurmctld and
# slurmd as plain background processes (no systemd needed), and waits until `sinfo` shows the node
# idle. Every Slurm command then needs SLURM_CONF=<folder>/slurm.conf (the line above).
#
# Run it again at any time: a cluster that answers is kept; daemons left from an earlier start that
# no longer answer (after a reboot, or after munged was stopped) are stopped and started afresh.
# SLURMCTLD_PORT and SLURMD_PORT choose other ports than Slurm's 6817 and 6818.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/processes.sh"
dir="${1:?give a folder for the configuration and the daemons state, e.g. /tmp/course-slurm}"
if [[ "$(id -u)" != 0 ]]; then
    if command -v sudo >/dev/null; then
        exec sudo bash "$0" "$@"  # it installs packages and starts daemons
    fi
    echo "start.sh: run it as root: it installs packages and starts daemons" >&2
    exit 2
fi
ctld_port="${SLURMCTLD_PORT:-6817}"
slurmd_port="${SLURMD_PORT:-6818}"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    echo "start.sh: installing slurmctld, slurmd, slurm-client and munge" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

mkdir -p "$dir/state" "$dir/spool"
dir="$(cd "$dir" && pwd)"
host="$(hostname -s)"
sed -e "s|@HOST@|$host|g" -e "s|@DIR@|$dir|g" -e "s|@CPUS@|$(nproc)|g" \
    -e "s|@CTLD_PORT@|$ctld_port|g" -e "s|@SLURMD_PORT@|$slurmd_port|g" \
    "$here/slurm.conf.template" > "$dir/slurm.conf"
export SLURM_CONF="$dir/slurm.conf"

# Every Slurm command waits on munge and on slurmctld, and waits long when they are gone: each
# question below has a time limit, so that a broken cluster ends this script with a message.
munge_answers() {
    timeout 10 munge -n </dev/null 2>/dev/null | timeout 10 unmunge >/dev/null 2>&1
}
slurm_answers() {
    timeout 15 sinfo -h >/dev/null 2>&1
}
port_in_use() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# munge signs what the daemons and the commands tell each other. Its socket file outlives a munged
# that was stopped, so the test is whether munge answers, not whether the file is there.
if ! munge_answers; then
    munged_pid="$(running_pid /run/munge/munged.pid munged || true)"
    if [[ -n "$munged_pid" ]]; then
        stop_process "$munged_pid"
    fi
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock /run/munge/munged.pid
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
            || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    runuser -u munge -- munged
    for _ in $(seq 20); do
        if munge_answers; then
            break
        fi
        sleep 0.5
    done
    if ! munge_answers; then
        echo "start.sh: munged started but does not answer; see /var/log/munge/munged.log" >&2
        exit 1
    fi
fi

ctld_pid="$(running_pid "$dir/slurmctld.pid" slurmctld || true)"
slurmd_pid="$(running_pid "$dir/slurmd.pid" slurmd || true)"
if [[ -n "$ctld_pid" && -n "$slurmd_pid" ]] && slurm_answers; then
    echo "start.sh: the cluster of $dir is running already" >&2
else
    # what is left of an earlier start of this folder does not answer: stop it, start afresh
    bash "$here/stop.sh" "$dir"
    for port in "$ctld_port" "$slurmd_port"; do
        if port_in_use "$port"; then
            echo "start.sh: port $port is taken by another program (another Slurm?); stop it," \
                "or choose free ports with SLURMCTLD_PORT=... SLURMD_PORT=..." >&2
            exit 1
        fi
    done
    # -D: in the foreground, as under systemd; setsid and & detach them from this shell.
    # -c: an empty queue, so that no job of an earlier cluster in this folder runs again.
    setsid slurmctld -D -c -i -f "$SLURM_CONF" </dev/null >>"$dir/slurmctld.out" 2>&1 &
    echo $! > "$dir/slurmctld.pid"
    setsid slurmd -D -N "$host" -f "$SLURM_CONF" </dev/null >>"$dir/slurmd.out" 2>&1 &
    echo $! > "$dir/slurmd.pid"
fi

deadline=$((SECONDS + 60))
while ((SECONDS < deadline)); do
    if [[ "$(timeout 15 sinfo -h -N -o %t 2>/dev/null || true)" == idle ]]; then
        echo "start.sh: one node ($host) idle; now: export SLURM_CONF=$SLURM_CONF" >&2
        exit 0
    fi
    sleep 0.5
done
echo "start.sh: the node did not become idle in 60 s; see $dir/slurmctld.log and $dir/slurmd.log" >&2
exit 1
