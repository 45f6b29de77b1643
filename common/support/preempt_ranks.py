"""The stop signal of support/preempt.py, for several ranks (chapters 04-06).

One rank that stopped alone would leave the others waiting in the next collective, so the ranks
agree on the step to stop at with an all-reduce of two numbers over a CPU (gloo) group, not on every
step but every K steps: each check measures what it costs and how long a step takes, and K is the
fewest steps that keep the checks under CHECK_SHARE of the time, and a stop waits at most
LONGEST_WAIT_S for the next check.

A stop is final: the stop's checkpoint comes with a marker (STOP_MARKER in the run folder), and a
worker that torchrun restarts (--max-restarts) after its peers stopped finds it and stops too,
instead of training on alone. A new launch (restart count 0) clears it."""

import datetime
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import Stopped
from .preempt import Preemption

# written beside the stop's checkpoint; holds the step it saved and the signal's name
STOP_MARKER = "stopped"
# the agreement may take at most this share of the training time
CHECK_SHARE = 0.01
# and a stop waits at most this long (plus the step in progress) for the next check
LONGEST_WAIT_S = 10.0


def steps_between_checks(check_s: float, step_s: float) -> int:
    """K: the checks cost at most CHECK_SHARE of the steps' time, and come every LONGEST_WAIT_S."""
    if step_s <= 0:
        return 1
    cheap_enough = math.ceil(check_s / (CHECK_SHARE * step_s))
    soon_enough = math.floor(LONGEST_WAIT_S / step_s)
    return max(1, min(cheap_enough, soon_enough))


class AgreedPreemption(Preemption):
    """Listens for SIGTERM and `signal_name`, and the ranks agree on the step to stop at, within
    `ranks_agree_within` (the collectives' timeout).

    Constructed at start-up, before the first step: a worker restarted after the run was asked to
    stop (the marker in `out_dir`) raises Stopped at once."""

    def __init__(
        self,
        signal_name: str,
        out_dir: str | Path,
        ranks_agree_within: datetime.timedelta,
    ):
        # a CPU (gloo) group of its own, whatever the training backend: agreeing never waits for a
        # GPU
        self.group = dist.new_group(backend="gloo", timeout=ranks_agree_within)
        self.rank = dist.get_rank()
        self.marker = Path(out_dir) / STOP_MARKER
        # the agreement's schedule: calls to requested() so far, the next that checks, and the
        # figures it is planned with
        self._calls = 0
        self._next_check = 1
        self._checked_at: float | None = None
        self._check_s = 0.0
        self.interval = 1
        self._stop_if_stopped_before()
        super().__init__(signal_name)

    def _stop_if_stopped_before(self) -> None:
        """A worker torchrun restarted after the run was asked to stop ends at once (Stopped)."""
        restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        marked = self.marker.exists()
        # with c10d, a node whose peers failed rejoins without counting a restart: the largest count
        # and any rank's sight of the marker decide for all
        seen = torch.tensor([float(restart_count), float(marked)])
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

    def requested(self) -> bool:
        """Whether the run should save this step and stop; the same answer on every rank. Called
        once per step, on every rank."""
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
        dist.barrier(group=self.group)  # rank 0 has written the checkpoint before any rank ends
        dist.destroy_process_group(self.group)
        speaks = self.rank == 0
        raise Stopped(name, step, speaks)
