#!/usr/bin/env bash
# Needs Linux and root (elsewhere, simulate_two_nodes.sh runs two nodes over 127.0.0.1 instead).
# Several machines on one: each "machine" is a Linux network namespace, a network stack of its own
# with its own interface (eth0), address, routes and host name, all joined by one switch. Chapter
# 05 runs across them as across real machines: MASTER_ADDR is machine 0's address, every process
# picks an interface, and the link can be slowed to a real network's rate.
#
#   sudo bash 05_multinode/machines.sh up                      # 2 machines, the link unlimited
#   sudo bash 05_multinode/machines.sh up --machines 2 --rate 100mbit   # or 1gbit, or unlimited
#   sudo bash 05_multinode/machines.sh run 1 ip -4 -br addr    # a command on machine 1
#   sudo bash 05_multinode/machines.sh list                    # the machines, addresses and rate
#   sudo bash 05_multinode/machines.sh address 0               # machine 0's address: 10.0.0.1
#   sudo bash 05_multinode/machines.sh down                    # stop what runs there, remove all
#
# The verbs:
#   up [--machines N] [--rate RATE]   makes the machines, or brings those already made to N
#                                     machines at RATE (idempotent); prints the list
#   run I COMMAND [ARG...]            COMMAND on machine I (0, 1, ...), in the current folder and
#                                     environment, as the user who ran sudo (or root); it becomes
#                                     COMMAND: its exit status and signals are COMMAND's
#   list                              one line per machine
#   address I                         machine I's address, for scripts
#   down                              stops the processes still running on the machines and
#                                     removes everything `up` made (idempotent)
# Every verb also takes --prefix P (before its arguments): the names of this set of machines, so
# that several sets can exist at once (default: course).
#
# What `up` makes, and all that `down` removes: the namespaces P-m0, P-m1, ... (machine I has
# eth0 at 10.0.0.(I+1)/24 and the host name machineI), the namespace P-switch with a bridge and one
# port per machine, and /etc/netns/P-mI/hosts (`ip netns exec` shows it to machine I as
# /etc/hosts: every machine's name and address, as a cluster's DNS would). Nothing is made in
# the host's own network namespace: its interfaces and routes are never touched. --rate puts a
# token bucket (tc's tbf) on both directions of every machine's link: each machine sends and
# receives at most RATE at once, as over a full-duplex network card.
set -euo pipefail

SUBNET=10.0.0  # machine I is $SUBNET.(I+1); every set has its own switch, so sets do not collide
MAX_MACHINES=16

fail() {
    echo "error: $*" >&2
    exit 2
}

usage() {
    fail "usage: machines.sh up [--machines N] [--rate RATE] | run I COMMAND... | list | address I | down (each verb also takes --prefix P)"
}

verb="${1:-}"
[[ -n "$verb" ]] || usage
shift
prefix=course
machines=2
rate=unlimited
while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) prefix="${2:-}"; shift 2 || usage ;;
        --machines) [[ "$verb" == up ]] || usage; machines="${2:-}"; shift 2 || usage ;;
        --rate) [[ "$verb" == up ]] || usage; rate="${2:-}"; shift 2 || usage ;;
        *) break ;;
    esac
done
[[ "$prefix" =~ ^[a-z][a-z0-9]{0,11}$ ]] || fail "--prefix '$prefix': 1 to 12 lower-case letters and digits, starting with a letter"
[[ "$machines" =~ ^[0-9]+$ && "$machines" -ge 1 && "$machines" -le $MAX_MACHINES ]] \
    || fail "--machines '$machines': a number from 1 to $MAX_MACHINES"
if [[ "$rate" != unlimited && ! "$rate" =~ ^[0-9]+(\.[0-9]+)?(kbit|mbit|gbit)$ ]]; then
    fail "--rate '$rate': unlimited, or a rate as tc writes it: 100mbit, 1gbit, 500kbit"
fi

# ---- what every verb needs: root, the tools, and a kernel that allows network namespaces ---------
[[ $EUID -eq 0 ]] || fail "machines.sh makes network namespaces, which needs root: run it with sudo (without root, simulate_two_nodes.sh runs two nodes over 127.0.0.1)"
for tool in ip tc unshare flock; do
    command -v "$tool" > /dev/null || fail "machines.sh needs '$tool' (ip and tc are in iproute2, unshare and flock in util-linux): install them, e.g. apt-get install iproute2"
done
if ! why=$(unshare --net true 2>&1); then
    fail "this system does not allow network namespaces ($why): in a container, start it with --privileged; or use simulate_two_nodes.sh, which needs no root"
fi

switch="$prefix-switch"
machine_ns() { echo "$prefix-m$1"; }
machine_address() { echo "$SUBNET.$(($1 + 1))"; }
exists() { ip netns list | grep -qx "$1\( (id: [0-9]*)\)\?"; }
# the machines of this set, by number, as they exist now
existing_machines() {
    ip netns list | sed -n "s/^$prefix-m\([0-9][0-9]*\)\( .*\)\?$/\1/p" | sort -n
}

# ---- down: stop what runs there, then remove every namespace and file of this set ------------------
remove_machine() {
    local ns
    ns=$(machine_ns "$1")
    if exists "$ns"; then
        stop_processes "$ns"
        ip netns del "$ns"  # its eth0 goes with it, and so does the switch's end of the cable
    fi
    rm -rf "/etc/netns/$ns"
}

stop_processes() {
    local pids
    pids=$(ip netns pids "$1" 2> /dev/null || true)
    [[ -n "$pids" ]] || return 0
    # shellcheck disable=SC2086
    kill -TERM $pids 2> /dev/null || true
    for _ in $(seq 50); do  # up to 5 s for them to end, then SIGKILL
        pids=$(ip netns pids "$1" 2> /dev/null || true)
        [[ -n "$pids" ]] || return 0
        sleep 0.1
    done
    # shellcheck disable=SC2086
    kill -KILL $pids 2> /dev/null || true
}

down() {
    local i
    for i in $(existing_machines); do
        remove_machine "$i"
    done
    if exists "$switch"; then
        stop_processes "$switch"
        ip netns del "$switch"
    fi
    rm -rf /etc/netns/"$prefix"-m*
    rmdir /etc/netns 2> /dev/null || true  # only if empty: other sets' files stay
}

# ---- up: the switch, the machines and their cables, the rate ------------------------------------------
# tbf: a token bucket of `burst` bytes refilled at `rate`; a packet waits for tokens, at most
# `latency`. The bucket holds 1 ms of the rate, and at least 4,000 bytes (32kbit): a smaller one
# makes tbf wake up too often to keep the rate (an all-reduce at 1gbit reached 60% of it with a
# bucket of 32 KB, 95% with 125 KB), a larger one lets short messages through faster than the rate.
limit() {  # limit NAMESPACE INTERFACE
    if [[ "$rate" == unlimited ]]; then
        ip netns exec "$1" tc qdisc del dev "$2" root 2> /dev/null || true
        return
    fi
    local burst
    burst=$(awk -v rate="$rate" 'BEGIN {
        scale = rate ~ /gbit$/ ? 1e9 : rate ~ /mbit$/ ? 1e6 : 1e3
        bytes = int(rate * scale / 8 / 1000)  # awk reads the number before the unit
        print (bytes < 4000 ? 4000 : bytes) }')
    if ! why=$(ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$rate" burst "$burst" latency 50ms 2>&1); then
        fail "tc could not limit the link to $rate (tc: ${why%%$'\n'*}); a kernel without the tbf queue (sch_tbf) cannot limit it at all"
    fi
}

make_machine() {
    local i=$1 ns address j
    ns=$(machine_ns "$i")
    address=$(machine_address "$i")
    if ! exists "$ns"; then
        ip netns add "$ns"
        # the cable: eth0 inside the machine, port mI on the switch; made inside the namespaces
        ip -n "$switch" link add "m$i" type veth peer name eth0 netns "$ns"
        ip -n "$switch" link set "m$i" master br0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$address/24" dev eth0
        ip -n "$ns" link set eth0 up
    fi
    mkdir -p "/etc/netns/$ns"
    {
        echo "127.0.0.1 localhost"
        for ((j = 0; j < machines; j++)); do
            echo "$(machine_address "$j") machine$j"
        done
        # Torch's store looks up the name of each client's address, which its IPv6 socket sees as
        # ::ffff:10.0.0.2; a DNS server would answer that, this file must say it (under a name of
        # its own, so that a look-up of machineI still finds its IPv4 address first).
        for ((j = 0; j < machines; j++)); do
            echo "::ffff:$(machine_address "$j") machine$j.v4mapped"
        done
    } > "/etc/netns/$ns/hosts"
    limit "$ns" eth0  # what machine I sends
    limit "$switch" "m$i"  # what it receives
}

up() {
    local i
    # however `up` ends before it is done (an error, Ctrl-C), nothing is left half-made
    trap down EXIT
    trap 'exit 130' INT TERM
    if ! exists "$switch"; then
        ip netns add "$switch"
        ip -n "$switch" link add br0 type bridge
        ip -n "$switch" link set br0 up
    fi
    for i in $(existing_machines); do
        [[ $i -lt $machines ]] || remove_machine "$i"
    done
    for ((i = 0; i < machines; i++)); do
        make_machine "$i"
    done
    trap - EXIT INT TERM
    list
}

list() {
    local i ns qdisc shown
    if [[ -z "$(existing_machines)" ]]; then
        echo "no machines in the set '$prefix' (sudo bash 05_multinode/machines.sh up makes them)" >&2
    fi
    for i in $(existing_machines); do
        ns=$(machine_ns "$i")
        qdisc=$(ip netns exec "$ns" tc qdisc show dev eth0 root)
        shown=unlimited
        if [[ "$qdisc" =~ tbf.*rate\ ([^ ]+) ]]; then
            shown="${BASH_REMATCH[1]}"
        fi
        echo "machine$i  namespace $ns  eth0 $(machine_address "$i")/24  rate $shown"
    done
}

case "$verb" in
    up | down)
        # one up or down at a time on this computer: two of them would race for the same names
        exec 8< "$0"
        flock 8
        "$verb"
        ;;
    list) list ;;
    address)
        [[ "${1:-}" =~ ^[0-9]+$ ]] || usage
        echo "$(machine_address "$1")"
        ;;
    run)
        [[ "${1:-}" =~ ^[0-9]+$ && $# -ge 2 ]] || usage
        ns=$(machine_ns "$1")
        exists "$ns" || fail "no machine $1 in the set '$prefix' (sudo bash 05_multinode/machines.sh up makes them)"
        shift
        # A host name of its own (a UTS namespace): what torchrun, gloo and the logs call this
        # machine. Then back to the user who ran sudo, so the files it writes are theirs.
        user=()
        if [[ -n "${SUDO_UID:-}" && "${SUDO_UID}" != 0 ]]; then
            user=(setpriv --reuid="$SUDO_UID" --regid="$SUDO_GID" --init-groups)
        fi
        exec ip netns exec "$ns" unshare --uts -- /bin/sh -c 'hostname "$0" && exec "$@"' \
            "machine${ns##*-m}" "${user[@]}" "$@"
        ;;
    *) usage ;;
esac
