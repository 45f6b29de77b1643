"""Chapter 06's stop for several ranks: the end of a stopped run, and the marker that keeps a stop
final when torchrun restarts a worker.

The ranks agree on the step to stop at in chapter 06's loop, where a reader sees it: every few
steps they all-reduce their stop flags (bench/stop_check.py measures what that costs). A stop is
final: the stop's checkpoint comes with a marker (STOP_MARKER in the run folder), and a worker that
torchrun restarts (--max-restarts) after its peers stopped finds it and stops too, instead of
training on alone. A new launch (restart count 0) clears it.

Both functions are collectives over `group`: every rank calls them."""

import signal
from pathlib import Path

import torch
import torch.distributed as dist

from .preempt import exit_stopped

# written beside the stop's checkpoint; holds the step it saved and the signal's name
STOP_MARKER = "stopped"


def stop_if_stopped_before(out_dir: str | Path, restarts: int, group: dist.ProcessGroup) -> None:
    """A worker torchrun restarted (`restarts`, agreed by all ranks) after the run was stopped
    ends at once, with status 75. A new launch clears an old stop's marker."""
    marker = Path(out_dir) / STOP_MARKER
    rank = dist.get_rank()
    marked = marker.exists()
    # any rank's sight of the marker decides for all
    seen = torch.tensor(float(marked))
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    if restarts == 0:
        if rank == 0:
            marker.unlink(missing_ok=True)  # a new launch: an old stop is over
        return
    if seen.item() == 0:
        return  # restarted after a failure, not a stop: train on
    step, name = "?", "a stop signal"
    if marked:
        step, name = marker.read_text().strip().split(maxsplit=1)
    exit_stopped(f"{name} before torchrun restarted this worker", step, speaks=rank == 0)


def stop_after_saving(
    step: int, signal_number: int, out_dir: str | Path, group: dist.ProcessGroup
) -> None:
    """End the run after the checkpoint of `step` is written: rank 0 marks the run as stopped,
    then every rank exits with status 75 (rank 0 says so). `signal_number`: the stop signal some
    rank received, as the ranks agreed on it."""
    name = signal.Signals(signal_number).name
    rank = dist.get_rank()
    if rank == 0:
        (Path(out_dir) / STOP_MARKER).write_text(f"{step} {name}\n")
    dist.barrier(group=group)  # rank 0 has written the checkpoint and marker before any rank ends
    dist.destroy_process_group(group)
    exit_stopped(name, step, speaks=rank == 0)
