"""Chapter 05: two nodes of two processes, started by the chapter's own simulation script.

`simulate_two_nodes.sh` starts two torchrun invocations on 127.0.0.1 (through launch_static.sh or
launch_c10d.sh), as two machines would. A short corpus (part of one play) keeps the per-node data
preparation cheap. The run takes 12 steps of a global batch of 8 sequences, so its losses can be
compared with chapter 01's. The same simulation runs across two machines of machines.sh too (as
root: skipped without root or network namespaces, and with CI=true it fails instead).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers import tiny_run_args
from machines import machine_set
from two_nodes import (
    EVAL_EVERY,
    ITERS,
    PREPARING,
    assert_two_nodes_of_two,
    losses,
    simulate,
)

from common.support.corpus import shakespeare_texts
from layout import REPO
from tools.check.harness import parity
from tools.launch import run_python

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
    return losses(out)


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
    assert sorted(losses(run_dir)) == list(range(1, ITERS + 1))
    assert losses(run_dir) == pytest.approx(chapter01, rel=1e-5)
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
    assert losses(run_dir) == pytest.approx(chapter01, rel=1e-5)
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
    assert losses(run_dir) == pytest.approx(chapter01, rel=1e-5)


def test_launch_scripts_parse_and_name_existing_files():
    for name in ("launch_static.sh", "launch_c10d.sh", "simulate_two_nodes.sh", "machines.sh"):
        script = CHAPTER / name
        subprocess.run(["bash", "-n", str(script)], check=True)
        # every repository path the script names exists (paths are relative to the repository root)
        named = set(
            re.findall(r"(?<![\w/$.-])((?:0\d_\w+|common|tests)/[\w./-]+)", script.read_text())
        )
        assert named, name
        missing = [p for p in named if not (REPO / p).exists()]
        assert not missing, f"{name} names files that do not exist: {missing}"
