"""Run a chapter's script unchanged, and record what its metrics.jsonl does not: data wait, memory, threads.

    python bench/probe.py 01_single_gpu/train.py --preset small ...        # instead of python SCRIPT
    torchrun --nproc-per-node=2 bench/probe.py 04_ddp/train.py ...         # instead of torchrun SCRIPT

The benchmark starts every chapter through this file. It replaces `common.data.batch_loader` (the
function every chapter builds its training batches with) by one that hands out the same batches
but times each `next(batches)`, notes the clocks whenever a training metrics line is written, then
runs the script with `runpy` as `python SCRIPT` would. At exit each process writes
`probe_rank<RANK>.json` into $BENCH_PROBE_DIR (nothing when unset):

    data_wait_s   seconds each training `next(batches)` took, in call order
    call_wall_s   perf_counter() when each call began: consecutive calls bracket training steps
    call_cpu_s    process_time() when each call began (CPU seconds of all the process's threads)
    log_marks     iter, perf_counter() and process_time() as each training metrics line is written
                  (MetricsLog.write is wrapped too): the CPU time of the chapter's own log intervals
    maxrss_mb     the process's peak resident memory (getrusage), its DataLoader workers included
    threads       torch.get_num_threads() in the process at exit (intra-op threads)

The cost is three clock reads per batch: about a microsecond.
"""

from __future__ import annotations

import json
import os
import resource
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import common.data  # noqa: E402
import common.metrics  # noqa: E402

DATA_WAIT_S: list[float] = []  # duration of each training next(batches)
CALL_WALL_S: list[float] = []  # perf_counter() when each next(batches) began
CALL_CPU_S: list[float] = []  # process_time() (CPU seconds of all threads) when each began
LOG_MARKS: list[dict] = []  # at each training metrics line: its iter, perf_counter(), process_time()
_original_batch_loader = common.data.batch_loader
_original_write = common.metrics.MetricsLog.write


class TimedLoader:
    """The chapter's DataLoader, with the time of every `next()` on its iterator recorded."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        it = iter(self.loader)  # the DataLoader's own iterator is made on the first next()
        while True:
            start = time.perf_counter()
            CALL_WALL_S.append(start)
            CALL_CPU_S.append(time.process_time())
            try:
                batch = next(it)
            except StopIteration:
                return
            DATA_WAIT_S.append(time.perf_counter() - start)
            yield batch

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):  # sampler, batch_size, ...: as the real loader has them
        return getattr(self.loader, name)


def timed_batch_loader(*args, **kwargs):
    return TimedLoader(_original_batch_loader(*args, **kwargs))


def marked_write(self, **fields):
    """MetricsLog.write, noting the clocks when a training line (one with dt_ms) is written."""
    if self.enabled and "dt_ms" in fields:
        LOG_MARKS.append(
            {"iter": fields.get("iter"), "wall_s": time.perf_counter(), "cpu_s": time.process_time()}
        )
    return _original_write(self, **fields)


def write_probe() -> None:
    folder = os.environ.get("BENCH_PROBE_DIR")
    if not folder:
        return
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    record = {
        "rank": int(os.environ.get("RANK", 0)),
        "data_wait_s": DATA_WAIT_S,
        "call_wall_s": CALL_WALL_S,
        "call_cpu_s": CALL_CPU_S,
        "log_marks": LOG_MARKS,
        "maxrss_mb": round(own + workers if workers > 0 else own, 1),
        "threads": torch.get_num_threads(),
    }
    path = Path(folder) / f"probe_rank{record['rank']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python bench/probe.py CHAPTER_SCRIPT [ARGS...]")
    script = str(Path(sys.argv[1]).resolve())
    common.data.batch_loader = timed_batch_loader  # the chapter imports it after this line
    common.metrics.MetricsLog.write = marked_write
    sys.argv = [script, *sys.argv[2:]]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        write_probe()


if __name__ == "__main__":
    main()
