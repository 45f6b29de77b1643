"""Chapter 05: two nodes of two processes, started by the chapter's own simulation script.

`simulate_two_nodes.sh` starts two torchrun invocations on 127.0.0.1 (through launch_static.sh or
launch_c10d.sh), as two machines would. A short corpus (part of one play) keeps the per-node data
preparation cheap. Every run takes the same 12 steps of the same global batch of 8 sequences, so
its losses can be compared with chapter 01's, and its final model with the uninterrupted run's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import outputs_of, start, tiny_run_args

from common.metrics import read_metrics
from common.support.corpus import shakespeare_texts
from layout import REPO
from tools.launch import child_env, flags, free_port, run_python, torchrun_command

CHAPTER = REPO / "05_multinode"
TRAIN = CHAPTER / "train.py"
ITERS, EVAL_EVERY = 12, 4
# Not anchored at line starts: the processes of a node share its log, and a line of one can end
# up in the middle of another's (print writes the text and the newline separately).
START = re.compile(r"\[node (\d+) rank (\d+) local (\d+)\] process (\d+) on ")
PREPARING = re.compile(r"\[node (\d+) rank (\d+) local (\d+)\] preparing corpus .*? into (\S+)")


def train_flags(corpus: Path) -> list[str]:
    """train.py flags after the simulation's defaults: a short, deterministic tiny run."""
    return flags(
        dataset=corpus,
        max_iters=ITERS,
        eval_interval=EVAL_EVERY,
        log_interval=1,
        eval_batches=2,
        batch_size=2,
        sample_tokens=0,
        dropout=0,
    )


def losses(out_dir: Path) -> dict[int, float]:
    return {m["iter"]: m["loss"] for m in read_metrics(out_dir / "metrics.jsonl") if "loss" in m}


def node_logs(run_dir: Path) -> list[str]:
    return [
        (run_dir / f"node{node}.log").read_text() if (run_dir / f"node{node}.log").exists() else ""
        for node in (0, 1)
    ]


def stop(proc: subprocess.Popen, run_dir: Path) -> None:
    """End the simulation and everything it started, if it still runs.

    torchrun puts each training process in a session of its own, so killing the script's process
    group is not enough: SIGTERM first (the script passes it on to both torchruns, which stop their
    processes), then SIGKILL for the group and for every training process the logs name.
    """
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in {int(m[3]) for log in node_logs(run_dir) for m in START.findall(log)}:
        try:
            if "05_multinode/train.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(
                errors="replace"
            ):
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def simulate(
    run_dir: Path, corpus: Path, kill_rank: int | None = None, timeout: float = 240, **env: str
):
    """`bash 05_multinode/simulate_two_nodes.sh FLAGS`, as the chapter runs it:
    2 nodes x 2 processes.

    With kill_rank: once a checkpoint exists and a step after it is done, that global rank's
    process is killed (SIGKILL), mid-run. Returns the script's output, both node logs and the
    step of the kill."""
    output = run_dir.with_suffix(".out")  # a file, not a pipe: nobody reads a pipe while we wait
    with open(output, "w") as sink:
        proc = subprocess.Popen(
            ["bash", "05_multinode/simulate_two_nodes.sh", *train_flags(corpus)],
            cwd=REPO,
            env=child_env(RUN_DIR=str(run_dir), NPROC_PER_NODE="2", **env),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a group of its own
        )
    killed_at = None
    try:
        if kill_rank is not None:
            deadline = time.monotonic() + timeout
            while not (
                (run_dir / "ckpt.pt").exists() and max(losses(run_dir), default=0) > EVAL_EVERY
            ):
                assert time.monotonic() < deadline, f"no checkpoint within {timeout} s"
                assert proc.poll() is None, (
                    "the simulation ended before the kill:\n" + output.read_text()
                )
                time.sleep(0.02)
            victim = next(
                int(pid)
                for log in node_logs(run_dir)
                for _, rank, _, pid in START.findall(log)
                if int(rank) == kill_rank
            )
            os.kill(victim, signal.SIGKILL)
            killed_at = max(losses(run_dir))
        proc.wait(timeout=timeout)
    finally:
        stop(proc, run_dir)
    out = output.read_text()
    assert proc.returncode == 0, f"the simulation exited {proc.returncode}:\n{out}"
    return out, node_logs(run_dir), killed_at


def assert_two_nodes_of_two(logs: list[str]) -> None:
    """Global ranks 0-3 once each, local ranks 0 and 1 on each node, node ranks 0 and 1.

    Only each node's first two start lines count: the processes that torchrun restarts print
    theirs again."""
    # (node, global rank, local rank) of each start line
    per_node = [[tuple(map(int, m[:3])) for m in START.findall(log)[:2]] for log in logs]
    starts = per_node[0] + per_node[1]
    assert sorted(rank for _, rank, _ in starts) == [0, 1, 2, 3], starts
    assert sorted(node for node, _, _ in starts) == [0, 0, 1, 1], starts
    # the processes of one torchrun are on one node, with local ranks 0 and 1
    for lines in per_node:
        assert len({node for node, _, _ in lines}) == 1, lines
        assert sorted(local for _, _, local in lines) == [0, 1], lines
    # ranks are numbered node by node: global = node * processes per node + local
    assert all(rank == 2 * node + local for node, rank, local in starts), starts


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


# c10d's restart is the slow stage's (python -m pytest -m slow): the suite keeps the static one
@pytest.fixture(scope="module", params=["static", pytest.param("c10d", marks=pytest.mark.slow)])
def killed_run(request, corpus, tmp_path_factory):
    """The simulation with torchrun --max-restarts 1 and one data folder for both nodes
    (SHARED_FS=1: --shared-fs); once a checkpoint exists, global rank 3 is killed (SIGKILL)."""
    run_dir = tmp_path_factory.mktemp(f"killed-{request.param}")
    out, logs, killed_at = simulate(
        run_dir, corpus, kill_rank=3, RDZV=request.param, MAX_RESTARTS="1", SHARED_FS="1"
    )
    assert killed_at < ITERS, "the run was over before the kill"
    return run_dir, out, logs


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


def test_a_killed_worker_restarts_the_group_and_the_run_ends_with_the_uninterrupted_model(
    killed_run, static_run
):
    run_dir, out, logs = killed_run
    assert_two_nodes_of_two(logs)
    # one shared folder: global rank 0 alone prepared it, once (the restarted group found it ready)
    assert [m[:3] for log in logs for m in PREPARING.findall(log)] == [("0", "0", "0")]
    # both nodes' processes started twice, and the new group continued from the last checkpoint
    assert [len(START.findall(log)) for log in logs] == [4, 4]
    resumed = re.findall(r"restarted by torchrun \(restart 1\), from step (\d+)\n", "".join(logs))
    assert len(resumed) == 1, "".join(logs)
    assert int(resumed[0]) in range(EVAL_EVERY, ITERS, EVAL_EVERY), "".join(logs)
    # every step logged once, with the uninterrupted run's losses, and its final model. Not bit
    # for bit: the restarted processes' DDP lays out its gradient buckets afresh, which can change
    # the order in which the all-reduce adds 4 ranks' gradients (float rounding, ~1e-7 here; a
    # step on wrong data would move the parameters by ~lr = 1e-4). With 2 ranks the sums, and
    # the models, are identical.
    reference = static_run[0]
    assert losses(run_dir) == pytest.approx(losses(reference), rel=1e-6)
    final, uninterrupted = (
        torch.load(d / "ckpt.pt", weights_only=True) for d in (run_dir, reference)
    )
    assert final["iter_num"] == uninterrupted["iter_num"] == ITERS
    assert final["model"].keys() == uninterrupted["model"].keys()
    for name, tensor in uninterrupted["model"].items():
        torch.testing.assert_close(final["model"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_launch_scripts_and_slurm_script_parse_and_name_existing_files():
    for name in ("slurm.sbatch", "launch_static.sh", "launch_c10d.sh", "simulate_two_nodes.sh"):
        script = CHAPTER / name
        subprocess.run(["bash", "-n", str(script)], check=True)
        # every repository path the script names exists (paths are relative to the repository root)
        named = set(
            re.findall(r"(?<![\w/$.-])((?:0\d_\w+|common|tests)/[\w./-]+)", script.read_text())
        )
        assert named, name
        missing = [p for p in named if not (REPO / p).exists()]
        assert not missing, f"{name} names files that do not exist: {missing}"
    slurm = (CHAPTER / "slurm.sbatch").read_text()
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in slurm
    assert "#SBATCH --ntasks-per-node=1" in slurm
    assert "srun" in slurm
    assert "05_multinode/train.py" in slurm
    assert "05_multinode/preflight.py" in slurm
    # the c10d recipes give every restarted group a fresh store, which the killed-worker
    # test relies on
    for name in ("slurm.sbatch", "launch_c10d.sh"):
        text = (CHAPTER / name).read_text()
        assert "\nexport TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in text, name


def test_a_checkpoint_that_some_nodes_cannot_see_is_one_clear_error(static_run, corpus, tmp_path):
    """--out-dir on node-local disks: node 0 finds rank 0's checkpoint, node 1 does not; resuming
    would put the nodes at different steps, so every rank stops with one line naming rank 1."""
    run_dir = static_run[0]
    seen_by_node0 = tmp_path / "node0-out"
    seen_by_node0.mkdir()
    shutil.copy(run_dir / "ckpt.pt", seen_by_node0)
    port = free_port()
    procs, out_dirs = [], [seen_by_node0, tmp_path / "node1-out"]
    for node, out in enumerate(out_dirs):
        args = tiny_run_args(
            run_dir / f"node{node}" / "data", out, max_iters=ITERS, dataset=corpus, resume=True
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
