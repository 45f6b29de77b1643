"""05_multinode/preflight.py: run under real torchrun, two nodes of one process on 127.0.0.1 and
across two machines of machines.sh (the link unlimited and at 100 Mbit/s); and its network check
before torchrun (--meet), as the launch recipes run it, with every wrong address and interface."""

from __future__ import annotations

import re
import socket
import subprocess

import pytest
from helpers import outputs_of, start
from machines import machine_set, static_launch

from layout import REPO
from tools.launch import TORCHRUN, child_env, free_port, run_python, two_node_commands

PREFLIGHT = REPO / "05_multinode" / "preflight.py"


def run_all(commands: list[list], timeout: float = 180, **env: str) -> list:
    """The commands started at once (each node waits for the others), then awaited: their runs."""
    procs = [start(command, **env) for command in commands]
    outputs = outputs_of(procs, timeout)
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outputs)
    ]


def test_preflight_on_two_nodes_checks_all_reduce_and_measures_bandwidth():
    args = ["--sizes-mb", "0.1,1", "--iters", "3", "--timeout", "60"]
    nodes = run_all(two_node_commands(PREFLIGHT, 1, args), timeout=120)
    for node in nodes:
        assert node.returncode == 0, node.stdout
    out = nodes[0].stdout + nodes[1].stdout

    # every rank introduces itself, with its ranks and the variables that matter
    intro = re.findall(
        r"^\[node (\d) rank (\d) local (\d)\] host \S+ pid \d+, "
        r"world size 2, device cpu, backend gloo",
        out,
        re.MULTILINE,
    )
    assert sorted(intro) == [("0", "0", "0"), ("1", "1", "0")]
    for variable in (
        "MASTER_ADDR=127.0.0.1",
        "NCCL_SOCKET_IFNAME=",
        "TORCHELASTIC_RESTART_COUNT=0",
    ):
        assert variable in out
    # the static rendezvous: torchrun's store, prefixed per attempt
    assert "TORCHELASTIC_USE_AGENT_STORE=True" in out

    # before the process group: every rank reached every other where gloo listens
    assert len(re.findall(r"gloo addresses: every rank reaches every other$", out, re.M)) == 2
    # the known sum (1 + 2 = 3) arrived on both ranks
    assert len(re.findall(r"all-reduce check: OK \(sum of rank\+1 = 3\)", out)) == 2
    assert len(re.findall(r"gloo group check: OK$", out, re.MULTILINE)) == 2
    assert "preflight PASSED: 2 ranks on 2 node(s)" in nodes[0].stdout

    # rank 0's table: one row per size; with 2 ranks, busbw = algbw * 2(W-1)/W = algbw
    rows = re.findall(
        r"^\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", nodes[0].stdout, re.MULTILINE
    )
    assert [float(r[0]) for r in rows] == [0.1, 1.0]
    for _, ms, algbw, busbw in rows:
        assert float(ms) > 0
        assert float(algbw) > 0
        assert busbw == algbw


def test_preflight_outside_torchrun_is_one_clear_error():
    proc = run_python([PREFLIGHT], check=False, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: preflight.py runs under torchrun, e.g. "
        "torchrun --standalone --nproc_per_node=2 05_multinode/preflight.py"
    ]


def test_preflight_network_check_on_one_machine():
    """--meet without torchrun: the meeting point on this machine, right for node 0 and for the
    simulation (--same-machine), wrong for node 1 of real machines."""
    port = str(free_port())
    meet = ["05_multinode/preflight.py", "--meet", f"127.0.0.1:{port}", "--nnodes", "2"]
    ok = run_python([*meet, "--node-rank", "0", "--same-machine"])
    assert ok.stderr.startswith(
        f"preflight on {socket.gethostname()}: the meeting point 127.0.0.1:{port} "
        "is this machine's; gloo listens on "
    )
    wrong = run_python([*meet, "--node-rank", "1"], check=False)
    assert wrong.returncode == 2
    assert wrong.stderr.strip().splitlines() == [
        f"error: MASTER_ADDR=127.0.0.1 is this machine ({socket.gethostname()}) "
        "itself, not node 0: set it to node 0's address, the same on every node"
    ]


@pytest.fixture(scope="module")
def machines():
    """Two machines of their own (05_multinode/machines.sh); skipped without root (a laptop)."""
    with machine_set(machines=2) as made:
        yield made


def on_machines(machines, commands: list[list[str]], timeout: float = 180, **env: str) -> list:
    """Command i on machine i, all at once: their runs."""
    on_each = [machines.run_command(i, command) for i, command in enumerate(commands)]
    return run_all(on_each, timeout, **env)


def launch(node: int, port: int, master: str = "10.0.0.1") -> list[str]:
    """launch_static.sh on a node, starting the preflight."""
    return static_launch("05_multinode/preflight.py", node, port, master)


PREFLIGHT_ARGS = ["--sizes-mb", "0.5,2", "--iters", "2", "--timeout", "60"]


def bus_bandwidths(out: str) -> dict[float, float]:
    """Rank 0's table: size (MB) -> busbw (GB/s)."""
    rows = re.findall(r"^\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)$", out, re.MULTILINE)
    return {float(size): float(busbw) for size, busbw in rows}


@pytest.mark.slow
def test_preflight_across_machines_names_their_addresses_and_the_rate_limit_holds(machines):
    port = free_port()
    nodes = on_machines(machines, [[*launch(n, port), *PREFLIGHT_ARGS] for n in (0, 1)])
    for node in nodes:
        assert node.returncode == 0, node.stdout
    first, second = nodes[0].stdout, nodes[1].stdout
    # the launch's network check, on each machine, before torchrun
    assert (
        f"preflight on machine0: the meeting point 10.0.0.1:{port} is this machine's; gloo listens "
        "on 10.0.0.1 (eth0, the address of the host name machine0); NCCL may use eth0 "
        "(NCCL_SOCKET_IFNAME unset: NCCL's own choice)"
    ) in first
    assert f"preflight on machine1: it reaches 10.0.0.1:{port} from 10.0.0.2 (eth0); " in second
    assert re.search(r"^\[node 1 rank 1 local 0\] host machine1 pid \d+", second, re.MULTILINE)
    assert "preflight PASSED: 2 ranks on 2 node(s)" in first
    assert set(bus_bandwidths(first)) == {0.5, 2.0}

    # at 100 Mbit/s on both directions of every link: at most 110 Mbit/s, 0.01375 GB/s
    machines.up(machines=2, rate="100mbit")
    try:
        limited = on_machines(machines, [[*launch(n, port), *PREFLIGHT_ARGS] for n in (0, 1)])
    finally:
        machines.up(machines=2, rate="unlimited")
    assert limited[0].returncode == 0, limited[0].stdout
    for size, busbw in bus_bandwidths(limited[0].stdout).items():
        assert busbw <= 0.110 / 8, f"{size} MB at {busbw} GB/s"


WRONG_LAUNCHES = {  # id: ("node MASTER_ADDR [VARIABLE=value]", the check's line)
    "unreachable": (
        "1 10.0.0.9",
        "error: this machine (machine1) cannot reach the meeting point 10.0.0.9:{port} (No "
        "route to host): give node 0's address on the network that every node shares",
    ),
    "loopback-master": (
        "1 127.0.0.1",
        "error: MASTER_ADDR=127.0.0.1 is this machine (machine1) itself, not node 0: set it to "
        "node 0's address, the same on every node",
    ),
    "not-node-0": (
        "0 10.0.0.2",
        "error: MASTER_ADDR=10.0.0.2 is not an address of this machine (machine0 has: lo "
        "127.0.0.1, eth0 10.0.0.1): node 0 hosts the meeting point, so MASTER_ADDR must be one "
        "of its addresses that every node reaches",
    ),
    "loopback-on-node-0": (
        "0 localhost",
        "error: the meeting point localhost is the loopback (127.0.0.1), where no other machine "
        "can reach this one: give its address on the network between the nodes (machine0 has: "
        "lo 127.0.0.1, eth0 10.0.0.1)",
    ),
    "gloo-lo": (
        "1 10.0.0.1 GLOO_SOCKET_IFNAME=lo",
        "error: gloo would listen on 127.0.0.1 (lo, from GLOO_SOCKET_IFNAME=lo), which no other "
        "machine can reach: set GLOO_SOCKET_IFNAME=eth0, the interface toward 10.0.0.1",
    ),
    "gloo-missing": (
        "1 10.0.0.1 GLOO_SOCKET_IFNAME=eth1",
        "error: GLOO_SOCKET_IFNAME=eth1, but this machine (machine1) has no interface eth1 with "
        "an IPv4 address (it has: lo 127.0.0.1, eth0 10.0.0.2): name one of those, the one on "
        "the network between the nodes",
    ),
    "nccl-lo": (
        "1 10.0.0.1 NCCL_SOCKET_IFNAME=lo",
        "error: NCCL_SOCKET_IFNAME=lo leaves NCCL only the loopback (lo), which no other "
        "machine can reach: set NCCL_SOCKET_IFNAME=eth0",
    ),
}


@pytest.mark.parametrize("case", WRONG_LAUNCHES)
@pytest.mark.slow
def test_a_wrong_address_or_interface_is_one_line_before_torchrun(machines, case):
    spec, line = WRONG_LAUNCHES[case]
    node_rank, master, *settings = spec.split()
    node = int(node_rank)
    env = dict(setting.split("=") for setting in settings)
    port = free_port()
    started = subprocess.run(
        machines.run_command(node, launch(node, port, master)),
        cwd=REPO,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 2
    said = started.stderr.strip().splitlines()
    assert said[0].startswith("launch_static: ")  # the recipe's own line, then the check's
    assert said[1:] == [line.format(port=port)]


@pytest.mark.slow
def test_an_unreachable_gloo_address_fails_the_preflight_in_seconds(machines):
    """torchrun started directly (as a job script may), with no check before it: the preflight's
    own probe of the addresses gloo will listen on names the one that cannot be reached."""
    port = free_port()
    commands = [
        [*TORCHRUN, "--nnodes=2", f"--node-rank={n}", "--nproc-per-node=1"]
        + ["--master-addr=10.0.0.1", f"--master-port={port}", "05_multinode/preflight.py"]
        + PREFLIGHT_ARGS
        for n in (0, 1)
    ]
    nodes = on_machines(machines, commands, timeout=120, GLOO_SOCKET_IFNAME="lo")
    for node in nodes:
        assert node.returncode != 0, node.stdout
    out = nodes[0].stdout + nodes[1].stdout
    for rank, peer, host in ((0, 1, "machine1"), (1, 0, "machine0")):
        assert re.search(
            rf"FAILED: rank {rank} on machine{rank} cannot reach rank {peer}'s gloo address "
            rf"127\.0\.0\.1:\d+ on {host} \(lo, from GLOO_SOCKET_IFNAME=lo\): Connection refused; "
            rf"set GLOO_SOCKET_IFNAME on {host} to its interface",
            out,
        ), out
    assert "preflight FAILED: a rank cannot reach another's gloo address" in nodes[0].stdout
    assert "all-reduce check" not in out  # it stopped before the process group
