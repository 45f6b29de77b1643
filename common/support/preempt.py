"""SIGTERM (or the --stop-signal) from Slurm or Kubernetes: chapter 06's ranks save the step they
agree to stop after and end (one line, status 0); the launch that asked for the stop requeues the
job, which continues with --resume. Further copies of the signal are the same stop (SIGKILL stays
the force); Ctrl-C stops at once (status 130). An error met while stopping (a full disk) is an
error: one line, or its traceback for a bug, and status 1.

Chapter 06 listens with Preemption, and its ranks agree on the step to stop at in its loop. In
chapters 01-05 a signal ends the run at once (run_main), and the last checkpoint stays intact."""

import argparse
import signal
import sys

from .errors import rank_prefix

RESUME = "continue with --resume"


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
    """Listens for SIGTERM and `signal_name`, the signals that ask the run to stop.

    Chapter 06's ranks all-reduce signal_number() every few steps."""

    def __init__(self, signal_name: str):
        self.received: str | None = None  # the first stop signal's name
        for name in {"SIGTERM", stop_signal(signal_name)}:
            signal.signal(signal.Signals[name], self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is not None:
            return  # a copy passed on by a launcher, or a repeat while saving: the same stop
        self.received = signal.Signals(signum).name

    def _error_while_stopping(self, kind, error, trace) -> None:
        """Python's last word on an error that ends the run after the stop signal: a file system's
        refusal (a full disk) in one line; a bug with its traceback, then that line."""
        if not isinstance(error, OSError):
            sys.__excepthook__(kind, error, trace)
        during = f"while stopping after {self.received}"
        intact = f"the last checkpoint written is intact; {RESUME}"
        print(f"{rank_prefix()}error {during}: {error}: {intact}", file=sys.stderr)

    def signal_number(self) -> int:
        """The stop signal's number, or 0 when none came: the ranks all-reduce it (MAX), so one
        rank's signal stops every rank, and every rank knows which signal it was."""
        if self.received is None:
            return 0
        return signal.Signals[self.received].value

    def stopping(self, agreed_signal: int) -> str:
        """The ranks agreed to stop on `agreed_signal` (a number): from here on, an error that ends
        the run says it came while stopping. Returns the signal's name.

        (Not from the signal on: torchrun's SIGTERM to the survivors of a failed rank finds them
        failing in a collective, which is that failure, not a stop's.)"""
        self.received = signal.Signals(agreed_signal).name
        sys.excepthook = self._error_while_stopping
        return self.received
