"""Expected mistakes end a run with one clear line, not a traceback."""

from __future__ import annotations

import os
import sys
from typing import Callable


class CourseError(Exception):
    """A mistake the reader can fix: the message says what is wrong and what to do."""


def run_main(main: Callable[[], int | None]) -> None:
    """Run a script's main(); a CourseError becomes `error: <message>` on stderr and exit status 2."""
    try:
        status = main()
    except CourseError as err:
        # under torchrun every rank may fail alike: say which rank is speaking
        prefix = f"[rank {os.environ['RANK']}] " if "RANK" in os.environ else ""
        print(f"{prefix}error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: the last checkpoint written is intact; continue with --resume", file=sys.stderr)
        sys.exit(130)
    sys.exit(status or 0)
