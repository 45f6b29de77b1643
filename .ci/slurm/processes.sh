# The daemons' processes, for start.sh and stop.sh (sourced by both; not run on its own).

# The pid in a pid file, if that process is still the program named (after a reboot the number may
# be another program's); no output and status 1 otherwise.
running_pid() {
    local pid_file="$1" program="$2" pid
    if [[ ! -s "$pid_file" ]]; then
        return 1
    fi
    pid="$(cat "$pid_file")"
    if [[ "$(ps -o comm= -p "$pid" 2>/dev/null)" != "$program" ]]; then
        return 1
    fi
    echo "$pid"
}

# TERM, then KILL if the process is still there after 10 s.
stop_process() {
    local pid="$1"
    kill "$pid" 2>/dev/null || true
    kill -CONT "$pid" 2>/dev/null || true  # a stopped process gets its TERM only once it runs
    for _ in $(seq 40); do
        if ! kill -0 "$pid" 2>/dev/null; then
            return 0
        fi
        sleep 0.25
    done
    kill -KILL "$pid" 2>/dev/null || true
}
