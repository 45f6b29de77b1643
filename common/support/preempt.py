"""SIGTERM (or the --stop-signal) from SLURM or Kubernetes: chapter 06's run saves the step its
ranks agree to stop after and stops (one line, status 75), for the job to be requeued and resumed.
Further copies of the signal are the same stop (SIGKILL stays the force); Ctrl-C stops at once
(status 130). An error met while stopping (a full disk) is an error: one line, or its traceback for
a bug, and status 1.

Chapter 06 listens with Preemption; its ranks agree on the step to stop at in its loop, and a stop
stays final when torchrun restarts a worker: support/preempt_ranks.py. In chapters 01-05 a signal
ends the run at once (run_main), and the last checkpoint stays intact."""

import argparse
import signal
import sys
from typing import NoReturn

from .errors import rank_prefix

EXIT_STOPPED = 75  # os.EX_TEMPFAIL, "try again later": what a run stopped to be resumed asks for
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
        # The run stops from this check on, so an error that ends it now was met while stopping:
        # its last line says so. (Not from the signal on: torchrun's SIGTERM to the survivors of a
        # failed rank finds them failing in a collective, which is that failure, not a stop's.)
        sys.excepthook = self._error_while_stopping
        return signal.Signals[self.received].value


def exit_stopped(signal_name: str, step: int | str, speaks: bool) -> NoReturn:
    """End a run stopped at a step's end, its checkpoint written: one line (from the rank that
    `speaks` for all), then status 75."""
    if speaks:
        message = f"stopped by {signal_name} at step {step}: checkpoint saved; {RESUME}"
        print(f"{rank_prefix()}{message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_STOPPED)
