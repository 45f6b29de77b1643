"""The run folder (--out-dir): one run at a time, and never another run's files overwritten.

A new run (no --resume) refuses a folder that holds a run. The writing process (global rank 0)
holds a flock on the folder itself while it lives; the system drops it however the process ends
(even kill -9), so a dead run leaves no stale lock behind.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import torch.distributed as dist

from ..checkpoint import CKPT_NAME
from ..metrics import METRICS_NAME
from .errors import CourseError


def holds_a_run(out_dir: Path) -> bool:
    """A checkpoint, or metrics with at least one line: the traces of an earlier run."""
    metrics = out_dir / METRICS_NAME
    return (out_dir / CKPT_NAME).exists() or (metrics.exists() and metrics.stat().st_size > 0)


def claim_out_dir(out_dir: str | Path, resume: bool) -> None:
    """Make sure `out_dir` can take this run's files, and lock it until this process ends.

    Global rank 0 alone checks and locks (by a descriptor never closed); every rank hears its
    verdict, so when the folder is refused all ranks stop with the same line and none waits.
    """
    distributed = dist.is_available() and dist.is_initialized()
    problem = None
    if not distributed or dist.get_rank() == 0:
        try:
            _claim(Path(out_dir), resume)
        except CourseError as err:
            problem = str(err)
    if distributed:
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        problem = verdict[0]
    if problem:
        raise CourseError(problem)


# What the lock covers depends on the file system. On a local disk it excludes every other process.
# On NFS a flock excludes only processes of the same machine (the client): two runs started on two
# machines into one folder of an NFS share are not kept apart, so give each run its own --out-dir.
# Some file systems cannot lock at all (Lustre mounted without the flock option answers ENOSYS, an
# NFS without its lock service ENOLCK): the run then stops with one line that says so, and
# COURSE_NO_LOCK=1 in the environment runs without the lock; keeping other runs out of the folder
# is then the reader's task.
NO_LOCK = "COURSE_NO_LOCK"


def _claim(out_dir: Path, resume: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = os.open(out_dir, os.O_RDONLY)
    try:
        if os.environ.get(NO_LOCK) != "1":
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(lock)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):  # another process holds the lock
            raise CourseError(
                f"{out_dir} is in use by a run that is still going (it holds a lock on the folder); "
                "wait for it to end, or give this run another --out-dir"
            ) from None
        raise CourseError(
            f"the file system of {out_dir} cannot lock the folder ({os.strerror(err.errno or 0)}): "
            f"use an --out-dir on another file system, or run with {NO_LOCK}=1 to go on without "
            "the lock, making sure no other run writes into this folder"
        ) from None
    if not resume and holds_a_run(out_dir):
        os.close(lock)
        raise CourseError(
            f"{out_dir} already holds a run (its {CKPT_NAME} / {METRICS_NAME}); continue it "
            f"with --resume, start a new run with another --out-dir, or delete {out_dir} first"
        )
