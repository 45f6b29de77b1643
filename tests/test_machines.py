"""05_multinode/machines.sh: machines of their own on one computer (own network stack, address,
host name, one switch), made and removed as root; skipped without root (with CI=true they fail)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import time

import pytest
from machines import MACHINES, MachineSet, machine_set, machines_sh, new_prefix, require_machines

from layout import REPO

# machine 1 sends 2 MB to machine 0 by name: the names, the addresses and the switch all work
TRANSFER = """
import socket, sys
if sys.argv[1] == "listen":
    server = socket.create_server(("0.0.0.0", 5001))
    print("listening", flush=True)
    peer, (address, _) = server.accept()
    received = 0
    while chunk := peer.recv(1 << 16):
        received += len(chunk)
    print(f"{received} bytes from {address}")
else:
    socket.create_connection(("machine0", 5001), timeout=10).sendall(bytes(2_000_000))
"""


def host_network() -> str:
    """The host's own interfaces and routes: what machines.sh must never change."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True, check=True)
    # a veth's peer count and statistics are not in -o link's text; the names and flags are
    return links.stdout + routes.stdout


def on(machines: MachineSet, machine: int, *command: str) -> str:
    run = subprocess.run(
        machines.run_command(machine, list(command)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_machines_have_their_own_names_addresses_and_link_and_leave_nothing():
    require_machines()
    before = host_network()
    with machine_set(machines=2) as machines:
        listed = machines_sh("list", "--prefix", machines.prefix).stdout
        assert listed.splitlines() == [
            f"machine0  namespace {machines.prefix}-m0  eth0 10.0.0.1/24  rate unlimited",
            f"machine1  namespace {machines.prefix}-m1  eth0 10.0.0.2/24  rate unlimited",
        ]
        assert machines.address(1) == "10.0.0.2"
        # up again: the same machines (idempotent); then at a rate, on both machines
        assert machines.up(machines=2) == listed
        assert re.findall(r"rate (\S+)", machines.up(rate="100mbit")) == ["100Mbit", "100Mbit"]
        assert sorted(machines.namespaces()) == [
            f"{machines.prefix}-m0",
            f"{machines.prefix}-m1",
            f"{machines.prefix}-switch",
        ]
        # each machine: its own host name, its own interface and address, the others' names
        assert on(machines, 1, "hostname").strip() == "machine1"
        interfaces = on(machines, 1, "ip", "-o", "-4", "addr", "show")
        assert re.findall(r"^\d+: (\w+)\s+inet (\S+)", interfaces, re.MULTILINE) == [
            ("lo", "127.0.0.1/8"),
            ("eth0", "10.0.0.2/24"),
        ]
        assert on(machines, 0, "getent", "hosts", "machine1").split() == ["10.0.0.2", "machine1"]
        # machine 1 reaches machine 0 by its name, through the switch
        server = subprocess.Popen(
            machines.run_command(0, ["python", "-c", TRANSFER, "listen"]),
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout.readline() == "listening\n"
            on(machines, 1, "python", "-c", TRANSFER, "send")
            assert server.stdout.read().strip() == "2000000 bytes from 10.0.0.2"
        finally:
            server.kill()
            server.wait()
        # a command on a machine is that command: its exit status, and the user who ran sudo
        status = subprocess.run(machines.run_command(0, ["sh", "-c", "exit 7"]), cwd=REPO)
        assert status.returncode == 7
        as_user = subprocess.run(
            machines.run_command(0, ["id", "-u"]),
            cwd=REPO,
            capture_output=True,
            text=True,
            env=dict(os.environ, SUDO_UID="65534", SUDO_GID="65534"),
        )
        assert as_user.stdout.strip() == "65534", as_user.stderr
        # fewer machines: machine 1 goes
        assert len(machines.up(machines=1).splitlines()) == 1
        assert not os.path.exists(f"/etc/netns/{machines.prefix}-m1")
    assert machines.namespaces() == []
    assert not glob.glob(f"/etc/netns/{machines.prefix}-*")  # the machines' /etc/hosts gone too
    machines.down()  # down again: nothing to do, no error
    assert host_network() == before


def test_down_stops_what_still_runs_on_the_machines():
    require_machines()
    with machine_set(machines=1) as machines:
        sleeper = subprocess.Popen(machines.run_command(0, ["sleep", "300"]), cwd=REPO)
        deadline = time.monotonic() + 30
        while not subprocess.run(
            ["ip", "netns", "pids", f"{machines.prefix}-m0"], capture_output=True, text=True
        ).stdout.strip():
            assert time.monotonic() < deadline, "sleep never started on machine 0"
            time.sleep(0.1)
        machines.down()
        assert sleeper.wait(timeout=30) != 0  # stopped by SIGTERM
        assert machines.namespaces() == []


def test_a_failed_up_leaves_nothing_behind():
    require_machines()
    prefix = new_prefix()
    # tc itself refuses a rate of 0: the failure comes half-way, after the machines were made
    up = machines_sh("up", "--prefix", prefix, "--rate", "0kbit", check=False)
    assert up.returncode == 2
    assert up.stderr.startswith("error: tc could not limit the link to 0kbit (tc: ")
    assert len(up.stderr.strip().splitlines()) == 1
    assert MachineSet(prefix).namespaces() == []


def refusal(*wrapper: str, env: dict | None = None, args: tuple = ("up",), prefix: str = "") -> str:
    """machines.sh's one line on stderr when it refuses; nothing may have been made."""
    prefix = prefix or new_prefix()
    verb, *rest = args
    proc = subprocess.run(
        [*wrapper, "/bin/bash", str(MACHINES), verb, "--prefix", prefix, *rest],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert MachineSet(prefix).namespaces() == []
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_refusals_are_one_clear_line():
    require_machines()
    # not root: the user nobody
    assert refusal("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups") == (
        "error: machines.sh makes network namespaces, which needs root: run it with sudo "
        "(without root, simulate_two_nodes.sh runs two nodes over 127.0.0.1)"
    )
    # root without the capabilities to make namespaces, as in an unprivileged container
    no_caps = refusal("setpriv", "--bounding-set=-all", "--inh-caps=-all")
    assert no_caps.startswith("error: this system does not allow network namespaces (unshare")
    assert no_caps.endswith("use simulate_two_nodes.sh, which needs no root")
    # no iproute2: a PATH without ip and tc
    assert refusal(env={"PATH": "/nonexistent"}).startswith("error: machines.sh needs 'ip' ")
    # mistakes in the arguments
    assert refusal(args=("up", "--machines", "0")).startswith("error: --machines '0'")
    assert refusal(args=("up", "--rate", "fast")).startswith("error: --rate 'fast'")
    prefix = new_prefix()
    assert refusal(args=("run", "0", "true"), prefix=prefix) == (
        f"error: no machine 0 in the set '{prefix}' (sudo bash 05_multinode/machines.sh up makes "
        "them)"
    )


@pytest.mark.parametrize("verb", ["frobnicate", ""])
def test_unknown_verbs_are_refused(verb):
    proc = subprocess.run(
        ["bash", str(MACHINES), *([verb] if verb else [])], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: usage: machines.sh up [--machines N] [--rate RATE]")
