"""SIGTERM (or the --stop-signal) from SLURM or Kubernetes: the run finishes its step, saves it and
stops
(one line, status 75). A second signal, Ctrl-C or a rank stuck on a dead peer stop at once (status
130)."""

import argparse
import datetime
import signal
import time

import torch
import torch.distributed as dist

from .errors import StopNow, Stopped

# torchrun and srun pass on a signal their workers may have had: a repeat this soon is the same stop
SAME_STOP_S = 5.0


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


class Preemption:
    """Listens for SIGTERM and `signal_name`. With `ranks_agree_within` (the collectives' timeout)
    the
    ranks agree on the step to stop at: one that stopped alone would leave the others waiting."""

    def __init__(
        self, signal_name: str = "SIGTERM", ranks_agree_within: datetime.timedelta | None = None
    ):
        # a CPU (gloo) group of its own, whatever the training backend: agreeing never waits for a
        # GPU
        agree = ranks_agree_within is not None
        self.group = dist.new_group(backend="gloo", timeout=ranks_agree_within) if agree else None
        self.received: str | None = None  # the first stop signal's name
        self._received_at = 0.0
        self._stop_now = signal.getsignal(signal.SIGINT)  # run_main's StopNow, if any
        for name in {"SIGTERM", stop_signal(signal_name)}:
            signal.signal(signal.Signals[name], self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._received_at = signal.Signals(signum).name, now
            if isinstance(self._stop_now, StopNow):
                # a collective that fails from now on: this stop
                self._stop_now.append(self.received)
            return
        if now - self._received_at < SAME_STOP_S:
            return  # the same request, passed on by a launcher
        raise KeyboardInterrupt  # run_main's one line names the first signal

    def requested(self) -> bool:
        """Whether the run should save this step and stop; the same answer on every rank."""
        if self.group is None:
            return self.received is not None
        flag = torch.tensor(float(self.received is not None))  # one number per step, on the CPU
        dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=self.group)
        return flag.item() > 0

    def stop(self, step: int) -> None:
        """End the run after the checkpoint of `step` is written: raises Stopped for run_main."""
        if self.group is not None:
            dist.barrier(group=self.group)  # rank 0 has written the checkpoint before any rank ends
        speaks = self.group is None or dist.get_rank() == 0
        raise Stopped(self.received or "another rank's stop signal", step, speaks)
