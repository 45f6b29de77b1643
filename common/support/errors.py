"""Expected mistakes end a run with one clear line, not a traceback."""

import os
import signal
import sys
from collections.abc import Callable


class CourseError(Exception):
    """A mistake the reader can fix: the message says what is wrong and what to do."""


EXIT_STOPPED = 75  # os.EX_TEMPFAIL, "try again later": what a run stopped to be resumed asks for


class Stopped(Exception):
    """The run stopped at a step's end after a stop signal, its checkpoint written
    (support/preempt.py)."""

    def __init__(self, signal_name: str, step: int, speaks: bool):
        super().__init__(
            f"stopped by {signal_name} at step {step}: checkpoint saved; continue with --resume"
        )
        self.speaks = speaks


class StopNow(list):
    """run_main's handler of SIGINT and SIGTERM: it remembers the signal's name, then stops at once."""

    def __call__(self, signum, frame):
        self.append(signal.Signals(signum).name)
        raise KeyboardInterrupt


def run_main(main: Callable[[], int | None], resumable: bool = False) -> None:
    """Run a script's main(): a CourseError is one line and status 2, a stop signal one line and 130
    (75
    for a loop's own stop at a step's end); `resumable`: the line says to continue with --resume."""
    # under torchrun: who speaks
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
        # a rank in a collective when its peers stop sees a broken connection, not the signal: same
        # stop
        if not stop_now:
            raise  # a real bug: its traceback is what the reader needs
        intact = (
            ": the last checkpoint written is intact; continue with --resume" if resumable else ""
        )
        print(f"{prefix}stopped by {stop_now[0]}{intact}", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit(status or 0)
