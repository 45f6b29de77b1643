"""05_multinode/preflight.py: run under real torchrun, two nodes of one process on 127.0.0.1."""

from __future__ import annotations

import re
import subprocess

from common.launch import REPO, child_env, free_port, run_python, stop_launchers, torchrun_command

PREFLIGHT = REPO / "05_multinode" / "preflight.py"


def run_two_nodes(
    script, nproc: int, args: list[str], timeout: float = 120
) -> list[subprocess.CompletedProcess]:
    """Both nodes' torchrun started at once (each waits for the other), then both awaited."""
    port = free_port()
    # a session of its own for each torchrun; it puts its processes in sessions of their own too,
    # and stops them when it gets SIGTERM
    procs = [
        subprocess.Popen(
            torchrun_command(script, nproc, args, nnodes=2, node_rank=node, port=port),
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    finally:
        stop_launchers(procs)
    return results


def test_preflight_on_two_nodes_checks_all_reduce_and_measures_bandwidth():
    nodes = run_two_nodes(PREFLIGHT, 1, ["--sizes-mb", "0.1,1", "--iters", "3", "--timeout", "60"])
    for node in nodes:
        assert node.returncode == 0, node.stdout
    out = nodes[0].stdout + nodes[1].stdout

    # every rank introduces itself, with its ranks and the variables that matter
    intro = re.findall(
        r"^\[node (\d) rank (\d) local (\d)\] host \S+ pid \d+, world size 2, device cpu, backend gloo",
        out,
        re.MULTILINE,
    )
    assert sorted(intro) == [("0", "0", "0"), ("1", "1", "0")]
    assert (
        "MASTER_ADDR=127.0.0.1" in out
        and "NCCL_SOCKET_IFNAME=" in out
        and "TORCHELASTIC_RESTART_COUNT=0" in out
    )
    assert (
        "TORCHELASTIC_USE_AGENT_STORE=True" in out
    )  # the static rendezvous: torchrun's store, prefixed per attempt

    # the known sum (1 + 2 = 3) arrived on both ranks
    assert len(re.findall(r"all-reduce check: OK \(sum of rank\+1 = 3\)", out)) == 2
    assert "preflight PASSED: 2 ranks on 2 node(s)" in nodes[0].stdout

    # rank 0's table: one row per size; with 2 ranks, busbw = algbw * 2(W-1)/W = algbw
    rows = re.findall(r"^\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", nodes[0].stdout, re.MULTILINE)
    assert [float(r[0]) for r in rows] == [0.1, 1.0]
    for size, ms, algbw, busbw in rows:
        assert float(ms) > 0 and float(algbw) > 0 and busbw == algbw


def test_preflight_outside_torchrun_is_one_clear_error():
    proc = run_python([PREFLIGHT], check=False, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: preflight.py runs under torchrun, e.g. torchrun --standalone --nproc_per_node=2 05_multinode/preflight.py"
    ]
