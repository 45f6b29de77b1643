"""Chapter 05: two nodes of two processes, started by the chapter's own simulation script."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import outputs_of, tiny_run_args, train_losses
from machines import machine_set, static_launch
from two_nodes import (
    EVAL_EVERY,
    ITERS,
    PREPARING,
    assert_two_nodes_of_two,
    simulate,
)

from common.support.corpus import shakespeare_texts
from layout import REPO
from tools.check.harness import parity
from tools.launch import child_env, free_port, run_python

CHAPTER = REPO / "05_multinode"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(shakespeare_texts()[0][:60_000])  # about 18,000 tokens
    return path


@pytest.fixture(scope="module")
def static_run(corpus, tmp_path_factory):
    """The chapter's simulation with its defaults: static rendezvous, a data folder per node (as
    node-local disks), never interrupted."""
    run_dir = tmp_path_factory.mktemp("static")
    out, logs, _ = simulate(run_dir, corpus)
    return run_dir, out, logs


@pytest.fixture(scope="module")
def chapter01(corpus, static_run, tmp_path_factory) -> dict[int, float]:
    """Chapter 01's losses with the same global batch of 8 (on the corpus node 0 prepared)."""
    run_dir = static_run[0]
    out = tmp_path_factory.mktemp("ch01")
    run_python(
        [
            REPO / "01_single_gpu" / "train.py",
            *tiny_run_args(
                run_dir / "node0" / "data",
                out,
                max_iters=ITERS,
                eval_interval=EVAL_EVERY,
                dataset=corpus,
                batch_size=8,
            ),
        ]
    )
    return train_losses(out)


def test_two_nodes_are_chapter_01s_run_step_by_step_and_resume(tmp_path):
    """The parity harness (tools/check/harness.py): two nodes of one process each, in float64,
    every step's windows, loss, learning rate, gradient norm and parameters on every rank are
    chapter 01's; stopped after step 5 and resumed too."""
    assert parity(CHAPTER / "train.py", nproc=2, root=tmp_path, resume=True) is None


def test_simulation_static_rendezvous_ranks_node_local_preparation_and_losses(
    static_run, chapter01
):
    run_dir, out, logs = static_run
    assert f"node logs:       {run_dir}/node0.log  {run_dir}/node1.log" in out
    assert_two_nodes_of_two(logs)
    # node-local disks: local rank 0 of each node prepared its own node's folder, once
    prepared = sorted(m for log in logs for m in PREPARING.findall(log))
    assert [m[:3] for m in prepared] == [("0", "0", "0"), ("1", "2", "0")]
    for node, (_, _, _, folder) in enumerate(prepared):
        assert Path(folder).parent == run_dir / f"node{node}" / "data"
        assert (Path(folder) / "train.bin").exists()
    # the same optimizer steps as chapter 01 with the same global batch
    assert sorted(train_losses(run_dir)) == list(range(1, ITERS + 1))
    assert train_losses(run_dir) == pytest.approx(chapter01, rel=1e-5)
    assert "parameters identical on all 4 rank(s): yes" in logs[0]


@pytest.fixture(scope="module")
def machines():
    """Two machines of their own (05_multinode/machines.sh); skipped without root (a laptop)."""
    with machine_set(machines=2) as made:
        yield made


def assert_on_own_machines(logs: list[str]) -> None:
    """Node N's processes ran on machine N: the host name each process prints."""
    for node, log in enumerate(logs):
        hosts = set(re.findall(rf"\[node {node} rank \d+ local \d+\] process \d+ on (\w+):", log))
        assert hosts == {f"machine{node}"}, log


@pytest.mark.slow
def test_across_two_machines_static_rendezvous_node_local_data_equals_chapter01(
    machines, corpus, chapter01, tmp_path
):
    run_dir = tmp_path / "run"
    out, logs, _ = simulate(run_dir, corpus, MACHINES=machines.prefix)
    assert "on machines 0 and 1 of " in out
    assert "static rendezvous on 10.0.0.1:" in out  # machine 0's address, not 127.0.0.1
    assert_two_nodes_of_two(logs)
    assert_on_own_machines(logs)
    prepared = sorted(m for log in logs for m in PREPARING.findall(log))
    assert [m[:3] for m in prepared] == [("0", "0", "0"), ("1", "2", "0")]
    assert train_losses(run_dir) == pytest.approx(chapter01, rel=1e-5)
    assert "parameters identical on all 4 rank(s): yes" in logs[0]


@pytest.mark.slow
def test_across_two_machines_c10d_rendezvous_shared_fs_equals_chapter01(
    machines, corpus, chapter01, tmp_path
):
    run_dir = tmp_path / "run"
    out, logs, _ = simulate(run_dir, corpus, MACHINES=machines.prefix, RDZV="c10d", SHARED_FS="1")
    assert "c10d rendezvous on 10.0.0.1:" in out
    assert_two_nodes_of_two(logs)
    assert_on_own_machines(logs)  # c10d orders the nodes by host name: machine0 first
    # one file system: global rank 0 alone prepared the token files
    prepared = [m for log in logs for m in PREPARING.findall(log)]
    assert [m[:3] for m in prepared] == [("0", "0", "0")]
    assert train_losses(run_dir) == pytest.approx(chapter01, rel=1e-5)


# A node whose peer never comes ends by itself: the launch recipes wait as long as the run's
# --dist-timeout, then name what they waited for. START_UP: the recipe's own seconds before it
# waits (its network check, without torch), on a busy machine.
WAIT, START_UP = 5, 60


@pytest.mark.parametrize("recipe", ["static node 0", "static node 1", "c10d"])
def test_a_node_whose_peer_never_comes_ends_by_itself_in_one_line(recipe):
    port = free_port()
    if recipe == "c10d":
        settings = {"RDZV_ENDPOINT": f"127.0.0.1:{port}"}
        script = "launch_c10d.sh"
        line = (
            f"error: waited {WAIT} s at 127.0.0.1:{port} for 1 more of 2 nodes, which "
            "never came (came besides this one: none): start every node with the same "
            "RDZV_ENDPOINT and RDZV_ID, and read the missing nodes' own error"
        )
    else:
        node = recipe.split()[-1]
        settings = {"NODE_RANK": node, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        script = "launch_static.sh"
        if node == "0":
            line = (
                f"error: waited {WAIT} s at 127.0.0.1:{port} for node rank(s) 1 of 2, which "
                "never came: start every node with the same MASTER_ADDR and MASTER_PORT, and "
                "read the missing nodes' own error"
            )
        else:
            line = (
                f"error: waited {WAIT} s for node rank 0 at 127.0.0.1:{port}, which never "
                "came: start it with the same address and port, and read its own error"
            )
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", f"05_multinode/{script}", "--dist-timeout", str(WAIT)],
        cwd=REPO,
        env=child_env(SAME_MACHINE="1", NPROC_PER_NODE="1", **settings),
        capture_output=True,
        text=True,
        timeout=WAIT + START_UP,
    )
    assert time.monotonic() - started >= WAIT  # it waited, and then ended by itself
    assert proc.returncode == 2, proc.stderr
    said = proc.stderr.strip().splitlines()
    assert said[-1] == line
    assert said[1].startswith(f"preflight on {socket.gethostname()}: ")  # then it waited
    assert len(said) == 3, proc.stderr  # the recipe's line, the check's, and the end's


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_across_machines_a_wrong_interface_ends_both_nodes_in_one_line_each(machines, rdzv):
    """Node 1 with a GLOO_SOCKET_IFNAME that its machine lacks ends at once; node 0 waits for it
    as long as the run's --dist-timeout, and ends too. Each says why in one line."""
    port = free_port()
    commands = []
    for node in (0, 1):
        if rdzv == "static":
            launch = static_launch("05_multinode/train.py", node, port)
        else:
            settings = [f"RDZV_ENDPOINT=10.0.0.1:{port}", "NPROC_PER_NODE=1"]
            launch = ["env", *settings, "bash", "05_multinode/launch_c10d.sh"]
        if node == 1:
            launch = ["env", "GLOO_SOCKET_IFNAME=eth1", *launch]
        commands.append(machines.run_command(node, [*launch, "--dist-timeout", str(WAIT)]))
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            command,
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for command in commands
    ]
    try:
        said = [proc.communicate(timeout=WAIT + START_UP)[1] for proc in procs]
    finally:
        outputs_of(procs, timeout=1)  # anything still running is stopped
    assert time.monotonic() - started < WAIT + START_UP
    for proc, out in zip(procs, said):
        assert proc.returncode == 2, out
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and out.strip().endswith(errors[0]), out
    assert said[1].strip().splitlines()[-1] == (
        "error: GLOO_SOCKET_IFNAME=eth1, but this machine (machine1) has no interface eth1 with "
        "an IPv4 address (it has: lo 127.0.0.1, eth0 10.0.0.2): name one of those, the one on "
        "the network between the nodes"
    )
    if rdzv == "static":
        waited_for = (
            "for node rank(s) 1 of 2, which never came: start every node with the same "
            "MASTER_ADDR and MASTER_PORT, and read the missing nodes' own error"
        )
    else:
        waited_for = (
            "for 1 more of 2 nodes, which never came (came besides this one: none): start every "
            "node with the same RDZV_ENDPOINT and RDZV_ID, and read the missing nodes' own error"
        )
    expected = f"error: waited {WAIT} s at 10.0.0.1:{port} {waited_for}"
    assert said[0].strip().splitlines()[-1] == expected


def test_launch_scripts_parse_and_name_existing_files():
    scripts = ["launch_static.sh", "launch_c10d.sh", "simulate_two_nodes.sh", "machines.sh"]
    for script in [*(CHAPTER / name for name in scripts), REPO / "06_fault_tolerance/slurm.sbatch"]:
        name = script.name
        subprocess.run(["bash", "-n", str(script)], check=True)
        # every repository path the script names exists (paths are relative to the repository root)
        named = set(
            re.findall(r"(?<![\w/$.-])((?:0\d_\w+|common|tests)/[\w./-]+)", script.read_text())
        )
        assert named, name
        missing = [p for p in named if not (REPO / p).exists()]
        assert not missing, f"{name} names files that do not exist: {missing}"
