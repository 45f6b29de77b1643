"""SIGTERM (or the --stop-signal) from SLURM or Kubernetes: chapter 05's run saves the step its
ranks agree to stop after and stops (one line, status 75). Further copies of the signal are the
same stop and change nothing (SIGKILL stays the force); Ctrl-C stops at once (status 130).

Chapter 05 listens with Preemption; its ranks also agree on the step to stop at, and a stop must
stay final when torchrun restarts a worker: support/preempt_ranks.py. In chapters 01-04 a signal
ends the run at once (run_main), and the last checkpoint stays intact."""

import argparse
import signal

from .errors import StopNow


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
    """Listens for SIGTERM and `signal_name`; chapter 05's ranks all-reduce signal_number() every
    few steps."""

    def __init__(self, signal_name: str):
        self.received: str | None = None  # the first stop signal's name
        self._stop_now = signal.getsignal(signal.SIGINT)  # run_main's StopNow, if any
        for name in {"SIGTERM", stop_signal(signal_name)}:
            signal.signal(signal.Signals[name], self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None:
            return  # a copy passed on by a launcher, or a repeat while saving: the same stop
        self.received = signal.Signals(signum).name
        if isinstance(self._stop_now, StopNow):
            # an error from now on happened while stopping: run_main says so
            self._stop_now.saving_for = self.received

    def requested(self) -> bool:
        """Whether the run should save this step and stop."""
        return self.received is not None

    def signal_number(self) -> int:
        """The stop signal's number, or 0 when none came: the ranks all-reduce it (MAX), so one
        rank's signal stops every rank, and every rank knows which signal it was."""
        if self.received is None:
            return 0
        return signal.Signals[self.received].value
