"""The one way the course's measuring scripts time training steps: wall and CPU time per step,
in groups.

    timer = StepTimer(device)
    for steps, keep in schedule(iters=30, warmup=5, group=5):   # (5, False), (5, True), ...
        with timer.group(steps, keep=keep):
            for _ in range(steps):
                train_step()
    timer.median(), timer.median(cpu=True)                      # milliseconds per step

A group is timed as a whole and divided by its steps, so the clocks are read (and a GPU's queued
work waited for) only at its edges, as the chapters time their log intervals. The CPU time is the
process's, all threads: other programs on a shared machine stretch wall time far more than CPU
time. `kind` keeps several kinds of step apart in one timer (DDP steps with and without the
all-reduce, or implementations taking turns).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict

import torch


def schedule(iters: int, warmup: int, group: int) -> list[tuple[int, bool]]:
    """(steps, keep) for each group of the `iters` steps: the warm-up first (not kept), then
    groups of `group` steps."""
    groups = [(warmup, False)] if warmup > 0 else []
    done = warmup
    while done < iters:
        groups.append((min(group, iters - done), True))
        done += groups[-1][0]
    return groups


class StepTimer:
    """Milliseconds per step, wall and CPU, for each kind of step: one figure per timed group."""

    def __init__(self, device: torch.device):
        self.device = device
        self.wall_ms: dict[str, list[float]] = defaultdict(list)
        self.cpu_ms: dict[str, list[float]] = defaultdict(list)

    def clocks(self) -> tuple[float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the GPU's queued work belongs to the steps
        return time.perf_counter(), time.process_time()

    @contextlib.contextmanager
    def group(self, steps: int = 1, kind: str = "step", keep: bool = True):
        """Time the steps run inside; keep=False runs them untimed (a warm-up)."""
        wall, cpu = self.clocks()
        yield
        if keep:
            wall_end, cpu_end = self.clocks()
            self.wall_ms[kind].append(1000 * (wall_end - wall) / steps)
            self.cpu_ms[kind].append(1000 * (cpu_end - cpu) / steps)

    def groups(self, kind: str = "step", cpu: bool = False) -> list[float]:
        return [round(ms, 3) for ms in (self.cpu_ms if cpu else self.wall_ms)[kind]]

    def median(self, kind: str = "step", cpu: bool = False) -> float:
        """The median group: robust to the bursts of a busy machine."""
        return statistics.median((self.cpu_ms if cpu else self.wall_ms)[kind])

    def mean(self, kind: str = "step", cpu: bool = False) -> float:
        return statistics.mean((self.cpu_ms if cpu else self.wall_ms)[kind])
