"""Expected mistakes end a run with one clear line, not a traceback."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable


class CourseError(Exception):
    """A mistake the reader can fix: the message says what is wrong and what to do."""


def run_main(main: Callable[[], int | None]) -> None:
    """Run a script's main(); a CourseError becomes `error: <message>` on stderr and exit status 2.

    Ctrl-C (SIGINT) and SIGTERM end the run with one line too. Under torchrun both reach every rank:
    Ctrl-C goes to every process of the terminal's foreground job, and torchrun passes a SIGTERM it
    receives on to its workers. A rank that is waiting inside a collective when its peers stop sees
    a broken connection rather than the signal; once a stop signal has arrived, that is part of the
    same stop, so it gets the same one line, not a traceback.
    """
    # under torchrun every rank speaks for itself: say which rank is speaking
    prefix = f"[rank {os.environ['RANK']}] " if "RANK" in os.environ else ""
    stop_signals = []

    def stop(signum, frame):
        stop_signals.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        status = main()
    except CourseError as err:
        print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (KeyboardInterrupt, Exception):
        if not stop_signals:
            raise  # a real bug: its traceback is what the reader needs
        intact = "the last checkpoint written is intact; continue with --resume"
        print(f"{prefix}stopped by {stop_signals[0]}: {intact}", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit(status or 0)
