"""Expected mistakes end a run with one clear line, not a traceback."""

import os
import signal
import sys
from collections.abc import Callable


class CourseError(Exception):
    """A mistake the reader can fix: the message says what is wrong and what to do."""


class StopNow:
    """run_main's handler of SIGINT and SIGTERM: it stops the run at once, and keeps the signal's
    name for the line that says so."""

    def __init__(self):
        self.signal_name: str | None = None

    def __call__(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        # a copy passed on by a launcher must not interrupt the way out; SIGKILL stays the force
        signal.signal(signum, signal.SIG_IGN)
        raise KeyboardInterrupt


def rank_prefix() -> str:
    """Under torchrun, "[rank N] " before a line that ends a run: which rank says it."""
    if "RANK" in os.environ:
        return f"[rank {os.environ['RANK']}] "
    return ""


def run_main(main: Callable[[], int | None], resumable: bool = False) -> None:
    """Run a script's main(): a CourseError is one line and status 2, SIGTERM or Ctrl-C one line
    and status 130. `resumable`: the line says to continue with --resume."""
    prefix = rank_prefix()
    stop_now = StopNow()
    signal.signal(signal.SIGINT, stop_now)
    signal.signal(signal.SIGTERM, stop_now)
    try:
        status = main()
    except CourseError as err:
        print(f"{prefix}error: {err}", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, Exception):
        if stop_now.signal_name is None:
            raise  # a real bug: its traceback is what the reader needs
        # a rank in a collective when its peers stopped sees a broken connection: the same stop
        intact = ""
        if resumable:
            intact = ": the last checkpoint written is intact; continue with --resume"
        print(f"{prefix}stopped by {stop_now.signal_name}{intact}", file=sys.stderr)
        sys.exit(130)
    sys.exit(status)  # None: 0
