"""Expected mistakes end a run with one clear line, not a traceback."""

import os
import signal
import sys
import traceback
from collections.abc import Callable


class CourseError(Exception):
    """A mistake the reader can fix: the message says what is wrong and what to do."""


EXIT_STOPPED = 75  # os.EX_TEMPFAIL, "try again later": what a run stopped to be resumed asks for


class Stopped(Exception):
    """The run stopped at a step's end after a stop signal, its checkpoint written
    (support/preempt.py, and preempt_ranks.py for several ranks)."""

    def __init__(self, signal_name: str, step: int | str, speaks: bool):
        super().__init__(
            f"stopped by {signal_name} at step {step}: checkpoint saved; continue with --resume"
        )
        self.speaks = speaks


class StopNow:
    """run_main's handler of SIGINT and SIGTERM: it stops at once, and keeps the signal's name. It
    also keeps the name of a stop support/preempt.py is saving for (`saving_for`)."""

    def __init__(self):
        self.signal_name: str | None = None
        self.saving_for: str | None = None

    def __call__(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        # a copy passed on by a launcher must not interrupt the way out; SIGKILL stays the force
        signal.signal(signum, signal.SIG_IGN)
        raise KeyboardInterrupt


def run_main(main: Callable[[], int | None], resumable: bool = False) -> None:
    """Run a script's main(): a CourseError is one line and status 2, a stop signal one line and 130
    (75 for chapter 05's own stop at a step's end); `resumable`: the line says to continue with
    --resume. An error while a stop is under way is an error, with status 1 and its line (or its
    traceback, for a bug)."""
    # under torchrun: who speaks
    prefix = f"[rank {os.environ['RANK']}] " if "RANK" in os.environ else ""
    stop_now = StopNow()
    signal.signal(signal.SIGINT, stop_now)
    signal.signal(signal.SIGTERM, stop_now)
    intact = ""
    if resumable:
        intact = ": the last checkpoint written is intact; continue with --resume"
    try:
        status = main()
    except CourseError as err:
        print(f"{prefix}error: {err}", file=sys.stderr)
        sys.exit(2)
    except Stopped as stopped:
        if stopped.speaks:  # rank 0 speaks for every rank
            print(f"{prefix}{stopped}", file=sys.stderr)
        sys.exit(EXIT_STOPPED)
    except (KeyboardInterrupt, Exception) as err:
        # stopped at once: a rank in a collective when its peers stopped sees a broken connection,
        # not the signal; the same stop
        if stop_now.signal_name is not None:
            print(f"{prefix}stopped by {stop_now.signal_name}{intact}", file=sys.stderr)
            sys.exit(130)
        if stop_now.saving_for is None or isinstance(err, KeyboardInterrupt):
            raise  # a real bug: its traceback is what the reader needs
        # Failing while stopping to save (a full disk, a peer gone) is not the stop: the reader
        # must see it. A file system's refusal is one line; anything else keeps its traceback.
        if not isinstance(err, OSError):
            traceback.print_exc()
        during = f"while stopping after {stop_now.saving_for}"
        print(f"{prefix}error {during}: {err}{intact}", file=sys.stderr)
        sys.exit(1)
    sys.exit(status)  # None: 0
