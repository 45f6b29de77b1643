"""Chapter 06: the two-node simulation of chapter 05 under the c10d rendezvous, running chapter
06's script, survives a killed rank: torchrun restarts the group, which meets in a fresh store
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) through chapter 04's init_process_group, and continues
from its last checkpoint to chapter 01's end."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from helpers import assert_same_run, outputs_of, start, tiny_run_args, train_losses
from two_nodes import (
    EVAL_EVERY,
    ITERS,
    PREPARING,
    START,
    assert_two_nodes_of_two,
    simulate,
)

from common.support.corpus import shakespeare_texts
from layout import REPO
from tools.launch import free_port, run_python, torchrun_command

CHAPTER = REPO / "06_fault_tolerance"
TRAIN = CHAPTER / "train.py"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(shakespeare_texts()[0][:60_000])  # about 18,000 tokens
    return path


@pytest.fixture(scope="module")
def chapter01(corpus, tmp_path_factory) -> Path:
    """Chapter 01's run with the same global batch of 8: the run folder of the uninterrupted run."""
    out = tmp_path_factory.mktemp("ch01")
    data = tmp_path_factory.mktemp("data")
    run_python(
        [
            REPO / "01_single_gpu" / "train.py",
            *tiny_run_args(
                data, out, max_iters=ITERS, eval_interval=EVAL_EVERY, dataset=corpus, batch_size=8
            ),
        ]
    )
    return out


# Restarts are taught under c10d alone: under the static rendezvous torchrun's store outlives a
# restart (pytorch/pytorch#135712), and chapter 06's page says so.
@pytest.fixture(scope="module")
def killed_run(corpus, tmp_path_factory):
    """Chapter 06 in the simulation under c10d, with torchrun --max-restarts 1 and one data folder
    for both nodes (SHARED_FS=1: --shared-fs); once a checkpoint exists, SIGKILL kills global
    rank 3."""
    run_dir = tmp_path_factory.mktemp("killed")
    out, logs, killed_at = simulate(
        run_dir,
        corpus,
        kill_rank=3,
        SCRIPT="06_fault_tolerance/train.py",
        RDZV="c10d",
        MAX_RESTARTS="1",
        SHARED_FS="1",
    )
    assert killed_at < ITERS, "the run was over before the kill"
    return run_dir, out, logs


def test_a_killed_worker_restarts_the_group_and_the_run_ends_with_chapter_01s_model(
    killed_run, chapter01
):
    run_dir, out, logs = killed_run
    assert_two_nodes_of_two(logs)
    # one shared folder: global rank 0 alone prepared it, once (the restarted group found it ready)
    assert [m[:3] for log in logs for m in PREPARING.findall(log)] == [("0", "0", "0")]
    # both nodes' processes started twice, and the new group continued from the last checkpoint
    assert [len(START.findall(log)) for log in logs] == [4, 4]
    resumed = re.findall(r"resuming from \S+ckpt\.pt at step (\d+)\n", "".join(logs))
    assert len(resumed) == 1, "".join(logs)
    assert int(resumed[0]) in range(EVAL_EVERY, ITERS, EVAL_EVERY), "".join(logs)
    # every step logged once, with chapter 01's losses, and its final model. Not bit for bit: 4
    # ranks add the gradients in another order than one process (float rounding, ~1e-7 here); a
    # step on wrong data would move the parameters by ~lr = 1e-4.
    assert sorted(train_losses(run_dir)) == list(range(1, ITERS + 1))
    assert_same_run(run_dir, chapter01)


def test_the_c10d_recipes_give_a_restarted_group_a_fresh_store():
    """The killed-worker test above relies on it (slurm.sbatch is parsed in test_chapter05)."""
    for recipe in (CHAPTER / "slurm.sbatch", REPO / "05_multinode" / "launch_c10d.sh"):
        assert "\nexport TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in recipe.read_text(), recipe


def test_a_checkpoint_that_some_nodes_cannot_see_is_one_clear_error(chapter01, corpus, tmp_path):
    """--out-dir on node-local disks: node 0 finds rank 0's checkpoint, node 1 does not; resuming
    would put the nodes at different steps, so every rank stops with one line naming rank 1."""
    seen_by_node0 = tmp_path / "node0-out"
    seen_by_node0.mkdir()
    shutil.copy(chapter01 / "ckpt.pt", seen_by_node0)
    port = free_port()
    procs, out_dirs = [], [seen_by_node0, tmp_path / "node1-out"]
    for node, out in enumerate(out_dirs):
        args = tiny_run_args(
            tmp_path / f"node{node}-data", out, max_iters=ITERS, dataset=corpus, resume=True
        )
        procs.append(start(torchrun_command(TRAIN, 1, args, nnodes=2, node_rank=node, port=port)))
    outputs = outputs_of(procs, timeout=120)
    assert all(proc.returncode != 0 for proc in procs), outputs
    for rank, out in enumerate(outputs):
        assert (
            f"[rank {rank}] error: ranks [1] cannot see {out_dirs[rank] / 'ckpt.pt'}, "
            "which rank 0 wrote: "
            "put --out-dir on a file system that every node shares\n"
        ) in out, out
        # no traceback of the process's own (torchrun adds one of its own)
        assert f"[rank{rank}]: Traceback" not in out
