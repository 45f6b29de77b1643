# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 06 — surviving failures and stops
#
# A job of many machines for many hours meets two things a short run rarely does:
#
# * **a process dies.** With `--max-restarts=N`, torchrun starts the whole group again. Under the
#   c10d rendezvous with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` every round meets in a fresh store,
#   so the new processes join with chapter 04's `init_process_group`, agree that they were
#   restarted (`agree_on_restart`), and continue from the last checkpoint.
# * **the scheduler stops the job** with SIGTERM. The ranks agree on a step (every 10 steps they
#   all-reduce a stop flag), rank 0 saves it, and every rank ends with status 0; whoever asked for
#   the stop continues the job with `--resume`.
#
# Both are shown here on chapter 05's two "nodes" on this machine, one process each: two `torchrun`
# commands that meet on 127.0.0.1 (c10d). Each run has a global batch of 8 and must end as chapter
# 01's.

# %%
# Setup: import the notebooks' helpers (tools/notebook.py) from the course's root folder,
# the first folder above Jupyter's that holds common/
import sys
from pathlib import Path

sys.path.insert(
    0, str(next((p for p in [Path.cwd(), *Path.cwd().parents] if (p / "common").is_dir()), ""))
)
from tools.notebook import ITERS, RUNS, TINY, clean_up, compare, plot_losses, setup, train

setup()

# %%
# Chapter 01's run with a global batch of 8 sequences: the reference every run here must match
ref = train("01_single_gpu", "ch01", "--batch-size", "8")

# %% [markdown]
# ## Two nodes, started as a reader starts them
#
# `start(...)` opens one `torchrun` per node in the background, each writing its node's log, as
# two terminals would; `wait_for(...)` waits for a line in a log; `show(...)` prints the lines of
# the logs that match. Every rank's first line gives its process id, the PID a `kill` needs.

# %%
import re
import time

from tools.launch import free_port, start_together, torchrun_command, wait_together
from tools.notebook import RUN_ENV, shown_command, shown_path, words

SCRIPT = "06_fault_tolerance/train.py"
# a fresh store for every round of the rendezvous, as launch_c10d.sh sets it
C10D_ENV = {**RUN_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def start(run: Path, *flags, restarts: int = 0, eval_every: int = ITERS) -> list:
    """Both nodes' torchruns, one process each, started in the background: a checkpoint every
    `eval_every` steps, and up to `restarts` restarts after a failure."""
    port = free_port()  # the rendezvous's meeting point, on 127.0.0.1
    tiny = list(TINY)
    tiny[tiny.index("--eval-interval") + 1] = str(eval_every)
    args = words([*tiny, "--batch-size", "4", "--shared-fs", "--out-dir", run, *flags])
    extra = [f"--max-restarts={restarts}"]
    commands = [
        torchrun_command(SCRIPT, 1, args, nnodes=2, port=port, extra=extra, rdzv_id=f"nb{port}")
        for _ in (0, 1)
    ]
    run.mkdir(parents=True, exist_ok=True)
    logs = [(run / f"node{node}.log").open("w") for node in (0, 1)]
    for node, command in enumerate(commands):
        print(f"node {node}: $ {shown_command(command)}")
    procs = start_together(commands, C10D_ENV, logs)
    for log in logs:
        log.close()  # each torchrun writes to its own copy of the file
    return procs


def wait_for(run: Path, pattern: str) -> re.Match:
    """The first match of `pattern` in either node's log, once the run has written it. (c10d
    numbers the nodes itself: either log may be node 0's.)"""
    for _ in range(1200):  # two minutes at most
        for node in (0, 1):
            found = re.search(pattern, (run / f"node{node}.log").read_text())
            if found:
                return found
        time.sleep(0.1)
    raise TimeoutError(f"{pattern!r} not in the logs of {shown_path(run)}")


def show(run: Path, pattern: str) -> None:
    """The lines of both nodes' logs that match `pattern`, up to " of binary" (a path)."""
    for node in (0, 1):
        for line in (run / f"node{node}.log").read_text().splitlines():
            if re.search(pattern, line):
                print(f"node {node}: {line.split(' of binary')[0]}")


# %% [markdown]
# ## A restart
#
# torchrun may restart the group once. The run writes a checkpoint every 5 steps; right after the
# first, rank 1 (node 1's one process) is killed with `kill -9`, as a failing GPU or a machine
# that reboots would end it.

# %%
import os
import signal

from common.metrics import read_metrics

restart = RUNS / "restart"
procs = start(restart, restarts=1, eval_every=5)
wait_for(restart, r"step 5: val loss")
pid = int(wait_for(restart, r"\[node 1 rank 1 local 0\] process (\d+)").group(1))
os.kill(pid, signal.SIGKILL)
print(f"killed rank 1 (process {pid}) after the checkpoint of step 5")
status = wait_together(procs, timeout=300)
print(f"both torchruns ended with status {status}\n")
show(restart, r"exitcode|resuming from|identical")

after_restart = read_metrics(restart / "metrics.jsonl")
plot_losses(
    {"01: 1 process, batch 8": ref, "06: killed after step 5, restarted": after_restart},
    "A restarted run is chapter 01's run",
)
print(f"largest per-step loss difference: {compare(ref, after_restart):.2e}")
assert status == 0
assert compare(ref, after_restart) < 1e-4

# %% [markdown]
# Whatever was trained between the checkpoint and the kill is trained again: the restarted group
# went back to step 5. `metrics.jsonl` still holds every step once, as the restarted rank 0
# rewrote what came after its checkpoint.
#
# ## A stop
#
# A new run, without restarts. After step 3, rank 1 alone gets SIGTERM, as a scheduler's signal
# may reach some processes before others. Rank 0 never gets it, yet both stop after the same step:
# the next stop check, step 10.

# %%
stop = RUNS / "stop"
procs = start(stop)
wait_for(stop, r"iter +3 \|")
pid = int(wait_for(stop, r"\[node 1 rank 1 local 0\] process (\d+)").group(1))
os.kill(pid, signal.SIGTERM)
print(f"SIGTERM to rank 1 (process {pid}) after step 3")
status = wait_together(procs, timeout=300)
print(f"both torchruns ended with status {status}\n")
show(stop, r"exitcode|stopped by")
assert status == 0

# %% [markdown]
# Every worker ends with status 0: the run did what it was asked, so torchrun, which restarts
# only failed workers, restarts nothing, and the stop stays final. The checkpoint holds step 10.
# Whoever asked for the stop knows it was one (on Slurm, `slurm.sbatch` requeues the job); here,
# the same command with `--resume` continues from it.

# %%
procs = start(stop, "--resume")
status = wait_together(procs, timeout=300)
print(f"both torchruns ended with status {status}\n")
show(stop, r"resuming from|identical")

after_stop = read_metrics(stop / "metrics.jsonl")
plot_losses(
    {"01: 1 process, batch 8": ref, "06: stopped after step 10, resumed": after_stop},
    "A stopped and resumed run is chapter 01's run",
)
print(f"largest per-step loss difference: {compare(ref, after_stop):.2e}")
assert status == 0
assert compare(ref, after_stop) < 1e-4

# %% [markdown]
# ## Questions
#
# * The restart went back to step 5, though rank 1 died later. What decides how much work a
#   failure costs? (The steps since the last checkpoint: `--eval-interval` sets how often one is
#   written, against the time each one takes.)
# * On two real machines, why must `--out-dir` be on a file system both see? (Rank 0 writes the
#   checkpoint; after a restart every rank loads it. A rank that cannot see it is refused with one
#   line: `agree_on_restart`.)
# * Rank 1 got the signal, but rank 0 saved the step. What would happen if rank 1 simply stopped
#   alone? (Rank 0 would wait for it in its next all-reduce until `--dist-timeout`, and no step
#   would be saved.)
# * Why status 0 after a stop, and not a status of its own? (torchrun restarts a worker that ends
#   with any other status, which would then train on alone; the launch that asked for the stop
#   knows it was one, and requeues the job.)

# %%
# Clean up: the runs above (checkpoints included) were only for this notebook
clean_up()
