"""SIGTERM (or the --stop-signal) from SLURM or Kubernetes: the run finishes its step, saves it and
stops (one line, status 75). Further copies of the signal are the same stop and change nothing
(SIGKILL stays the force); Ctrl-C stops at once (status 130).

A stop is final: the stop's checkpoint comes with a marker (STOP_MARKER in the run folder), and a
worker that torchrun restarts (--max-restarts) after its peers stopped finds it and stops too,
instead of training on alone. A new launch (restart count 0) clears it.

The ranks agree on the step to stop at with an all-reduce of two numbers over a CPU (gloo) group,
not on every step but every K steps: each check measures what it costs and how long a step takes,
and K is the fewest steps that keep the checks under CHECK_SHARE of the time, and a stop waits at
most LONGEST_WAIT_S for the next check."""

import argparse
import datetime
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import StopNow, Stopped

# written beside the stop's checkpoint; holds the step it saved and the signal's name
STOP_MARKER = "stopped"
# the agreement may take at most this share of the training time
CHECK_SHARE = 0.01
# and a stop waits at most this long (plus the step in progress) for the next check
LONGEST_WAIT_S = 10.0


def stop_signal(name: str) -> str:
    """--stop-signal: a signal's name, with or without SIG (USR1, SIGUSR1, TERM), as SIGNAME."""
    full = "SIG" + name.upper().removeprefix("SIG")
    why = {"SIGINT": " (Ctrl-C stops at once)", "SIGKILL": " (it cannot be caught)", "SIGSTOP": ""}
    if not hasattr(signal.Signals, full) or full in why:
        message = (
            f"{name} cannot ask the run to stop{why.get(full, '')}; use TERM, USR1, USR2 or HUP"
        )
        raise argparse.ArgumentTypeError(message)
    return full


def steps_between_checks(check_s: float, step_s: float) -> int:
    """K: the checks cost at most CHECK_SHARE of the steps' time, and come every LONGEST_WAIT_S."""
    if step_s <= 0:
        return 1
    cheap_enough = math.ceil(check_s / (CHECK_SHARE * step_s))
    soon_enough = math.floor(LONGEST_WAIT_S / step_s)
    return max(1, min(cheap_enough, soon_enough))


class Preemption:
    """Listens for SIGTERM and `signal_name`. With `ranks_agree_within` (the collectives' timeout)
    the ranks agree on the step to stop at: one that stopped alone would leave the others waiting.

    Constructed at start-up, before the first step: a worker restarted after the run was asked to
    stop (the marker in `out_dir`) raises Stopped at once."""

    def __init__(
        self,
        signal_name: str,
        out_dir: str | Path,
        ranks_agree_within: datetime.timedelta | None = None,
    ):
        # a CPU (gloo) group of its own, whatever the training backend: agreeing never waits for a
        # GPU
        agree = ranks_agree_within is not None
        self.group = dist.new_group(backend="gloo", timeout=ranks_agree_within) if agree else None
        self.rank = dist.get_rank() if agree else 0
        self.marker = Path(out_dir) / STOP_MARKER
        self.received: str | None = None  # the first stop signal's name
        self._stop_now = signal.getsignal(signal.SIGINT)  # run_main's StopNow, if any
        # the agreement's schedule: calls to requested() so far, the next that checks, and the
        # figures it is planned with
        self._calls = 0
        self._next_check = 1
        self._checked_at: float | None = None
        self._check_s = 0.0
        self.interval = 1
        self._stop_if_stopped_before()
        for name in {"SIGTERM", stop_signal(signal_name)}:
            signal.signal(signal.Signals[name], self._on_signal)

    def _stop_if_stopped_before(self) -> None:
        """A worker torchrun restarted after the run was asked to stop ends at once (Stopped)."""
        restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        marked = self.marker.exists()
        # with c10d, a node whose peers failed rejoins without counting a restart: the largest count
        # and any rank's sight of the marker decide for all
        seen = torch.tensor([float(restart_count), float(marked)])
        if self.group is not None:
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.group)
        restarted = seen[0].item() > 0
        if not restarted:
            if self.rank == 0:
                self.marker.unlink(missing_ok=True)  # a new launch: an old stop is over
            return
        if seen[1].item() > 0:
            step_and_signal = ["?", "a stop signal"]
            if marked:
                step_and_signal = self.marker.read_text().strip().split(maxsplit=1)
            step = step_and_signal[0]
            name = f"{step_and_signal[1]} before torchrun restarted this worker"
            raise Stopped(name, step, self.rank == 0)

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None:
            return  # a copy passed on by a launcher, or a repeat while saving: the same stop
        self.received = signal.Signals(signum).name
        if isinstance(self._stop_now, StopNow):
            # an error from now on happened while stopping: run_main says so
            self._stop_now.saving_for = self.received

    def requested(self) -> bool:
        """Whether the run should save this step and stop; the same answer on every rank. Called
        once per step, on every rank."""
        if self.group is None:
            return self.received is not None
        self._calls += 1
        if self._calls < self._next_check:
            return False
        started = time.perf_counter()
        # the step time since the last check, without the check itself
        proposal = 1
        if self._checked_at is not None:
            steps = self.interval
            step_s = (started - self._checked_at) / steps
            proposal = steps_between_checks(self._check_s, step_s)
        # two numbers on the CPU: anyone's stop, and the longest interval proposed (every rank then
        # plans the same next check)
        flags = torch.tensor([float(self.received is not None), float(proposal)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        self._checked_at = time.perf_counter()
        self._check_s = self._checked_at - started
        self.interval = int(flags[1].item())
        self._next_check = self._calls + self.interval
        return flags[0].item() > 0

    def stop(self, step: int) -> None:
        """End the run after the checkpoint of `step` is written: marks the run as stopped, then
        raises Stopped for run_main."""
        name = self.received or "another rank's stop signal"
        if self.rank == 0:
            self.marker.write_text(f"{step} {name}\n")
        if self.group is not None:
            dist.barrier(group=self.group)  # rank 0 has written the checkpoint before any rank ends
            dist.destroy_process_group(self.group)
        speaks = self.rank == 0
        raise Stopped(name, step, speaks)
