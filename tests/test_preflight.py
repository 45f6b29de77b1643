"""05_multinode/preflight.py: run under real torchrun, two nodes of one process on 127.0.0.1."""

from __future__ import annotations

import re
import subprocess

from helpers import outputs_of, start

from layout import REPO
from tools.launch import run_python, two_node_commands

PREFLIGHT = REPO / "05_multinode" / "preflight.py"


def run_two_nodes(
    script, nproc: int, args: list[str], timeout: float = 120
) -> list[subprocess.CompletedProcess]:
    """Both nodes' torchrun started at once (each waits for the other), then both awaited."""
    # a session of its own for each torchrun; it puts its processes in sessions of their own too,
    # and stops them when it gets SIGTERM
    procs = [start(cmd) for cmd in two_node_commands(script, nproc, args)]
    outputs = outputs_of(procs, timeout)
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out, "") for p, out in zip(procs, outputs)
    ]


def test_preflight_on_two_nodes_checks_all_reduce_and_measures_bandwidth():
    nodes = run_two_nodes(PREFLIGHT, 1, ["--sizes-mb", "0.1,1", "--iters", "3", "--timeout", "60"])
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
