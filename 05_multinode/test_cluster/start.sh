#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, to try 05_multinode/slurm.sbatch (and its stop and
# requeue) before the real cluster. Debian or Ubuntu, as root (sudo):
#
#   sudo bash 05_multinode/test_cluster/start.sh /tmp/course-slurm
#   export SLURM_CONF=/tmp/course-slurm/slurm.conf
#   sbatch --nodes=1 --gpus-per-node=0 --cpus-per-task=2 05_multinode/slurm.sbatch --preset tiny
#   sudo bash 05_multinode/test_cluster/stop.sh /tmp/course-slurm        # when done
#
# It installs Debian's slurmctld, slurmd, slurm-client and munge when they are missing, writes the
# configuration and the daemons' state into the folder it is given, starts munged, slurmctld and
# slurmd as plain background processes (no systemd needed), and waits until `sinfo` shows the node
# idle. Every Slurm command then needs SLURM_CONF=<folder>/slurm.conf (the line above).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:?give a folder for the configuration and the daemons state, e.g. /tmp/course-slurm}"
if [[ "$(id -u)" != 0 ]]; then
    if command -v sudo >/dev/null; then
        exec sudo bash "$0" "$@"  # it installs packages and starts daemons
    fi
    echo "start.sh: run it as root: it installs packages and starts daemons" >&2
    exit 2
fi

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
    -e "s|@CTLD_PORT@|${SLURMCTLD_PORT:-6817}|g" -e "s|@SLURMD_PORT@|${SLURMD_PORT:-6818}|g" \
    "$here/slurm.conf.template" > "$dir/slurm.conf"
export SLURM_CONF="$dir/slurm.conf"

# munge signs what the daemons and the commands tell each other; it needs its socket folder
if [[ ! -S /run/munge/munge.socket.2 ]]; then
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
            || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    runuser -u munge -- munged
fi

# -D: in the foreground, as the daemons would under systemd; setsid and & detach them from this shell
if [[ -s "$dir/slurmctld.pid" ]] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
    echo "start.sh: the cluster of $dir is running already" >&2
else
    setsid slurmctld -D -i -f "$SLURM_CONF" </dev/null >>"$dir/slurmctld.out" 2>&1 &
    echo $! > "$dir/slurmctld.pid"
    setsid slurmd -D -N "$host" -f "$SLURM_CONF" </dev/null >>"$dir/slurmd.out" 2>&1 &
    echo $! > "$dir/slurmd.pid"
fi

for _ in $(seq 120); do
    if [[ "$(sinfo -h -N -o %t 2>/dev/null)" == idle ]]; then
        echo "start.sh: one node ($host) idle; now: export SLURM_CONF=$SLURM_CONF" >&2
        exit 0
    fi
    sleep 0.5
done
echo "start.sh: the node did not become idle in 60 s; see $dir/slurmctld.log and $dir/slurmd.log" >&2
exit 1
