"""What the chapters' notebooks share: run a chapter's script as a reader would, read and plot
its losses.

A notebook imports this module once, in its setup cell, and calls setup(): one torch thread (the
experiments are small, and one thread keeps them repeatable). Importing it makes a fresh folder for
the notebook's runs under out/ (removed by clean_up(), the notebook's last cell) and names the data
folder: $COURSE_DATA_DIR if set (the tests prepare the corpus once for all notebooks), else data/,
as the chapters' scripts default to. Everything it prints names paths relative to the course's
root, so a notebook's saved outputs say nothing about the machine that ran it.

No chapter's train.py imports it: the notebooks start the scripts, as a reader does in a terminal.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown

from common.data import load_splits, prepare
from common.metrics import read_metrics
from common.model import GPT, model_config
from tools.launch import (
    REPO,
    child_env,
    flags,
    measured_run_flags,
    run_together,
    shown_command,
    torchrun_command,
    two_node_commands,
)


def shown_path(path: str | Path) -> str:
    """A path relative to the course's root when it lies inside: as the notebook prints it, and
    as the commands it runs from the root get it (so that their own output names no folder of
    this machine)."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def words(cmd: list) -> list[str]:
    """A command's words as strings, its paths (the Path objects) relative to the course's root."""
    return [shown_path(word) if isinstance(word, Path) else str(word) for word in cmd]


(REPO / "out").mkdir(exist_ok=True)
RUNS = Path(tempfile.mkdtemp(prefix="notebook_", dir=REPO / "out"))  # this notebook's runs go here
# The data folder: prepared once, shared by all chapters
DATA_DIR = Path(os.environ.get("COURSE_DATA_DIR", REPO / "data"))

ITERS = 15  # optimizer steps per run: enough to see the loss fall, a few seconds each
# tiny model, float32 on the CPU, no dropout, a short warm-up and a high learning rate (so 15
# steps show learning), a metrics line every step: a deterministic run
TINY = measured_run_flags(
    ITERS, log_interval=1, eval_batches=2, preset="tiny", warmup_iters=2, lr=1e-2
)
TINY += flags(device="cpu", dtype="float32", data_dir=shown_path(DATA_DIR))
# One thread per process (several processes share the laptop's cores); no GPU, so every
# machine runs the very same CPU computation.
# PYTHONPATH: the worker below is a file of tests/workers, started by its path
RUN_ENV = child_env(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))

# What each rank of a torchrun job does, by hand: the program that notebooks 04 and 05 start
WORKER = REPO / "tests" / "workers" / "rank_worker.py"
# The global batch of the notebooks' experiments: 8 sequences, as chapter 01's reference run
# reads them
SEED, GLOBAL_BATCH = 1337, 8


def setup() -> None:
    """The setup cell's call: one torch thread for this kernel; where its runs and data go."""
    torch.set_num_threads(1)
    print("paths are relative to the course root, the folder that holds common/")
    print(f"runs: {shown_path(RUNS)}\ndata: {shown_path(DATA_DIR)}\ntorch {torch.__version__}")


def show_source(path: Path) -> Markdown:
    """A program's source as the cell's result, so Jupyter shows it highlighted, as in an editor."""
    return Markdown(f"`{shown_path(path)}`:\n```python\n{path.read_text()}```")


def run(cmd: list, show: int = 6, timeout: float = 300) -> str:
    """Run cmd from the course root; print the command and the last `show` lines of its output."""
    cmd = words(cmd)
    print("$", shown_command(cmd))
    proc = subprocess.run(
        cmd, cwd=REPO, env=RUN_ENV, capture_output=True, text=True, timeout=timeout
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"exit status {proc.returncode}:\n{output[-3000:]}")
    lines = output.strip().splitlines() if show else []
    if len(lines) > show + 2:  # the first lines (device, global batch) and the last ones
        lines = lines[:2] + ["..."] + lines[-show:]
    if lines:
        print("\n".join(lines))
    return output


def torchrun(script: str | Path, nproc: int, *args, show: int = 6) -> str:
    """`torchrun --standalone --nproc-per-node=NPROC script args` on this machine: the output
    of all ranks."""
    return run(torchrun_command(*words([script]), nproc, words(list(args))), show=show)


def two_nodes(per_node: int, script: str | Path, *args, show: int = 4) -> list[str]:
    """Start one torchrun per "node", as you would on two machines, and wait for both:
    their outputs."""
    commands = two_node_commands(*words([script]), per_node, words(list(args)))
    for node, cmd in enumerate(commands):
        print(f"node {node}: $ {shown_command(cmd)}")
    paths = [RUNS / f"node{node}.log" for node in (0, 1)]
    logs = [path.open("w") for path in paths]
    try:
        # when one node fails, the other is stopped at once instead of waiting for it
        status = run_together(commands, RUN_ENV, logs, timeout=300)
    finally:
        for log in logs:
            log.close()
    outputs = [path.read_text() for path in paths]
    if status != 0:
        raise RuntimeError(f"exit status {status}:\n" + "\n".join(out[-3000:] for out in outputs))
    for node, out in enumerate(outputs):
        tail = (
            [line for line in out.strip().splitlines() if "RESULT " not in line][-show:]
            if show
            else []
        )
        if tail:
            print(f"--- node {node}, its last lines:\n" + "\n".join(tail))
    return outputs


def train(chapter: str, name: str, *flags) -> list[dict]:
    """python <chapter>/train.py with the tiny settings; returns its metrics.jsonl lines."""
    run([sys.executable, f"{chapter}/train.py", *TINY, "--out-dir", RUNS / name, *flags])
    return read_metrics(RUNS / name / "metrics.jsonl")


def losses(metrics: list[dict]) -> list[float]:
    return [m["loss"] for m in metrics if "loss" in m]


def plot_losses(runs: dict[str, list[dict]], title: str) -> None:
    """Training loss against tokens seen, one line per run: overlapping lines mean the same run."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    styles = [
        dict(lw=4, alpha=0.35),
        dict(ls="--", marker="x"),
        dict(ls=":", marker="o", mfc="none"),
    ]
    for (label, metrics), style in zip(runs.items(), styles * 3):
        rows = [m for m in metrics if "loss" in m]
        ax.plot([m["tokens_seen"] for m in rows], [m["loss"] for m in rows], label=label, **style)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    plt.show()


def compare(reference: list[dict], other: list[dict]) -> float:
    """Largest difference between two runs' per-step training losses."""
    a, b = losses(reference), losses(other)
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def first_batch() -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Chapter 01's first global batch with the tiny model: its windows, x and y, each (8, T)."""
    config = model_config("tiny", dropout=0.0)
    train_set, _ = load_splits(
        prepare("shakespeare", DATA_DIR, log=lambda *a: None), config.block_size
    )
    # epoch 0's order, as every chapter draws it
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(SEED))
    windows = order[:GLOBAL_BATCH].tolist()
    x = torch.stack([train_set[i][0] for i in windows])
    y = torch.stack([train_set[i][1] for i in windows])
    return windows, x, y


def tiny_model() -> GPT:
    """The tiny GPT as every run here starts it: the same seed, so the same weights everywhere."""
    torch.manual_seed(SEED)
    return GPT(model_config("tiny", dropout=0.0))


def full_batch_gradient() -> tuple[list[int], torch.Tensor]:
    """One process, the whole global batch of 8: the gradient, flattened, that DDP's average
    must equal."""
    order, x, y = first_batch()
    model = tiny_model()
    _, loss = model(x, y)
    loss.backward()
    return order, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def results(output: str) -> list[dict]:
    """Every rank's RESULT (printed by tests/workers/rank_worker.py), as a dict, in rank order.

    Read object by object, not line by line: the ranks share one output pipe, and two lines can
    come out glued together."""
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(part)[0] for part in output.split("RESULT ")[1:]]
    return sorted(rows, key=lambda r: r["rank"])


def clean_up() -> None:
    """Remove this notebook's runs (checkpoints included): they were only for this notebook."""
    shutil.rmtree(RUNS, ignore_errors=True)
    print(f"removed {shown_path(RUNS)}")
