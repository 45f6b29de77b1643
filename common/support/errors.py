"""Expected mistakes end a run with one clear line, not a traceback."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable


class CourseError(Exception):
    """A mistake the reader can fix: the message says what is wrong and what to do."""


# os.EX_TEMPFAIL, "try again later": what a run stopped to be resumed asks of whoever started it
EXIT_STOPPED = 75


class Stopped(Exception):
    """The run stopped at a step's end after a stop signal, its checkpoint written
    (common/support/preempt.py): run_main says so in one line, from rank 0 only, and exits with
    EXIT_STOPPED."""

    def __init__(self, signal_name: str, step: int, speaks: bool):
        super().__init__(f"stopped by {signal_name} at step {step}: checkpoint saved; continue with --resume")
        self.speaks = speaks


class StopNow:
    """run_main's handler of SIGINT and SIGTERM: it remembers the signal, then stops the run at once.

    common/support/preempt.py takes SIGTERM over for a stop at the step's end, and tells this
    handler (note) which signal came, so that a failure after it reads as part of that stop.
    """

    def __init__(self):
        self.received: list[str] = []

    def note(self, signum: int) -> None:
        self.received.append(signal.Signals(signum).name)

    def __call__(self, signum, frame):
        self.note(signum)
        raise KeyboardInterrupt


def run_main(main: Callable[[], int | None], resumable: bool = False) -> None:
    """Run a script's main(); a CourseError becomes `error: <message>` on stderr and exit status 2.

    Ctrl-C (SIGINT) and SIGTERM end the run with one line too, which says to continue with
    --resume in a script that has it (`resumable`). Under torchrun both reach every rank: Ctrl-C
    goes to every process of the terminal's foreground job, and torchrun passes a SIGTERM it
    receives on to its workers. A rank that is waiting inside a collective when its peers stop sees
    a broken connection rather than the signal; once a stop signal has arrived, that is part of the
    same stop, so it gets the same one line, not a traceback.

    A training loop that listens for SIGTERM itself (common/support/preempt.py) stops at the end of
    a step, after saving it: one line from rank 0 and exit status 75.
    """
    # under torchrun every rank speaks for itself: say which rank is speaking
    prefix = f"[rank {os.environ['RANK']}] " if "RANK" in os.environ else ""
    stop_now = StopNow()
    signal.signal(signal.SIGINT, stop_now)
    signal.signal(signal.SIGTERM, stop_now)
    try:
        status = main()
    except CourseError as err:
        print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Stopped as stopped:
        if stopped.speaks:  # rank 0 speaks for every rank
            print(f"{prefix}{stopped}", file=sys.stderr, flush=True)
        sys.exit(EXIT_STOPPED)
    except (KeyboardInterrupt, Exception):
        if not stop_now.received:
            raise  # a real bug: its traceback is what the reader needs
        intact = ": the last checkpoint written is intact; continue with --resume" if resumable else ""
        print(f"{prefix}stopped by {stop_now.received[0]}{intact}", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit(status or 0)
