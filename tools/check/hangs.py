"""A rank's watcher for hangs: where the script waits when it waits in a collective.

The probe (tools/check/probe.py) starts it in every rank under torchrun; the runner reads what it
writes and ends the ranks once all of them wait (tools/check/runner.py end_hang).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path


def where_waiting(script: str, frame) -> dict | None:
    """The script's innermost line and the collective below it, if the main thread waits in one."""
    collective, line = None, None
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if collective is None and "/torch/distributed/" in name:
            collective = frame.f_code.co_name
        if collective is None and "/torch/autograd/" in name:
            collective = "backward (DDP's or FSDP's gradient reduction)"
        # DDP's forward syncs with the other ranks too (its bucket order, after the first step)
        if collective is None and name.endswith("/torch/nn/parallel/distributed.py"):
            collective = f"DDP's {frame.f_code.co_name}"
        if line is None and os.path.abspath(name) == script:
            line = frame.f_lineno
        frame = frame.f_back
    if collective is None or line is None:
        return None
    return {"line": line, "collective": collective}


def watch_for_hangs(script: str, folder: Path, after: float) -> threading.Event:
    """A thread that writes FACTS_DIR/rank<R>.hang.json while the main thread has waited in one
    collective, at one line of the script, for `after` seconds; removed when it moves on."""
    main_id = threading.main_thread().ident
    path = folder / f"rank{int(os.environ.get('RANK', 0))}.hang.json"

    done = threading.Event()

    def loop():
        since, last = time.monotonic(), None
        while not done.wait(0.5):
            frame = sys._current_frames().get(main_id)
            here = where_waiting(script, frame) if frame is not None else None
            # Let go of the main thread's frame now: held through the wait, it could be the last
            # reference to the script's locals when main() returns, and the model (DDP's reducer,
            # the process group) would then be freed on this thread, which deadlocks with gloo's.
            frame = None
            if here != last:
                since, last = time.monotonic(), here
                path.unlink(missing_ok=True)
            elif here is not None and time.monotonic() - since >= after and not path.exists():
                folder.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(here | {"waited_s": round(after), "pid": os.getpid()}))

    threading.Thread(target=loop, daemon=True).start()
    return done
