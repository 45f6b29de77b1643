"""The two-node simulation as the chapters run it (05_multinode/simulate_two_nodes.sh), for the
tests of chapters 05 and 06: the run, its node logs, the kill of one rank, and the end of
everything it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from helpers import train_losses

from layout import REPO
from tools.launch import child_env, flags

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


def node_logs(run_dir: Path) -> list[str]:
    return [
        (run_dir / f"node{node}.log").read_text() if (run_dir / f"node{node}.log").exists() else ""
        for node in (0, 1)
    ]


def stop(proc: subprocess.Popen, run_dir: Path) -> None:
    """End the simulation and all it started: SIGTERM (passed on to both torchruns), then SIGKILL
    for the group and every training process the logs name (each in a session of its own)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in {int(m[3]) for log in node_logs(run_dir) for m in START.findall(log)}:
        try:
            if "/train.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def simulate(
    run_dir: Path, corpus: Path, kill_rank: int | None = None, timeout: float = 240, **env: str
):
    """`bash 05_multinode/simulate_two_nodes.sh FLAGS`, 2 nodes x 2 processes (env: its
    settings); with kill_rank, that rank is SIGKILLed after a checkpoint and a step."""
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
                (run_dir / "ckpt.pt").exists()
                and max(train_losses(run_dir), default=0) > EVAL_EVERY
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
            killed_at = max(train_losses(run_dir))
        proc.wait(timeout=timeout)
    finally:
        stop(proc, run_dir)
    out = output.read_text()
    assert proc.returncode == 0, f"the simulation exited {proc.returncode}:\n{out}"
    return out, node_logs(run_dir), killed_at


def assert_two_nodes_of_two(logs: list[str]) -> None:
    """Global ranks 0-3 once each, local ranks 0 and 1 on each node, node ranks 0 and 1 (each
    node's first two start lines: restarted processes print theirs again)."""
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
